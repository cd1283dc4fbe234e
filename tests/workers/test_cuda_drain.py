"""A CUDA worker's drain/abandon at a call's end sleeps until its streams are idle before the native copy engine's
synchronize, whose cudaStreamSynchronize spins a core for as long as a stream is busy (issue 51, item 7).

No GPU is needed: a CudaWorker made without __init__ gets fake streams (work issued and done, as counts), fake
blocking events (a wait completes the stream up to the event) and fake copies (held-back windows; a synchronize
that fails if it is entered while a stream still has work, where the real one would spin)."""
import pytest
import torch

from roundpipe.workers.cuda import CudaWorker

COPY_QUEUES = ("act_up", "act_down", "param_up", "grad_down")


class FakeStream:
    """Work queued on a stream: `issued` items, of which `done` completed (in order)."""

    def __init__(self, name: str, issued: int):
        self.name, self.issued, self.done = name, issued, 0


class FakeEvent:
    """torch.cuda.Event: record() marks the stream's work so far; synchronize() waits for it (a blocking event
    sleeps: the stream's work up to the mark completes meanwhile)."""

    log: list = []

    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.blocking, self.stream, self.mark = blocking, None, 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, stream.issued
        self.log.append(("record", stream.name))

    def synchronize(self) -> None:
        assert self.blocking, "a spinning event wait"
        self.stream.done = max(self.stream.done, self.mark)
        self.log.append(("event wait", self.stream.name))


class FakeCopies:
    """The worker's Transfers: windows held back on the bulk queues until a flush sends them onto their stream."""

    def __init__(self, streams: dict, log: list):
        self.streams, self.log = streams, log
        self.held = {"param_up": 2, "grad_down": 3}
        self.released = 0

    def flush(self, only=None) -> None:
        for queue, n in self.held.items():
            self.streams[queue].issued += n
        self.held = {q: 0 for q in self.held}
        self.log.append(("flush",))

    def synchronize(self) -> None:
        self.flush()
        busy = [s.name for s in self.streams.values() if s.done < s.issued]
        assert not busy, f"cudaStreamSynchronize entered while {busy} still had work: it spins a core until done"
        self.log.append(("copies.synchronize",))
        self.release_completed()

    def release_completed(self) -> None:
        self.released += 1


class FakeCompleter:
    def wait_idle(self, raise_errors: bool = False) -> None:
        pass

    def discard_error(self) -> None:
        pass


def fake_worker(monkeypatch) -> tuple[CudaWorker, FakeCopies, list]:
    log: list = []
    monkeypatch.setattr(FakeEvent, "log", log)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    w = object.__new__(CudaWorker)
    w.s_compute = FakeStream("compute", 4)
    streams = {q: FakeStream(q, 1) for q in COPY_QUEUES}
    w.s_act_up, w.s_act_down = streams["act_up"], streams["act_down"]
    w.s_param_up, w.s_grad_down = streams["param_up"], streams["grad_down"]
    w._streams = streams
    w.copies = FakeCopies(streams, log)
    w._completer = FakeCompleter()
    w._timers, w._anchor = [], None
    return w, w.copies, log


@pytest.mark.parametrize("end", ["drain", "abandon"])
def test_the_copy_engines_synchronize_runs_only_on_idle_streams(monkeypatch, end):
    """drain() and abandon(): held-back windows are sent, every stream's blocking event is waited for, and only
    then the copy engine's synchronize runs (it found work pending before: a spinning wait for the call's tail of
    copies), which still lets go of the completed copies' buffers."""
    w, copies, log = fake_worker(monkeypatch)
    getattr(w, end)()
    first_sync = log.index(("copies.synchronize",))
    assert log.index(("flush",)) < log.index(("record", "param_up")), log   # the events cover the sent windows
    waited = {entry[1] for entry in log[:first_sync] if entry[0] == "event wait"}
    assert waited == {"compute", *COPY_QUEUES}, log
    assert copies.released >= 1
    assert all(s.done == s.issued for s in (w.s_compute, *w._streams.values()))
