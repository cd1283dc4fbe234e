"""Fences: host fences set/fail/wait, the helpers, and the dlopen'd CUDA status."""
import threading

import pytest
import torch

from roundpipe import _native
from roundpipe.offload import cuda_status, make_stream_wait, wait_all

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")
C = _native.lib


def test_host_fence_lifecycle():
    """A host fence is pending until set, then done; set() from another thread wakes wait()."""
    f = C.HostFence()
    assert f.state == "pending" and not f.done() and f.kind == "host" and f.cuda_event == 0
    assert not f.wait_for(0.01)
    threading.Timer(0.02, f.set).start()
    f.wait()
    assert f.done() and f.state == "done"
    assert C.HostFence(True).done()


def test_failed_fence_raises_with_reason():
    """fail() makes done()/wait() raise RuntimeError carrying the message."""
    f = C.HostFence()
    f.fail("disk on fire")
    assert f.state == "failed" and f.error == "disk on fire"
    with pytest.raises(RuntimeError, match="disk on fire"):
        f.wait()
    with pytest.raises(RuntimeError, match="disk on fire"):
        wait_all([C.HostFence(True), f])


def test_helpers_validate_and_wait_host_fences():
    """make_stream_wait on a host fence waits on the host; non-fences are TypeErrors."""
    f = C.HostFence()
    threading.Timer(0.01, f.set).start()
    make_stream_wait(f)
    assert f.done()
    with pytest.raises(TypeError, match="fences\\[1\\]"):
        wait_all([f, "not a fence"])
    with pytest.raises(ValueError, match="seconds"):
        f.wait_for(-1)


def test_cuda_status_is_a_reason_without_gpu():
    """cuda_status names the library it loaded or says why none was usable."""
    status = cuda_status()
    assert isinstance(status, str) and status
    if C.cuda_flavor() == "none":
        assert "libcudart" in status or "libcuda" in status
    else:
        assert status.startswith(("runtime", "driver"))


def test_event_pool_stats_start_empty_without_cuda():
    """Without a GPU no CUDA event was ever created or reused (the pool's counters exist everywhere)."""
    created, reused = C.CudaEventFence.pool_stats()
    if not torch.cuda.is_available():
        assert (created, reused) == (0, 0)
    assert created >= 0 and reused >= 0


def test_fence_events_let_a_waiting_host_thread_sleep():
    """Fence events are created with cudaEventBlockingSync | cudaEventDisableTiming (3): a thread waiting for a
    copy (cudaEventSynchronize) sleeps instead of spinning a core beside the OpenMP optimizer step.  They are
    created and recorded in their device's context, restored after, so a completion thread that never chose a
    GPU gets no context on GPU 0.  Modelled by a stand-in CUDA runtime (C.FakeCuda)."""
    fake = C.FakeCuda(2)
    seen = []

    def record_and_wait():
        f = C.CudaEventFence.record(0, 1, cuda=fake)
        f.wait()
        seen.append((f.state, f.kind, fake.thread_context_depth(), fake.thread_device()))

    t = threading.Thread(target=record_and_wait)
    t.start()
    t.join()
    assert fake.event_flags == [3] and C.HOST_WAITED_EVENT_FLAGS == 3
    assert seen == [("done", "cuda", 0, 0)]
    assert fake.contexts_created == [1]
    assert [c for c in fake.calls if c[0].startswith("cudaEvent")] == [("cudaEventCreateWithFlags", 1),
                                                                       ("cudaEventRecord", 1)]
    with pytest.raises(ValueError, match="device=2 is out of range; 2 CUDA devices"):
        C.CudaEventFence.record(0, 2, cuda=fake)
    with pytest.raises(ValueError, match="device_count=0 must be in"):
        C.FakeCuda(0)


@pytest.mark.cuda
def test_fences_reuse_pooled_events():
    """A thousand fences recorded one after another create a handful of CUDA events, not a thousand
    (each fence used to create and destroy its own); a reused event still orders the work."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from roundpipe.offload import make_stream_wait, stream_fence
    s = torch.cuda.Stream()
    before, _ = C.CudaEventFence.pool_stats()
    for _ in range(1000):
        stream_fence(s).wait()
    after, reused = C.CudaEventFence.pool_stats()
    assert after - before <= 4 and reused >= 996
    x = torch.ones(1 << 20, device="cuda")
    s.wait_stream(torch.cuda.current_stream())   # x is written on the current stream: s reads it after
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)            # a missing wait below would read y unwritten
        y = x * 2
    f = stream_fence(s)
    make_stream_wait(f)
    assert torch.equal(y * 1, torch.full_like(x, 2.0))


def test_cuda_worker_host_waits_use_blocking_events(monkeypatch):
    """The CUDA worker's own host waits (the end of its part of a call, stage timers) go through events
    created with blocking sync, so the waiting thread sleeps instead of spinning a core (issue 26 part 2,
    item 5); checked with torch.cuda.Event and the streams replaced by recorders (no GPU needed)."""
    from roundpipe.workers.cuda import CudaWorker

    made = []

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            made.append(blocking)

        def record(self, stream):
            pass

        def synchronize(self):
            pass

    class Worker:
        s_compute = s_param_up = s_act_up = s_act_down = s_grad_down = object()
        _timers: list = []

    monkeypatch.setattr(torch.cuda, "Event", Event)
    CudaWorker._sync_streams(Worker())
    CudaWorker.timer_start(Worker())
    assert made and all(made), made
