"""One trace format for the simulator and the real engine: Chrome/Perfetto trace JSON.

Each event is one piece of work on one worker ("cuda:0", "cpu:1", "GPU 3" in a
simulation): a name such as "F2 mb1" or "B1 mb0", a category ("forward",
"backward", "fused", "copy", "optimizer", ...) and start/end times in seconds.
`Trace.save` writes the "traceEvents" JSON that chrome://tracing and
ui.perfetto.dev open; `Trace.load` reads it back, so `roundpipe timeline` can
draw a simulated and a measured iteration the same way.

Categories: the simulator writes the names in `CATEGORIES`; the engine writes
its stage kinds ("F", "fused", "B"; a "B" event holds the recompute and the
backward of its microbatch, which the simulator draws as two events).
`category()` reads either as the shared name, so both are drawn and counted
alike; the recorded `cat` itself is kept as written.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The shared event categories, in the order a timeline's legend lists them.
CATEGORIES = ("forward", "fused", "recompute", "backward", "copy", "optimizer")
_ENGINE_KINDS = {"F": "forward", "B": "backward"}


def category(cat: str) -> str:
    """The shared name of an event category: the engine's "F" / "B" read as "forward" / "backward"."""
    return _ENGINE_KINDS.get(cat, cat)


@dataclass(frozen=True)
class Event:
    worker: str
    name: str
    start: float  # seconds
    end: float    # seconds
    cat: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Trace:
    """A thread-safe list of events with Chrome-trace JSON round trip."""

    def __init__(self, events: list[Event] | None = None, metadata: dict[str, Any] | None = None):
        self.events: list[Event] = list(events or [])
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._lock = threading.Lock()

    def add(self, worker: str, name: str, start: float, end: float, cat: str = "", **args: Any) -> None:
        if end < start:
            raise ValueError(f"event {name!r} on {worker!r} ends ({end}) before it starts ({start})")
        with self._lock:
            self.events.append(Event(str(worker), name, float(start), float(end), cat, args))

    @contextlib.contextmanager
    def span(self, worker: str, name: str, cat: str = "", **args: Any):
        """Records the wall-clock time (time.perf_counter) of the `with` body as one event.

        For host-side work; GPU work should be timed with CUDA events and passed to `add`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(worker, name, start, time.perf_counter(), cat, **args)

    def scoped(self, **args: Any) -> "TraceScope":
        """A view whose `add` also stamps `args` on every event (e.g. the engine's iteration)."""
        return TraceScope(self, args)

    def workers(self) -> list[str]:
        return list(dict.fromkeys(e.worker for e in self.events))

    def to_chrome(self) -> dict[str, Any]:
        with self._lock:
            events = sorted(self.events, key=lambda e: (e.start, e.worker))
        t0 = min((e.start for e in events), default=0.0)
        tids = {w: i for i, w in enumerate(dict.fromkeys(e.worker for e in events))}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": w}} for w, tid in tids.items()
        ]
        out += [{"ph": "X", "name": e.name, "cat": e.cat, "pid": 0, "tid": tids[e.worker],
                 "ts": (e.start - t0) * 1e6, "dur": e.duration * 1e6, "args": e.args} for e in events]
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": self.metadata}

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)

    @classmethod
    def from_chrome(cls, data: dict[str, Any]) -> "Trace":
        if not isinstance(data, dict) or "traceEvents" not in data:
            raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
        names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        events = [Event(names.get(e["tid"], str(e["tid"])), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                        e.get("cat", ""), dict(e.get("args", {})))
                  for e in data["traceEvents"] if e.get("ph") == "X"]
        return cls(events, data.get("otherData", {}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        with open(path) as f:
            return cls.from_chrome(json.load(f))


class TraceScope:
    """Adds fixed args to every event it records into a Trace.

    The engine gives each call its own scope with `iteration=j`, and `stage` (the first
    word of the event name, as roundpipe.sim.metrics reads it) is filled in, so the
    same stage label in two calls counts as two stages when bubbles are classified."""

    def __init__(self, trace: Trace, args: dict[str, Any]):
        self.trace, self.args = trace, args

    def add(self, worker: str, name: str, start: float, end: float, cat: str = "", **args: Any) -> None:
        self.trace.add(worker, name, start, end, cat, **{"stage": name.split(" ", 1)[0], **self.args, **args})
