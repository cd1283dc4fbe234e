"""Out of device memory: raised once in the caller as torch.OutOfMemoryError with a note naming the worker,
the stage, the predicted peak and the cap; the failed stage's device memory is released and the model trains
on exactly.

CPU workers under `device_memory=` model a GPU: their ledger enforces the cap at run time, and
`Worker.inject_oom(kind)` (a test seam) makes the next allocation of a forward, backward, loss, upload or
download fail as a full device would.  Each case compares the parameters after the failure and one more
training call with a fresh model given the same history without the failed call.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.workers.ledger import DeviceLedger

W = 16
BIG_CAP = 1 << 30   # never reached: it only makes the CPU workers record workspace and enforce a cap
PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def make_layers():
    torch.manual_seed(0)
    return [Block() for _ in range(6)]


def batch(seed: int, rows: int, length: int | None = None):
    g = torch.Generator().manual_seed(seed)
    shape = (rows, W) if length is None else (rows, length, W)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def train(model, opt, seed: int, rows: int, length: int | None = None) -> None:
    x, y = batch(seed, rows, length)
    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    model.step(opt, asynchronous=False)


def build(cap: int):
    model = rp.RoundPipe(make_layers(), devices=["cpu"] * 2, num_microbatches=2, plan=PLAN, device_memory=cap)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def first_task(model, slot: int, want):
    """The worker that runs slot `slot` of the next training call, and its first task `want` accepts."""
    sched = model.dispatcher.schedule(model.plan, True, 2, model.round_size)
    for name, tasks in sched.tasks.items():
        if any(t.slot == slot for t in tasks):
            return name, next(t for t in tasks if want(t))
    raise AssertionError(f"no worker runs slot {slot}")


def assert_same_parameters(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def any_task(t) -> bool:
    return True


def grads(t) -> bool:
    return t.kind != "F"


def fused(t) -> bool:
    return t.kind == "fused"


def unkept(model):
    """Each worker's live device bytes but the weights it keeps for resident layers (engine/calls/resident.py;
    a failed call drops those)."""
    return [w.ledger.live_bytes() - model.resident.nbytes(w.name) for w in model.workers]


# (kind, the slot whose worker is armed, which of its tasks fails, where in that task)
CASES = [("forward", 0, any_task, "at microbatch 0"), ("upload", 1, any_task, "at microbatch 0"),
         ("loss", 2, fused, "at microbatch 0"), ("backward", 2, grads, "at microbatch 0"),
         ("backward", 3, grads, "at microbatch 0"), ("download", 3, grads, "after its last microbatch")]


@pytest.mark.parametrize("kind, slot, want, at", CASES,
                         ids=["forward", "upload", "loss", "fused-backward", "backward", "download"])
def test_injected_oom_is_named_released_and_training_goes_on_exactly(kind, slot, want, at):
    """An allocation failing in each kind of work: one torch.OutOfMemoryError naming the worker, the stage, the
    microbatch, the predicted peak and the cap; every worker's ledger back to its bytes before the call;
    the next call (a smaller batch) trains exactly like a model that never saw the failed call."""
    model, opt = build(BIG_CAP)
    with model:
        train(model, opt, seed=1, rows=8)
        name, task = first_task(model, slot, want)
        worker = next(w for w in model.workers if w.name == name)
        before = unkept(model)
        worker.inject_oom(kind)
        x, y = batch(2, 8)
        with pytest.raises(torch.OutOfMemoryError) as info:   # a failure in the call's tail: by wait_calls
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.wait_calls()
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert f"out of device memory on worker {name} in stage {task.label}" in notes, notes
        assert at in notes, notes
        assert "predicted peak for this worker is" in notes and f"cap is {BIG_CAP:,} bytes" in notes, notes
        assert unkept(model) == before
        assert worker._oom is None and not worker.ledger.armed   # it fired, once
        train(model, opt, seed=3, rows=4)   # raises nothing: the error was raised once
        model.synchronize()
        after = unkept(model)

    ref, ref_opt = build(BIG_CAP)
    with ref:
        train(ref, ref_opt, seed=1, rows=8)
        train(ref, ref_opt, seed=3, rows=4)
        assert_same_parameters(model, ref)
    assert after == [0, 0]


def test_an_input_longer_than_planned_runs_out_of_the_cap_and_a_shorter_one_trains_exactly():
    """The plan's prediction is made for the first call's inputs; a later call with 64x longer sequences needs
    more than the cap at run time: the capped CPU worker's ledger raises torch.OutOfMemoryError (as the GPU's
    allocator would) with the note, nothing stays held, and shorter inputs then train exactly."""
    cap = 96_000
    model, opt = build(cap)
    with model:
        train(model, opt, seed=1, rows=4, length=4)
        predicted = model.memory_stats()["workers"]
        before = unkept(model)
        x, y = batch(2, 4, length=256)
        with pytest.raises(torch.OutOfMemoryError, match="cap held") as info:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.wait_calls()
        notes = "\n".join(info.value.__notes__)
        assert "out of device memory on worker cpu:" in notes and f"cap is {cap:,} bytes" in notes, notes
        peaks = {name: s["predicted_peak"] for name, s in predicted.items()}
        assert any(f"predicted peak for this worker is {p:,} bytes" in notes for p in peaks.values()), (notes, peaks)
        assert unkept(model) == before
        train(model, opt, seed=3, rows=4, length=4)
        for s in model.memory_stats()["workers"].values():
            assert s["peak_total"] <= cap
    ref, ref_opt = build(cap)
    with ref:
        train(ref, ref_opt, seed=1, rows=4, length=4)
        train(ref, ref_opt, seed=3, rows=4, length=4)
        assert_same_parameters(model, ref)


def test_ledger_cap_and_injected_failure():
    """Past the cap a new storage raises torch.OutOfMemoryError and is not counted; a storage moving from
    workspace to another category needs no room; fail_next fires once."""
    ledger = DeviceLedger()
    ledger.cap = 1000
    a = ledger.track(torch.empty(200, dtype=torch.float32), "weights")   # 800 bytes
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 400 bytes of activations with 800 of"):
        ledger.track(torch.empty(100, dtype=torch.float32), "activations")
    assert ledger.live_bytes() == 800
    b = torch.empty(50, dtype=torch.float32)
    ledger.track_workspace([b])
    ledger.track(b, "gradients")   # moved, not new
    assert ledger.stats()["current"]["gradients"] == 200 and ledger.live_bytes() == 1000
    del a, b
    ledger.fail_next("injected for the test")
    with pytest.raises(torch.OutOfMemoryError, match="injected for the test"):
        ledger.track(torch.empty(1), "weights")
    ledger.track(torch.empty(1), "weights")   # once only
    with pytest.raises(ValueError, match="inject_oom kind='sideways'"):
        rp.RoundPipe(make_layers(), devices=["cpu"]).workers[0].inject_oom("sideways")


@pytest.mark.cuda
def test_cuda_out_of_memory_is_named_released_and_training_goes_on_exactly():
    """A real OOM on a GPU (the allocator limited by set_per_process_memory_fraction): one
    torch.OutOfMemoryError with the note, reserved memory back to its level after empty_cache, and the next
    call with short inputs trains like a model that never failed."""
    dev = torch.device("cuda", 0)
    kwargs = dict(devices=[str(dev)], num_microbatches=2, plan=PLAN, compute_dtype=torch.float32)
    model = rp.RoundPipe(make_layers(), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    total = torch.cuda.get_device_properties(dev).total_memory
    try:
        with model:
            train(model, opt, seed=1, rows=4, length=4)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(dev)
            live = [w.ledger.live_bytes() for w in model.workers]
            torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + (64 << 20)) / total), dev)
            x, y = batch(2, 4, length=1 << 20)   # 256 MiB per microbatch's input
            with pytest.raises(torch.OutOfMemoryError) as info:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            notes = "\n".join(info.value.__notes__)
            assert "out of device memory on worker cuda:0 in stage" in notes and "predicted peak" in notes, notes
            del info
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            assert torch.cuda.memory_reserved(dev) <= reserved
            assert [w.ledger.live_bytes() for w in model.workers] == live
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
            train(model, opt, seed=3, rows=4, length=4)
            model.synchronize()
        ref = rp.RoundPipe(make_layers(), **kwargs)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        with ref:
            train(ref, ref_opt, seed=1, rows=4, length=4)
            train(ref, ref_opt, seed=3, rows=4, length=4)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
