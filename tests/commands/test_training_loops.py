"""Ordinary training loops equal plain PyTorch (synchronous) and the stale-1 reference (asynchronous).

The loops have everything at once: gradient accumulation over 1-4 calls, an eval call
between steps, a parameter off the autograd path, a frozen parameter, weight decay,
global-norm clipping that triggers on some steps, and a LambdaLR warmup scheduler.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from rp_models import Mlp, Slow, max_rel_err
from stale_reference import StaleReference
from test_call_sequences import run_with_watchdog
from torch import nn

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps

STEPS = 20
ACCUM = [1, 2, 3, 4, 2]   # calls per step, cycled
MAX_NORM = 0.3            # below the typical gradient norm here, so clipping acts on most steps


class WithUnused(nn.Module):
    """A layer with a parameter that never reaches the loss: its p.grad must stay None."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.spare = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(self.fc(x))


class WithFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc.weight.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def model_layers():
    torch.manual_seed(0)
    return [Mlp(), WithUnused(), WithFrozen(), Mlp()]


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


OPTIMIZERS = {
    "rp": lambda ps: rp.optim.AdamW(ps, lr=2e-2, weight_decay=0.1),
    "torch": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.1),
}


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return lambda: (torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))


def check_params(model_params, ref_params, tol):
    for (n, p), q in zip(model_params, ref_params):
        assert max_rel_err(p.detach(), q.detach()) <= tol, (n, max_rel_err(p.detach(), q.detach()))


@pytest.mark.parametrize("opt_kind", ["rp", "torch"])
def test_synchronous_loop_equals_pytorch(opt_kind):
    """20 synchronous steps with accumulation, eval, unused/frozen params, decay, clipping, warmup = PyTorch."""
    layers = model_layers()
    spare0, frozen0 = layers[1].spare.detach().clone(), layers[2].fc.weight.detach().clone()
    ref = nn.Sequential(*copy.deepcopy(layers))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=0.1)
    ref_sched = warmup(ref_opt)
    batch = data()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        opt = OPTIMIZERS[opt_kind](model.parameters())
        sched = warmup(opt)
        for step in range(STEPS):
            for _ in range(ACCUM[step % len(ACCUM)]):
                x, y = batch()
                loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                ref_loss = F.mse_loss(ref(x), y)
                ref_loss.backward()
                assert max_rel_err(loss, ref_loss.detach()) <= 1e-5, step
            model.synchronize()
            assert model.module[1].spare.grad is None and model.module[2].fc.weight.grad is None
            for p, q in zip(model.parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None)
            model.step(opt, asynchronous=False, lr_scheduler=sched, max_grad_norm=MAX_NORM)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], MAX_NORM)
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
            x, _ = batch()
            with torch.no_grad():
                assert max_rel_err(model(x), ref(x)) <= 1e-5, step   # an eval call between steps
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        check_params(model.named_parameters(), ref.parameters(), 1e-5)
    assert torch.equal(layers[1].spare.detach(), spare0)      # no decay, no momentum without a gradient
    assert torch.equal(layers[2].fc.weight.detach(), frozen0)


def async_loop(opt_kind, layers, workers=2, num_mb=3, clip=MAX_NORM, steps=STEPS):
    ref = StaleReference(nn.Sequential(*copy.deepcopy(layers)), OPTIMIZERS["torch"], warmup, clip)
    batch = data()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb) as model:
        opt = OPTIMIZERS[opt_kind](model.parameters())
        sched = warmup(opt)
        for step in range(steps):
            for _ in range(ACCUM[step % len(ACCUM)]):
                x, y = batch()
                loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                assert max_rel_err(loss, ref.forward_backward(x, y)) <= 1e-5, step
            model.step(opt, lr_scheduler=sched, max_grad_norm=clip, asynchronous=True)
            ref.step(asynchronous=True)
            if step % 3 == 2:   # an eval call now and then: a sync point
                x, _ = batch()
                assert max_rel_err(model(x), ref(x)) <= 1e-5, step
        model.synchronize()
        check_params(model.named_parameters(), ref.cur.parameters(), 1e-5)


@pytest.mark.parametrize("opt_kind", ["rp", "torch"])
def test_asynchronous_loop_equals_stale_reference(opt_kind):
    """The same loop with asynchronous steps equals the stale-1 reference, scheduler and clipping included."""
    run_with_watchdog(lambda: async_loop(opt_kind, model_layers()))


@pytest.mark.parametrize("opt_kind", ["rp", "torch"])
def test_asynchronous_loop_under_random_delays(opt_kind):
    """Random sleeps in copies, layers, G-/P-copies and the optimizer do not change the result."""
    layers = [Slow(m, 0.001) for m in model_layers()]
    copies, host = random_sleeps(0.001, seed=11), random_sleeps(0.01, seed=12, prob=0.6)

    def hook(kind):
        (host if kind in ("optimizer", "pcopy", "gcopy") else copies)(kind)
    with inject_delays(hook):
        run_with_watchdog(lambda: async_loop(opt_kind, layers, workers=3, num_mb=5, steps=8))
