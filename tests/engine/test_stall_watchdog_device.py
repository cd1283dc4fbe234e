"""The stall watchdog counts work a device has done, not work issued (issue 51, item 6): a worker whose queued
device work keeps completing is never declared stalled however long its thread waits for that work, and one whose
queued work completes nothing for stall_timeout still is.

No GPU is needed: `LateDevice` is a CPU worker modelling a GPU's queue.  Each microbatch it issues is device work
of DEVICE_S seconds that a device thread completes in order (a HostFence set by that thread, as a CUDA event
completes), its progress fence is the last such fence (a CUDA worker's: an event on its compute stream), and its
drain waits for the queue as CudaWorker.drain waits for its streams.  Each worker's queue holds about 4-6
microbatches, so its thread waits 1-1.5 s at the call's end, longer than stall_timeout, while each microbatch
completes well within it."""
import queue
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe import _native
from roundpipe.core.errors import RoundPipeStalled
from roundpipe.workers.cpu import CpuWorker

pytestmark = pytest.mark.skipif(not _native.available(), reason="the fake device's fences are native HostFences")

W = 8
PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])
DEVICE_S = 0.25   # device time of one microbatch
TIMEOUT = 0.75    # 3 microbatches' device time; cpu:0's queue holds 6 (F0, fused2, B4 x 2 microbatches)


class FakeDevice:
    """A device queue: work completes in issue order, `seconds` each, once `running` is set."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.running = threading.Event()
        self.running.set()
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="fake-device", daemon=True)
        self.thread.start()

    def issue(self):
        fence = _native.require().HostFence()
        self.jobs.put(fence)
        return fence

    def _run(self) -> None:
        while True:
            fence = self.jobs.get()
            if fence is None:
                return
            self.running.wait()
            time.sleep(self.seconds)
            fence.set()

    def stop(self) -> None:
        self.running.set()
        self.jobs.put(None)
        self.thread.join(10)


class LateDevice(CpuWorker):
    """A CPU worker whose microbatches are also device work on a FakeDevice (module docstring)."""

    def _microbatch_done(self) -> None:
        self.last = self.fake.issue()
        super()._microbatch_done()

    def _progress_fence(self):
        return self.last

    def drain(self) -> None:
        if self.last is not None:
            self.last.wait()   # as CudaWorker.drain waits for its streams
        super().drain()


def late_model(hung: bool = False):
    torch.manual_seed(0)
    model = rp.RoundPipe([nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(6)], devices=["cpu"] * 2,
                         num_microbatches=2, plan=PLAN, stall_timeout=TIMEOUT)
    for w in model.workers:
        w.__class__ = LateDevice
        w.copies.on_microbatch = w._microbatch_done   # bound before the class changed
        w.fake, w.last = FakeDevice(DEVICE_S), None
        if hung:
            w.fake.running.clear()
    return model


def data(rows: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, W, generator=g), torch.randn(rows, W, generator=g)


def stop(model) -> None:
    for w in model.workers:
        w.fake.stop()
    for w in model.workers:
        for e in w.executors():
            e.stop()
            assert e.join(10), e.name


def test_a_device_whose_queued_work_completes_is_not_stalled():
    """Each worker's thread waits 1-1.5 s for its queued microbatches at the call's end, 0.25 s each under
    stall_timeout=0.75: two training calls and their sync points run through, no worker stalled (before, the
    watchdog counted only what was issued and gave both workers up 0.75 s into the wait)."""
    model = late_model()
    try:
        x, y = data()
        for _ in range(2):
            t0 = time.monotonic()
            loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            assert time.monotonic() - t0 > TIMEOUT + DEVICE_S   # the device kept the workers waiting longer
            assert torch.isfinite(loss)
        assert not any(w.stalled for w in model.workers)
    finally:
        stop(model)
        model.close()


def test_a_device_whose_queued_work_completes_nothing_is_still_stalled():
    """The same queues on a device that completes nothing: RoundPipeStalled from the sync point within about
    stall_timeout of the workers' last progress, the model given up."""
    model = late_model(hung=True)
    try:
        x, y = data()
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        t0 = time.monotonic()
        with pytest.raises(RoundPipeStalled, match=r"stall_timeout=0.75 s"):
            model.synchronize()
        assert time.monotonic() - t0 < TIMEOUT + 5   # the grace for the abort included
        assert any(w.stalled for w in model.workers)
    finally:
        stop(model)   # the device completes its queue: the stuck drains return
        model.close()
