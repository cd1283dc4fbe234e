"""Fences: host fences set/fail/wait, the helpers, and the dlopen'd CUDA status."""
import threading

import pytest

from roundpipe import _native
from roundpipe.offload import cuda_status, make_stream_wait, wait_all

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")
C = _native._C


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
