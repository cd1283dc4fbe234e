"""Resident weights (roundpipe/engine/calls/resident.py): a prefix of layers keeps its uploaded weights on
each worker, reused while the host's upload copies are unchanged.

The numbers never change (every test compares bit for bit with resident_layers=0); what changes is the
bytes the parameter-upload queue copies, counted here from the workers' copy reports.
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, Adapted, Slow
from torch import nn

import roundpipe as rp

# 6 layers: forward stages [0-1] [2-4], fused tail [5], backward stages [2-4] [0-1]
PLAN6 = rp.Plan(forward=[range(0, 2), range(2, 5)], backward=[range(5, 6), range(2, 5), range(0, 2)])


def _mlp():
    torch.manual_seed(0)
    return MODELS["mlp"](6)


def _adapted(n=6):
    torch.manual_seed(0)
    return [Adapted() for _ in range(n)]


class Uploads:
    """Bytes each call copied on the param_up queues of a model's workers."""

    def __init__(self, model):
        self.bytes = 0
        self.lock = threading.Lock()
        for w in model.workers:
            w.copies.record_copies(self._on_copy)

    def _on_copy(self, queue, nbytes, t0, t1):
        if queue == "param_up":
            with self.lock:
                self.bytes += nbytes

    def take(self) -> int:
        with self.lock:
            n, self.bytes = self.bytes, 0
        return n


def _run(layers, resident, steps=3, workers=1, asynchronous=False, width=16, plan=PLAN6, mbs=3, device="cpu", **kw):
    """Trains `steps` steps; returns (losses, final state, param_up bytes per call, the model's stats)."""
    torch.manual_seed(1)
    batches = [(torch.randn(7, width), torch.randn(7, width)) for _ in range(steps)]
    per_call = []
    with rp.RoundPipe(layers, devices=[device] * workers, num_microbatches=mbs, plan=plan, microbatches_per_round=mbs,
                      resident_layers=resident, **kw) as model:
        up = Uploads(model)
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for x, y in batches:
            losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss)))
            model.wait_calls()
            per_call.append(up.take())
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        stats = model.memory_stats()
    return losses, state, per_call, stats


