"""Bubble accounting of a trace, simulated or measured.

bubble ratio = idle / (window length x workers).  Every idle interval of a worker
is classified by what surrounds it:

    fill    before the worker's first event (the pipeline filling up)
    drain   after its last event (the pipeline draining)
    switch  between events of two different stages (waiting for the next
            stage's input: interleaving, round boundaries, imbalance between stages)
    steady  between two events of the same stage (a microbatch waiting on its
            predecessor inside a stage, e.g. a slower neighbour stage)

An event's stage is `args["stage"]` (+ `args["iteration"]`) when present, else the
first word of its name ("F2 mb1" -> "F2"), so measured engine traces work too.
With a window (the steady state of an asynchronous run) only the part of each
interval inside it counts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from roundpipe.trace import Event, Trace


@dataclass(frozen=True)
class Bubbles:
    makespan: float      # window length (seconds)
    workers: int
    busy: float          # summed busy seconds in the window
    fill: float          # idle seconds by kind, summed over workers
    switch: float
    drain: float
    steady: float

    @property
    def idle(self) -> float:
        return self.fill + self.switch + self.drain + self.steady

    @property
    def ratio(self) -> float:
        capacity = self.makespan * self.workers
        return self.idle / capacity if capacity > 0 else 0.0

    def percent(self) -> dict[str, float]:
        """The ratio and each part as percent of makespan x workers."""
        cap = self.makespan * self.workers or 1.0
        return {"bubble_ratio": 100 * self.ratio, **{k: 100 * getattr(self, k) / cap
                                                     for k in ("fill", "switch", "drain", "steady")}}

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "idle": self.idle, "ratio": self.ratio}


def stage_key(e: Event) -> tuple:
    if "stage" in e.args:
        return (e.args.get("iteration", 0), e.args["stage"])
    return (0, e.name.split(" ", 1)[0])


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def bubbles(trace: Trace, window: tuple[float, float] | None = None, workers: list[str] | None = None) -> Bubbles:
    """Idle time of each worker in `window` (default: first start to last end), by kind.

    Compute only: copy events (cat "copy", the queues of a recorded engine trace) are left out."""
    events = [e for e in trace.events if e.cat != "copy"]
    workers = workers if workers is not None else list(dict.fromkeys(e.worker for e in events))
    if not events:
        raise ValueError("trace has no events: nothing to measure")
    lo, hi = window if window is not None else (min(e.start for e in events), max(e.end for e in events))
    if not hi >= lo:
        raise ValueError(f"window={window!r} must be (start, end) with end >= start")
    kinds = dict.fromkeys(("fill", "switch", "drain", "steady"), 0.0)
    busy = 0.0
    for w in workers:
        mine = sorted((e for e in events if e.worker == w), key=lambda e: (e.start, e.end))
        if not mine:
            kinds["fill"] += hi - lo
            continue
        busy += sum(_clip(e.start, e.end, lo, hi) for e in mine)
        kinds["fill"] += _clip(lo, mine[0].start, lo, hi)
        last_end = mine[0].end
        for prev, nxt in zip(mine, mine[1:]):
            last_end = max(last_end, prev.end)
            if nxt.start > last_end:
                kind = "steady" if stage_key(prev) == stage_key(nxt) else "switch"
                kinds[kind] += _clip(last_end, nxt.start, lo, hi)
        last_end = max(last_end, mine[-1].end)
        kinds["drain"] += _clip(last_end, hi, lo, hi)
    return Bubbles(hi - lo, len(workers), busy, **kinds)


def span_bubble(run) -> float:
    """The Zero Bubble paper's bubble rate of a simulated `events.Run` (Qi et al. 2024, section 5.3):
    (cost - work) / cost, where cost is the longest span of a worker (its first start to its last end,
    so the fill before and the drain after a worker's own work do not count) and work is that worker's
    busy time.  Copy tasks are left out, as in `bubbles`, and so is the host's optimizer step (the
    "host step" worker of roundpipe.sim.hoststep)."""
    best = (0.0, 0.0)
    for program in run.schedule.programs:
        mine = [i for i in program if run.schedule.tasks[i].cat not in ("copy", "optimizer")]
        if mine:
            span = max(run.end[i] for i in mine) - min(run.start[i] for i in mine)
            best = max(best, (span, sum(run.schedule.tasks[i].duration for i in mine)))
    span, work = best
    return (span - work) / span if span > 0 else 0.0
