"""Out of device memory inside the device step, and what the worker holds beside device-stepped weights
(roundpipe/engine/step/device_step.py).

A layer's device update is atomic with respect to an allocation failing: an OutOfMemoryError raised while
a temporary of the optimizer's formula is allocated, after earlier parameters of the layer were stepped and
the current one's moments were written, leaves the layer exactly as a failure before its update began
would (masters, state, step counts, bound weights), so synchronize(), state_dict() and the next call agree.
Each case compares a run that fails mid-update with one that fails as the same layer's update begins;
both are device-step runs on CPU workers, so they must agree bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS
from torch.utils._python_dispatch import TorchDispatchMode

import roundpipe as rp

PLAN6 = rp.Plan(forward=[range(0, 2), range(2, 5)], backward=[range(5, 6), range(2, 5), range(0, 2)])
WIDTH = 8
BIG_CAP = 1 << 30   # never reached: it makes the CPU worker record workspace and enforce a cap
MID, START, LEDGER = "mid", "start", "ledger"


def _model(**kw):
    torch.manual_seed(0)
    kw.setdefault("resident_layers", 6)
    return rp.RoundPipe(MODELS["mlp"](6), devices=["cpu"], num_microbatches=3, plan=PLAN6,
                        microbatches_per_round=3, device_step=True, **kw)


def _batches(n, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(7, WIDTH), torch.randn(7, WIDTH)) for _ in range(n)]


class _FailAfterWrite(TorchDispatchMode):
    """torch.OutOfMemoryError at the first op that makes a new tensor after some op wrote one in place: a
    temporary's allocation failing mid-update, with state already changed."""

    def __init__(self):
        super().__init__()
        self.wrote = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        makes = any(r.alias_info is None for r in schema.returns)
        if self.wrote and makes and not writes:
            raise torch.OutOfMemoryError(f"injected: out of device memory allocating the result of {func}")
        out = func(*args, **(kwargs or {}))
        self.wrote = self.wrote or writes
        return out


def _arm(model, opt, at: int, how: str) -> None:
    """The optimizer's `at`-th one-tensor update with torch ops (from 1, counted over the next step) fails:
    START as it begins; MID at its first allocation after it wrote state in place; LEDGER at the first new
    storage the capped CPU worker's ledger sees after it began (the device memory model's own failure)."""
    calls = [0]
    real = opt._torch_step

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] != at:
            return real(*args, **kwargs)
        if how == START:
            raise torch.OutOfMemoryError("injected: out of device memory as the update began")
        if how == LEDGER:
            model.workers[0].ledger.fail_next("injected into the update")
            return real(*args, **kwargs)
        with _FailAfterWrite():
            return real(*args, **kwargs)
    opt._torch_step = step


def _run(how: str, failing_step: int, **kw):
    """Trains 5 iterations with the `failing_step`-th step (from 1) failing in the update of the second layer it
    steps (each layer has a weight and a bias): START as the layer's update begins (the optimizer's 3rd one-tensor
    update), MID and LEDGER in its bias (the 4th), its weight stepped by then.  Returns what the model shows right
    after the caught error (state_dict, a forward's output) and after training on (state_dict, optimizer)."""
    batches = _batches(5)
    x = torch.randn(5, WIDTH)
    with _model(**kw) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for i, (xb, yb) in enumerate(batches):
            model.forward_backward(xb, labels=yb, loss_fn=F.mse_loss)
            if i + 1 != failing_step:
                model.step(opt)
                continue
            _arm(model, opt, 3 if how == START else 4, how)
            try:
                with pytest.raises(torch.OutOfMemoryError, match="injected"):
                    model.step(opt)
            finally:
                del opt._torch_step
            shown = {k: v.clone() for k, v in model.state_dict().items()}
            out = model(x)
        model.synchronize()
        final = {k: v.clone() for k, v in model.state_dict().items()}
        return shown, out, final, opt.state_dict()


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _equal_opt(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), f"{i}.{k}"


@pytest.mark.parametrize("failing_step", [1, 3], ids=["first-step", "later-step"])
def test_an_oom_mid_update_leaves_the_layer_as_before_its_update(failing_step):
    """First step: the host masters are the truth (the device copies were just made from them); later step: the
    device's newer masters are.  Either way what state_dict() shows, what a forward binds and what training on
    gives equal a run whose update of that layer failed before it changed anything."""
    mid, start = _run(MID, failing_step), _run(START, failing_step)
    _equal(mid[0], start[0])
    assert torch.equal(mid[1], start[1])
    _equal(mid[2], start[2])
    _equal_opt(mid[3], start[3])


def test_a_capped_cpu_worker_runs_out_inside_the_update_and_the_layer_is_as_before():
    """The CPU device model counts the update's temporaries (workspace in its ledger, as the caching allocator
    does on a GPU), so a full device fails there, after the layer's first parameter was stepped; the layer is
    left as a failure before its update would leave it."""
    ledger, start = _run(LEDGER, 2, device_memory=BIG_CAP), _run(START, 2, device_memory=BIG_CAP)
    _equal(ledger[0], start[0])
    assert torch.equal(ledger[1], start[1])
    _equal(ledger[2], start[2])
    _equal_opt(ledger[3], start[3])


def test_no_resident_copy_stays_beside_device_stepped_weights():
    """Once the device step owns a layer's trained weights, the kept upload copies of them are dropped: with bf16
    compute a trained parameter holds 2 (weight) + 4 (master) + 8 (moments) + 8 (two gradient sums) bytes at
    most, what the memory model predicts, not 2 more for a stale resident copy."""
    batches = _batches(4)
    with _model(compute_dtype=torch.bfloat16, device_memory=BIG_CAP) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        n = sum(p.numel() for p in model.parameters())
        for x, y in batches[:2]:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt)
        model.reset_peak_memory()
        for x, y in batches[2:]:   # two calls per step: both gradient sums are held during the second
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt)
        stats = model.memory_stats()["workers"]["cpu:0"]
    assert stats["resident_bytes"] == 0, stats
    assert stats["current"]["weights"] == stats["peak"]["weights"] == 2 * n, stats   # the stepped weights only
    assert stats["peak_total"] <= stats["predicted_peak"], stats


def test_the_memory_model_counts_one_layer_update_beside_what_the_device_step_keeps():
    """After the call, the device step updates one layer at a time with a copy of its masters and state and the
    formula's temporaries beside everything kept: 1.5x that layer's held bytes more, when no stage needs more."""
    from types import SimpleNamespace

    from roundpipe.planner.memory import LayerMemory, worker_peaks

    tasks = {"w": [SimpleNamespace(kind="F", layers=range(0, 2), mbs=[0]),
                   SimpleNamespace(kind="fused", layers=range(2, 3), mbs=[0]),
                   SimpleNamespace(kind="B", layers=range(0, 2), mbs=[0])]}
    mem, weights, grads = [LayerMemory.rough(4)] * 3, [10] * 3, [20] * 3
    held = [1000, 3000, 2000]
    assert worker_peaks(tasks, weights, grads, mem, False, resident=3, held=held)["w"] == 30 + 6000 + 4500
    assert worker_peaks(tasks, weights, grads, mem, False, resident=2, held=held)["w"] == 20 + 4000 + 4500
    plain = worker_peaks(tasks, weights, grads, mem, False, resident=3)["w"]
    assert plain < 100   # a stage's need: far below the step's