def _same(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _bytes(layers, trained: bool | None = None) -> int:
    """Parameter bytes of the layers (fp32 on CPU workers); trained: only (not) requires_grad ones."""
    return sum(p.nbytes for m in layers for p in m.parameters() if trained is None or p.requires_grad == trained)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_frozen_base_is_uploaded_once(asynchronous):
    """LoRA's shape: every weight goes up once in the first call (the backward stages bind what the forward
    stages uploaded), after it only the adapters, once per call; losses and weights bitwise those of
    resident_layers=0."""
    off = _run(_adapted(), 0, asynchronous=asynchronous)
    on = _run(_adapted(), 6, asynchronous=asynchronous)
    _same(off, on)
    layers = _adapted()
    frozen, trained = _bytes(layers, False), _bytes(layers, True)
    # without residency: layers 0-4 go up twice per call (forward and backward stage), layer 5 once
    twice = sum(p.nbytes for m in layers[:5] for p in m.parameters())
    assert off[2] == [twice * 2 + _bytes(layers[5:])] * 3
    # no base byte after the first call; asynchronous: the second call reads the first call's weights
    # (the step's stale window), which are still on the worker
    assert on[2] == [frozen + trained, 0 if asynchronous else trained, trained]
    w = on[3]["workers"]["cpu:0"]
    assert w["resident_layers"] == 6 and w["resident_bytes"] == frozen + trained


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_trained_layer_goes_up_once_a_step_not_once_a_stage(asynchronous):
    """One worker: a trained layer's backward stage binds the weights its forward stage uploaded."""
    off = _run(_mlp(), 0, asynchronous=asynchronous, width=8)
    on = _run(_mlp(), 6, asynchronous=asynchronous, width=8)
    _same(off, on)
    layers = _mlp()
    assert off[2] == [2 * _bytes(layers[:5]) + _bytes(layers[5:])] * 3
    # asynchronous: the second call reads the first call's weights (the stale window), kept on the worker
    assert on[2] == [_bytes(layers), 0 if asynchronous else _bytes(layers), _bytes(layers)]


def test_a_prefix_keeps_only_its_layers():
    """resident_layers=2: layers 0-1 go up once per call, the rest as before."""
    on = _run(_mlp(), 2, width=8)
    off = _run(_mlp(), 0, width=8)
    _same(off, on)
    layers = _mlp()
    assert on[2] == [off[2][0] - _bytes(layers[:2])] * 3
    assert on[3]["workers"]["cpu:0"]["resident_layers"] == 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_several_workers_under_random_delays_train_bitwise(asynchronous):
    """Three workers, delays shaking the schedule: every worker keeps its own copies; results unchanged,
    and the frozen base goes up at most once per worker after the first calls."""
    def layers():
        return [Slow(m) for m in _adapted()]
    off = _run(layers(), 0, workers=3, asynchronous=asynchronous, steps=4)
    on = _run(layers(), 6, workers=3, asynchronous=asynchronous, steps=4)
    _same(off, on)
    layers = _adapted()
    frozen = _bytes(layers, False)
    trained_per_call = 2 * _bytes(layers[:5], True) + _bytes(layers[5:], True)   # each stage's own upload
    assert sum(on[2]) <= 3 * frozen + 4 * trained_per_call   # the base once per worker at most
    assert on[2][-1] <= trained_per_call < off[2][-1]


def test_shared_weights_are_refreshed_after_their_owner_steps():
    """A weight tied between the first and the last layer: the last layer's kept copy is replaced once the
    first layer's step rewrote the shared upload copy (bitwise as without residency)."""
    def tied():
        torch.manual_seed(3)
        layers = MODELS["mlp"](6)
        layers[5][0].weight = layers[0][0].weight
        return layers
    for asynchronous in (False, True):
        _same(_run(tied(), 0, width=8, asynchronous=asynchronous, workers=2),
              _run(tied(), 6, width=8, asynchronous=asynchronous, workers=2))


def test_an_edited_frozen_weight_is_uploaded_again():
    """After synchronize(), a frozen base weight changed in place under no_grad reaches the next call."""
    def train(resident):
        torch.manual_seed(1)
        x, y = torch.randn(7, 16), torch.randn(7, 16)
        with rp.RoundPipe(_adapted(), devices=["cpu"], num_microbatches=3, plan=PLAN6,
                          resident_layers=resident) as model:
            first = float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))
            model.synchronize()
            with torch.no_grad():
                model.module[1].base.weight.mul_(0.5)
            second = float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))
        return first, second
    off, on = train(0), train(6)
    assert off == on and off[0] != off[1]


def test_a_checkpoint_load_drops_kept_weights(tmp_path):
    """load_checkpoint restores weights under the kept copies: the next call reads the loaded ones."""
    def run(resident):
        torch.manual_seed(1)
        x, y = torch.randn(7, 8), torch.randn(7, 8)
        with rp.RoundPipe(MODELS["mlp"](6), devices=["cpu"], num_microbatches=3, plan=PLAN6,
                          resident_layers=resident) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
            model.save_checkpoint(tmp_path / f"c{resident}", opt)
            for _ in range(2):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False)
            model.load_checkpoint(tmp_path / f"c{resident}", opt)
            return float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))
    assert run(0) == run(6)


