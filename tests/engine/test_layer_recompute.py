"""RoundPipe(recompute="layer"): backward stages recompute and backpropagate one layer at a time.

Each layer of a backward stage is recomputed from its own input, saved by the forward, so a stage holds
one layer's activations whatever its size (planner/memory.py `BackwardFootprint`, layer grain).  The
numbers are the stage grain's, bit for bit: each layer runs from the same input with the same seed.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, Slow, assert_grads_equal, ref_forward, reference
from torch import nn

import roundpipe as rp
from roundpipe.engine.calls.dispatcher import Schedule, saved_points
from roundpipe.planner import LayerCost
from roundpipe.planner.memory import LayerMemory, backward_bytes
from roundpipe.planner.partition import greedy

# 6 layers: a fused tail of one, multi-layer backward stages below it (the one at layer 0 included)
PLAN6 = rp.Plan(forward=[range(0, 2), range(2, 5)], backward=[range(5, 6), range(2, 5), range(0, 2)])


def _train(name: str, recompute: str, workers: int = 2, mbs: int = 3, dtype=torch.float32, steps: int = 2):
    torch.manual_seed(0)
    layers = MODELS[name]()
    layers += MODELS["mlp"](6 - len(layers))   # 6 layers for PLAN6
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    kw = {"scale": 0.5} if name == "nested" else {}
    losses, grads = [], []
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=mbs, plan=PLAN6, recompute=recompute,
                      compute_dtype=dtype) as model:
        model._check_recompute = True   # every layer's recompute equals its forward, bitwise
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            losses.append(model.forward_backward(x, labels=y, loss_fn=F.mse_loss, **kw))
            model.synchronize()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.step(opt, asynchronous=False)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, grads, state


@pytest.mark.parametrize("name", ["mlp", "residual", "nested", "buffered"])
@pytest.mark.parametrize("workers, mbs, dtype", [(1, 1, torch.float32), (2, 3, torch.float32),
                                                 (3, 4, torch.bfloat16)])
def test_layer_grain_trains_bitwise_as_stage_grain(name, workers, mbs, dtype):
    """Losses, gradients, weights and buffers after two steps: equal to recompute="stage", bit for bit."""
    a = _train(name, "stage", workers, mbs, dtype)
    b = _train(name, "layer", workers, mbs, dtype)
    assert [float(v) for v in a[0]] == [float(v) for v in b[0]]
    for ga, gb in zip(a[1], b[1]):
        assert all(torch.equal(p, q) for p, q in zip(ga, gb))
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_layer_grain_gradients_are_pytorch_s():
    """fp32 gradients against nn.Sequential within 1e-6, with random delays shaking up the schedule."""
    torch.manual_seed(1)
    layers = MODELS["residual"](6)
    ref = reference(layers)
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    F.mse_loss(ref_forward(ref, x), y).backward()
    with rp.RoundPipe([Slow(m) for m in layers], devices=["cpu"] * 3, num_microbatches=3, plan=PLAN6,
                      recompute="layer") as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        assert_grads_equal(model, ref, 1e-6)


def test_composed_call_at_layer_grain():
    """out = model(x); f(out).backward() recomputes a layer at a time too, input gradients included."""
    torch.manual_seed(2)
    layers = MODELS["mlp"](6)
    ref = reference(layers)
    x = torch.randn(5, 8)
    xr = x.clone().requires_grad_(True)
    ref_forward(ref, xr).cos().sum().backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2, plan=PLAN6, recompute="layer") as model:
        xi = x.clone().requires_grad_(True)
        model(xi).cos().sum().backward()
        model.synchronize()
        assert_grads_equal(model, ref, 1e-6)
    assert torch.allclose(xi.grad, xr.grad, rtol=1e-6, atol=1e-7)


def test_the_forward_saves_every_layer_input_of_the_backward_stages():
    """The schedule: at layer grain every layer of a (non-fused) backward stage is a saved point, read by
    that stage; the fused tail's layers are not."""
    assert saved_points(PLAN6, True) == {0, 2, 5}
    assert saved_points(PLAN6, True, layer_grain=True) == {0, 1, 2, 3, 4, 5}
    assert saved_points(PLAN6, False, layer_grain=True) == {0, 2, 5}   # forward-only calls save nothing more

    class W:
        def __init__(self, name):
            self.name, self.space = name, name
    sched = Schedule(PLAN6, True, num_mb=2, round_size=2, workers=[W("a"), W("b")], g0=0, layer_grain=True)
    backward = {t.layers: t for ts in sched.tasks.values() for t in ts if t.kind == "B"}
    assert all(t.by_layer for t in backward.values()) and set(backward) == {range(2, 5), range(0, 2)}
    forward = [t for ts in sched.tasks.values() for t in ts if t.kind == "F"]
    readers = {b: [c.forward for c in cons] for t in forward for b, cons in t.consumers.items()}
    assert readers[3] == [False] and readers[4] == [False] and readers[1] == [False]   # the B stage reads them
    assert sorted(readers[2]) == [False, True]   # the next forward stage and the backward stage [2, 5)


def _deep(depth=32, width=128):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


