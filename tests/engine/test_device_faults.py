"""A device out of memory that torch reports as a plain RuntimeError (cuBLAS/cuDNN allocation failures, a CUDA
runtime call out of memory) gets the handling of torch.OutOfMemoryError (tests/engine/test_device_oom.py): the
note, the failed stage's frames released, resident weights and kept graphs dropped for good, and the model trains
on exactly; a sticky CUDA error (an illegal address, a launch failure) says to restart, not to retry (issue 51,
item 5).

No GPU is needed: a layer raises torch's message once inside its forward on a capped CPU worker, as cuBLAS does
inside F.linear when it cannot allocate its handle."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine.calls.dispatcher import out_of_device_memory, sticky_device_error

W = 16
BIG_CAP = 1 << 30   # never reached: it makes resident weights fit and the CPU workers enforce a cap
PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])
RAISING = 2   # F1[2-3] on slot 1's worker runs it first in a call

CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
EVENT = ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so "
         "the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
CUDNN = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"
ILLEGAL = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
           "reported at some other API call, so the stacktrace below might be incorrect.")
ARMED: dict = {"message": None}   # the next forward of layer RAISING raises RuntimeError(message), once


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        if self.index == RAISING and ARMED["message"] is not None:
            message, ARMED["message"] = ARMED["message"], None
            raise RuntimeError(message)
        return torch.tanh(self.fc(x))


def make_layers():
    torch.manual_seed(0)
    return [Block(i) for i in range(6)]


def batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, W, generator=g), torch.randn(rows, W, generator=g)


def train(model, opt, seed: int, rows: int) -> None:
    x, y = batch(seed, rows)
    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
    model.step(opt, asynchronous=False)


def build():
    ARMED["message"] = None
    model = rp.RoundPipe(make_layers(), devices=["cpu"] * 2, num_microbatches=2, plan=PLAN, device_memory=BIG_CAP)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def slot_task(model, slot: int):
    sched = model.dispatcher.schedule(model.plan, True, 2, model.round_size)
    return next((name, t) for name, tasks in sched.tasks.items() for t in tasks if t.slot == slot)


def unkept(model):
    return [w.ledger.live_bytes() - model.resident.nbytes(w.name) for w in model.workers]


def fail_once(model, message: str):
    """The next training call with layer RAISING raising `message` in its first forward; the error raised."""
    x, y = batch(2, 8)
    ARMED["message"] = message
    with pytest.raises(RuntimeError) as info:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.wait_calls()
    assert ARMED["message"] is None   # it fired
    return info


@pytest.mark.parametrize("message", [CUBLAS, EVENT, CUDNN], ids=["cublas", "cuda-event", "cudnn"])
def test_an_oom_as_runtime_error_is_named_released_and_training_goes_on_exactly(message):
    """A cuBLAS/CUDA/cuDNN allocation failure raised in F1's forward: the same RuntimeError reaches the caller with
    the out-of-memory note (worker, stage, microbatch, predicted peak, cap); the ledgers are back to their bytes
    before the call while the error is alive; resident weights are dropped and none kept after; the next call
    trains exactly like a model that never saw the failed call."""
    model, opt = build()
    with model:
        train(model, opt, seed=1, rows=8)
        assert any(model.resident.nbytes(w.name) for w in model.workers)   # resident weights in play
        name, task = slot_task(model, 1)
        before = unkept(model)
        info = fail_once(model, message)
        assert type(info.value) is RuntimeError and str(info.value).startswith(message)   # its type, its message
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert f"out of device memory on worker {name} in stage {task.label}" in notes, notes
        assert "at microbatch 0" in notes and "retry with a smaller batch" in notes, notes
        assert "predicted peak for this worker is" in notes and f"cap is {BIG_CAP:,} bytes" in notes, notes
        assert unkept(model) == before   # the failed stage's frames were cleared
        assert not model.predictions.auto_resident   # no resident weights or kept graphs from now on
        train(model, opt, seed=3, rows=4)
        model.synchronize()
        assert all(model.resident.nbytes(w.name) == 0 for w in model.workers)
        after = unkept(model)
    ref, ref_opt = build()
    with ref:
        train(ref, ref_opt, seed=1, rows=8)
        train(ref, ref_opt, seed=3, rows=4)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), n
    assert after == [0, 0]


def test_a_sticky_cuda_error_says_restart_and_is_no_out_of_memory():
    """An illegal memory access reaches the caller with a note saying the CUDA context is unusable and the process
    must restart (no retry advice); it is not handled as out of memory (resident weights stay allowed)."""
    model, opt = build()
    with model:
        train(model, opt, seed=1, rows=8)
        name, task = slot_task(model, 1)
        info = fail_once(model, ILLEGAL)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert f"CUDA error on worker {name} in stage {task.label}" in notes, notes
        assert "restart the process" in notes and "retry with" not in notes and "out of device memory" not in notes
        assert model.predictions.auto_resident


def test_a_plain_error_gets_no_device_note():
    """A RuntimeError that is neither (a shape mismatch) reaches the caller as it was: no device note."""
    model, opt = build()
    with model:
        train(model, opt, seed=1, rows=8)
        info = fail_once(model, "mat1 and mat2 shapes cannot be multiplied (8x16 and 15x16)")
        assert not any("out of device memory" in n or "CUDA error on worker" in n
                       for n in getattr(info.value, "__notes__", []))
        assert model.predictions.auto_resident


@pytest.mark.parametrize("error, oom, sticky", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, False),
    (RuntimeError(CUBLAS), True, False),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul(...)`"), True, False),
    (RuntimeError(EVENT), True, False),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True, False),
    (RuntimeError(CUDNN), True, False),
    (RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"), True, False),
    (RuntimeError("CUDA driver error: out of memory"), True, False),
    (RuntimeError(ILLEGAL), False, True),
    (RuntimeError("CUDA error: unspecified launch failure"), False, True),
    (RuntimeError("CUDA error: device-side assert triggered"), False, True),
    (RuntimeError("CUDA error: too many resources requested for launch"), False, False),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous"
                  " input."), False, False),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes"), False, False),
    (RuntimeError("the tokenizer ran out of memory"), False, False),   # a layer's own: no CUDA error
    (ValueError("CUDA error: out of memory"), False, False),   # not a type torch raises
    (None, False, False),
])
def test_which_errors_are_out_of_device_memory_or_sticky(error, oom, sticky):
    """The classification every engine reaction to an out-of-memory error uses: torch's type, and the messages
    cuBLAS, cuDNN, cuFFT and the CUDA runtime raise as RuntimeError; sticky CUDA errors are no out-of-memory."""
    assert out_of_device_memory(error) is oom
    assert sticky_device_error(error) is sticky