def test_auto_keeps_what_the_cap_leaves_room_for():
    """resident_layers=None with a device_memory cap: the largest prefix whose predicted peak fits; a
    tighter cap keeps fewer; the ledger's measured peak stays under the cap."""
    def layers():
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]

    def kept(cap):
        x, y = torch.randn(8, 64), torch.randn(8, 64)
        with rp.RoundPipe(layers(), devices=["cpu"], num_microbatches=2, plan=PLAN6, device_memory=cap) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            for _ in range(2):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False)
            stats = model.memory_stats()["workers"]["cpu:0"]
            assert stats["peak_total"] <= cap and stats["predicted_peak"] <= cap
            return stats["resident_layers"]
    # the plan's predicted peak is 141,312 bytes and each layer keeps 16,640: 0.85 of 210,000 leaves room for 4
    roomy, tight, none = kept(400_000), kept(210_000), kept(170_000)
    assert roomy == 6 and tight == 4 and none == 0
    with rp.RoundPipe(layers(), devices=["cpu"], num_microbatches=2, plan=PLAN6) as model:   # no cap: none
        model.forward_backward(torch.randn(8, 64), labels=torch.randn(8, 64), loss_fn=F.mse_loss)
        assert model.memory_stats()["workers"]["cpu:0"]["resident_layers"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_resident_layers(bad):
    with pytest.raises(ValueError, match="resident_layers"):
        rp.RoundPipe(MODELS["mlp"](6), devices=["cpu"], resident_layers=bad)


def test_more_resident_layers_than_layers():
    with pytest.raises(ValueError, match="resident_layers=7 is more than the model's 6 layers"):
        rp.RoundPipe(MODELS["mlp"](6), devices=["cpu"], resident_layers=7)


def test_running_out_of_memory_with_kept_weights_keeps_none_after():
    """A call that runs out of device memory while weights are kept drops them, and the model keeps none from
    then on (kept weights must never make training fail); the next calls train as a model that kept none."""
    def layers():
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
    x, y = torch.randn(8, 64), torch.randn(8, 64)

    def train(resident, fail):
        with rp.RoundPipe(layers(), devices=["cpu"], num_microbatches=2, plan=PLAN6, device_memory=400_000,
                          resident_layers=resident) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
            if fail:
                assert model.memory_stats()["workers"]["cpu:0"]["resident_layers"] == 6
                model.workers[0].inject_oom("backward")
                with pytest.raises(torch.OutOfMemoryError):
                    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                    model.wait_calls()
            losses = []
            for _ in range(2):
                losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss)))
                model.step(opt, asynchronous=False)
            stats = model.memory_stats()["workers"]["cpu:0"]
            return losses, stats["resident_layers"], stats["resident_bytes"]
    failed, clean = train(None, True), train(0, False)
    assert failed[0] == clean[0] and failed[1:] == (0, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("asynchronous", [False, True])
def test_on_a_gpu_kept_weights_change_no_number(asynchronous):
    """One CUDA worker (bf16 compute): kept weights bound across stages and calls (allocated on the compute
    stream's pool, read by later stages' compute) give the numbers of resident_layers=0, with the base
    uploaded in the first call only."""
    off = _run(_adapted(), 0, asynchronous=asynchronous, device="cuda:0")
    on = _run(_adapted(), 6, asynchronous=asynchronous, device="cuda:0")
    _same(off, on)
    assert on[2][0] < off[2][0] and 4 * on[2][2] < off[2][2]   # after the first call: the adapters only


def test_gpu_workers_leave_more_room_than_cpu_workers():
    """The margin kept weights leave beyond the predicted peak: 15% of the cap on CPU workers (exact ledger), 30%
    on GPU workers (the caching allocator's fragmentation is not in the prediction); a larger margin keeps fewer."""
    from types import SimpleNamespace

    from roundpipe.engine.device_memory import PeakPredictions
    from roundpipe.planner.memory import LayerMemory, resident_prefix, worker_peaks

    def margin(kind):
        workers = [SimpleNamespace(device=torch.device(kind), name="w", set_cap=lambda cap: None)]
        return PeakPredictions(workers, {"w": 1 << 20}).resident_headroom()
    assert margin("cpu") == 0.15 and margin("cuda") == 0.30
    tasks = {"w": [SimpleNamespace(kind="F", layers=range(0, 3), mbs=[0]),
                   SimpleNamespace(kind="fused", layers=range(3, 4), mbs=[0]),
                   SimpleNamespace(kind="B", layers=range(0, 3), mbs=[0])]}
    mem, weights, grads = [LayerMemory.rough(20)] * 4, [100] * 4, [200] * 4
    peaks = [worker_peaks(tasks, weights, grads, mem, False, resident=k)["w"] for k in range(5)]
    cap = {"w": int(peaks[4] / 0.85) + 1}   # all four fit under 85%, not under 70%
    assert peaks[4] > 0.70 * cap["w"]
    assert resident_prefix(tasks, weights, grads, mem, False, cap, headroom=0.15) == 4
    assert resident_prefix(tasks, weights, grads, mem, False, cap, headroom=0.30) < 4
