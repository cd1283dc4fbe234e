"""PyTorch's contract through a composed call: `p.grad` is final when `backward()` returns.

The loops PyTorch Lightning and Accelerate run, `loss = f(model(x)); loss.backward(); opt.step();
opt.zero_grad()` with a torch optimizer over `model.parameters()`, and no `synchronize()`, must train
exactly as the same loop on the plain nn.Sequential (issue 52 item 1).  The layers sleep a random time
first (rp_models.Slow), so a gradient that lands after backward() returned shows as a wrong number.
"""
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import Slow, max_rel_err, mlp, reference
from torch import nn

import roundpipe as rp

TOL = 1e-5
PLAN = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])   # recomputing stages, a late tail


def slow_mlp(n=4, seed=0):
    torch.manual_seed(seed)
    return [Slow(m, 0.003) for m in mlp(n)]


def batches(n, seed=1, size=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 8, generator=g)) for _ in range(n)]


def assert_params_equal(model, ref, tol=TOL):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert max_rel_err(p.detach(), q.detach()) <= tol, (name, max_rel_err(p.detach(), q.detach()))


def assert_grads_equal(model, ref, tol=1e-6):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert max_rel_err(p.grad, q.grad) <= tol, (name, max_rel_err(p.grad, q.grad))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_torch_optimizer_loop_matches_pytorch(set_to_none):
    """out = model(x); mse.backward(); AdamW.step(); zero_grad() over 10 steps, no synchronize(): losses
    and final parameters equal the plain nn.Sequential's (1e-5), zero_grad to None or to zeros."""
    layers = slow_mlp()
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(10):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=set_to_none)
            assert max_rel_err(loss.detach(), ref_loss.detach()) <= TOL
        assert_params_equal(model, ref)


def test_gradient_accumulation_matches_pytorch():
    """Two backward() calls before one AdamW step, over 5 steps: the second adds to the first's p.grad
    as in PyTorch, and the step reads both."""
    layers = slow_mlp(seed=2)
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(10, seed=3)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(0, 10, 2):
            for x, y in data[i:i + 2]:
                (F.mse_loss(model(x), y) / 2).backward()
                (F.mse_loss(ref(x), y) / 2).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert_params_equal(model, ref)


def test_grad_is_final_when_backward_returns():
    """p.grad read right after backward() returns equals the reference's, accumulating over two backward
    calls; a later synchronize() changes no gradient."""
    layers = slow_mlp(seed=4)
    ref = reference(layers)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN) as model:
        for x, y in batches(2, seed=5):
            F.mse_loss(ref(x), y).backward()
            F.mse_loss(model(x), y).backward()
            assert_grads_equal(model, ref)
        seen = [p.grad.clone() for p in model.parameters()]
        model.synchronize()
        for a, p in zip(seen, model.parameters()):
            assert torch.equal(a, p.grad)


def test_closure_step_matches_pytorch():
    """Lightning's automatic optimization: opt.step(closure), the closure running forward and backward,
    reads p.grad as soon as the closure returns."""
    layers = slow_mlp(seed=6)
    ref = reference(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(6, seed=7):
            for net, o in ((model, opt), (ref, ref_opt)):
                def closure(net=net, o=o, x=x, y=y):
                    o.zero_grad()
                    loss = F.mse_loss(net(x), y)
                    loss.backward()
                    return loss
                o.step(closure)
        assert_params_equal(model, ref)


def test_grads_final_with_other_branches_and_chained_models():
    """A loss over a chain b(a(x)) and a plain module's branch: after backward() every p.grad of both
    RoundPipes (and of the plain module) equals the plain-PyTorch graph's, SGD trains them alike."""
    torch.manual_seed(8)
    first, second, side = slow_mlp(2, seed=8), slow_mlp(3, seed=9), nn.Linear(8, 8)
    ref_a, ref_b, ref_side = reference(first), reference(second), reference([side])
    ref_params = [*ref_a.parameters(), *ref_b.parameters(), *ref_side.parameters()]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
    with rp.RoundPipe(first, devices=["cpu"] * 2, num_microbatches=3) as a, \
            rp.RoundPipe(second, devices=["cpu"] * 2, num_microbatches=2) as b:
        opt = torch.optim.SGD([*a.parameters(), *b.parameters(), *side.parameters()], lr=0.1, momentum=0.9)
        for x, y in batches(4, seed=10):
            (F.mse_loss(ref_b(ref_a(x)), y) + ref_side(x).pow(2).mean()).backward()
            (F.mse_loss(b(a(x)), y) + side(x).pow(2).mean()).backward()
            assert_grads_equal(a, ref_a)
            assert_grads_equal(b, ref_b)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert_params_equal(a, ref_a)
        assert_params_equal(b, ref_b)


def test_bf16_grads_are_fp32_when_backward_returns():
    """With a bf16 compute dtype a single landing is held in bf16 until something reads gradients:
    backward() returns with it in an fp32 p.grad, equal to what synchronize() shows."""
    layers = slow_mlp(seed=11)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN,
                      compute_dtype=torch.bfloat16) as model:
        x, y = batches(1, seed=12)[0]
        F.mse_loss(model(x), y).backward()
        seen = [p.grad for p in model.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in seen)
        seen = [g.clone() for g in seen]
        model.synchronize()
        for a, p in zip(seen, model.parameters()):
            assert torch.equal(a, p.grad)


def test_fused_torch_optimizer_updates_are_uploaded():
    """torch's fused AdamW writes the masters without bumping their version counters; with a bf16 compute
    dtype (a separate upload copy, as on GPUs) the next call still uploads its update: the losses follow
    those of the unfused AdamW's loop (a bf16 ulp), not the initial weights'."""
    losses = {}
    for fused in (True, False):
        layers = slow_mlp(seed=13)
        with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN,
                          compute_dtype=torch.bfloat16) as model:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-2, fused=fused, foreach=False if not fused else None)
            losses[fused] = []
            for x, y in batches(4, seed=14) * 2:
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[fused].append(loss.item())
    assert losses[False][4] < losses[False][0] - 0.05   # the loop trains: the repeated batch's loss fell
    for a, b in zip(losses[True], losses[False]):
        assert abs(a - b) <= 1e-2 * abs(b), (losses[True], losses[False])


class SlowRecompute(nn.Module):
    """A layer whose recompute (its forward with grad enabled, in a backward stage) takes 0.3 s."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        if torch.is_grad_enabled():
            time.sleep(0.3)
        return torch.tanh(self.fc(x))


def test_rest_of_the_graph_runs_while_the_tail_drains():
    """The node's backward returns once its call is seeded: a node of the caller's graph after it runs
    while layer 0's backward stage (a 0.3 s recompute) still works, and backward() returns only after it
    landed, with every p.grad equal to the plain module's."""
    torch.manual_seed(15)
    layers = [SlowRecompute()] + mlp(3)
    ref = reference(layers)
    z = torch.randn(6, 8, requires_grad=True)
    x, y = batches(1, seed=16)[0]
    (F.mse_loss(ref(x), y) + (z * 2).sum()).backward()
    seen = []
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=PLAN) as model:
        h = z * 2   # made before the model's node: autograd runs its backward after the node's
        h.register_hook(lambda g: seen.append(model.module[0].fc.weight.grad is None))
        (F.mse_loss(model(x), y) + h.sum()).backward()
        assert seen == [True]
        assert_grads_equal(model, ref)