# 32 layers: small forward stages, a one-layer fused tail and two 15- and 16-layer backward stages
DEEP = rp.Plan(forward=[range(s, min(s + 4, 31)) for s in range(0, 31, 4)],
               backward=[range(31, 32), range(16, 31), range(0, 16)])


def _peaks(recompute: str, cap: int) -> dict:
    x, y = torch.randn(2048, 128, generator=torch.Generator().manual_seed(1)), torch.randn(2048, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a predicted peak over the cap warns: none may
        with rp.RoundPipe(_deep(), devices=["cpu"] * 2, num_microbatches=2, plan=DEEP, device_memory=cap,
                          recompute=recompute, resident_layers=0) as model:   # activations are the subject
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            stats = model.memory_stats()["workers"]
            assert all(v == 0 for s in stats.values() for v in s["current"].values()), stats   # nothing left held
            return stats


def test_a_stage_holds_one_layer_s_activations_at_layer_grain():
    """The ledger's peak: a 16-layer backward stage at stage grain holds its 16 layers' saved activations; at
    layer grain one layer's, so the worker's peak is 0.42-0.48x (the weights and gradients of 16 layers stay),
    and the prediction matches it (measured 0.9-1.0x: downloads in flight are timing).  Under a cap between
    the two, stage grain is refused (its predicted peak exceeds the cap) and layer grain trains under it."""
    stage, layer = _peaks("stage", 1 << 30), _peaks("layer", 1 << 30)
    for name in stage:
        assert layer[name]["peak_total"] < 0.6 * stage[name]["peak_total"], (name, layer[name], stage[name])
        for s in (stage[name], layer[name]):
            assert 0.8 <= s["peak_total"] / s["predicted_peak"] <= 1.1, s
    cap = max(s["predicted_peak"] for s in layer.values()) * 5 // 4
    assert cap < min(s["predicted_peak"] for s in stage.values())
    for s in _peaks("layer", cap).values():
        assert s["peak_total"] <= cap
    with pytest.raises(UserWarning, match="predicted peak"):
        _peaks("stage", cap)


def _costs(n: int, act: int, params: int) -> list[LayerCost]:
    mem = LayerMemory(in_bytes=act, out_bytes=act, nograd=2 * act, saved=2 * act, recompute=3 * act,
                      backward=4 * act)
    return [LayerCost(fwd_s=1.0, bwd_s=2.0, param_bytes=params, act_bytes=2 * act, grad_bytes=params, memory=mem)
            for _ in range(n)]


def test_layer_grain_footprint_does_not_grow_with_the_stage():
    """A backward stage's bytes: at stage grain they grow by each layer's saved activations; at layer grain
    they are one layer's worst plus the next layer's input, whatever the stage's size."""
    mem = [c.memory for c in _costs(8, 100, 0)]
    one = 100 + max(3 * 100, 4 * 100 + 100)   # in + max(recompute, backward + output gradient)
    assert [backward_bytes(mem, range(0, k), layer_grain=True) for k in (1, 2, 8)] == [one, one + 100, one + 100]
    assert backward_bytes(mem, range(0, 8)) > backward_bytes(mem, range(0, 2)) > backward_bytes(mem, range(0, 1))
    assert backward_bytes(mem, range(0, 8), fused=True, layer_grain=True) == backward_bytes(mem, range(0, 8), fused=True)


def test_the_planner_packs_bigger_backward_stages_at_layer_grain():
    """Under the same memory limit and no time bound, fewer backward stages fit at layer grain."""
    costs = _costs(12, act=1 << 20, params=1 << 16)
    limit = 12 << 20
    stage, layer = greedy(costs, math.inf, limit), greedy(costs, math.inf, limit, layer_grain=True)
    assert len(layer.backward) < len(stage.backward)
    assert max(len(r) for r in layer.backward[1:]) > max(len(r) for r in stage.backward[1:])


def test_recompute_option_is_checked():
    with pytest.raises(ValueError, match="recompute='block'.*'stage'.*'layer'"):
        rp.RoundPipe(MODELS["mlp"](), devices=["cpu"], recompute="block")


def test_one_call_may_choose_its_grain():
    """forward_backward(..., recompute=) and model(x, recompute=) override the model's grain for one call (as the
    published run_config's recompute_grain): each call is scheduled at its own grain, the results are the same."""
    torch.manual_seed(3)
    layers = MODELS["mlp"](6)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2, plan=PLAN6) as model:
        model._check_recompute = True
        grains = []
        real = model.dispatcher.schedule
        model.dispatcher.schedule = lambda *a: grains.append(real(*a).layer_grain) or real(*a)
        losses = [model.forward_backward(x, labels=y, loss_fn=F.mse_loss, recompute=r) for r in ("layer", None)]
        model(x.clone().requires_grad_(True), recompute="layer").sum().backward()
        assert grains == [True, False, False, True]   # the composed call: its forward, then its backward's
        assert torch.equal(losses[0], losses[1])
        for bad in ("Layer", 1):
            with pytest.raises(ValueError, match=f"recompute={bad!r} must be 'stage', 'layer'"):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss, recompute=bad)
