"""The strict device model (roundpipe/workers/strict.py): CPU workers whose copies run late on their own
queues, fail on a source written by unordered compute, and poison what a copy is about to write."""
import pytest
import torch

from roundpipe import _native
from roundpipe.workers import make_workers, parse_devices, strict
from roundpipe.workers.base import Handoff

pytestmark = pytest.mark.skipif(not _native.available(), reason="needs the native core roundpipe._C")



@pytest.fixture
def late_worker():
    """A CPU worker whose every copy waits up to 100 ms: the issuer surely acts before most copies run."""
    with strict.model(strict.DeviceModel(seed=1, max_delay_s=0.1, prob=1.0)):
        w = make_workers(parse_devices(["cpu"]), torch.float32)[0]
    assert w.strict and w.copies.inline_bytes == 0
    yield w
    w.close()


def test_a_source_written_before_its_download_ran_fails_the_copy(late_worker):
    """A stage output written in place after its download was issued (no fence orders the write after the copy):
    the download's fence fails with CopyRaceError's message naming the copy and the worker."""
    x = torch.ones(4, 8)
    h = late_worker.send(x, need_host=True, keep_device=False)
    x.mul_(2.0)   # the next layer's ReLU(inplace=True), as the code before issue 51's fix let it happen
    with pytest.raises(RuntimeError, match=r"CopyRaceError.*stage output download \(act_down\).*worker cpu:0"):
        h.host_ready.wait()


def test_a_producer_that_goes_on_sends_a_copy_of_its_own(late_worker):
    """goes_on: the producer's next layer gets the tensor too, so the download reads a private device copy and
    the host copy holds the value as published, whatever that layer writes in place."""
    x = torch.ones(4, 8)
    h = late_worker.send(x, need_host=True, keep_device=False, goes_on=True)
    x.mul_(2.0)
    h.host_ready.wait()
    assert torch.equal(h.host, torch.ones(4, 8))


def test_no_copy_runs_inline_and_a_destination_read_early_is_poison(late_worker):
    """An upload is still pending when receive returns; its destination reads NaN until the fence completed,
    then the values."""
    src = torch.arange(32.0).reshape(4, 8)
    arrival = late_worker.receive(Handoff(host=src))
    assert arrival.fences[0].state == "pending"
    early = arrival.value.clone()   # read without waiting: a missing fence wait
    assert torch.isnan(early).all()
    assert torch.equal(late_worker.use(arrival), src)


def test_fresh_device_buffers_hold_garbage(late_worker):
    """A CPU worker's fresh device buffer under the strict model is 0xFF-filled: NaN as floats, -1 as ints."""
    assert torch.isnan(late_worker._empty(torch.Size([3]), torch.bfloat16, "act_up")).all()
    assert (late_worker._empty(torch.Size([3]), torch.int32, "act_up") == -1).all()


def test_the_fast_model_is_unchanged():
    """Outside the strict model small copies still run on the issuing thread (the fast path the benches time)."""
    with strict.model(None):
        w = make_workers(parse_devices(["cpu"]), torch.float32)[0]
    try:
        assert not w.strict and w.copies.strict is None
        h = w.send(torch.ones(4), need_host=True, keep_device=False)
        assert h.host_ready is None and torch.equal(h.host, torch.ones(4))
    finally:
        w.close()


def test_settings_are_checked(monkeypatch):
    """A wrong environment value or field names itself and what was expected."""
    monkeypatch.setenv(strict.ENV, "lenient")
    with pytest.raises(ValueError, match="ROUNDPIPE_DEVICE_MODEL='lenient'.*'strict'"):
        strict._from_env()
    monkeypatch.setenv(strict.ENV, "strict")
    monkeypatch.setenv(strict.ENV + "_SEED", "x")
    with pytest.raises(ValueError, match="ROUNDPIPE_DEVICE_MODEL_SEED='x'"):
        strict._from_env()
    monkeypatch.setenv(strict.ENV + "_SEED", "7")
    assert strict._from_env() == strict.DeviceModel("strict", seed=7)
    with pytest.raises(ValueError, match="mode='loose'"):
        strict.DeviceModel("loose")
    with pytest.raises(ValueError, match="max_delay_s=2"):
        strict.DeviceModel(max_delay_s=2)


def test_a_copy_of_a_device_tensor_not_marked_for_its_queue_fails(late_worker):
    """A download of a device tensor the worker never marked for the download queue (a CUDA worker's missing
    record_stream: the allocator could reuse its block mid-copy) fails at once; marked, it goes."""
    src, host = torch.ones(16), late_worker._to_host(torch.ones(16))
    with pytest.raises(strict.StreamUseError, match=r"gradient or buffer download.*not marked for its queue"):
        late_worker.copies.bulk("grad_down", [host], [src], 1)
    late_worker._read_by_copy([src], "grad_down")
    late_worker.copies.wait(late_worker.copies.bulk("grad_down", [host], [src], 1))
    assert torch.equal(host, src)
