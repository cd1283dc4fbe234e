"""step(): optimizer checks, errors that never wedge the engine, lr schedulers and gradient clipping."""
import copy

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err, mlp, reference
from test_call_sequences import run_with_watchdog

import roundpipe as rp


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)


@pytest.mark.parametrize("which", ["subset", "superset", "copies"])
@pytest.mark.parametrize("opt_class", [rp.optim.AdamW, torch.optim.AdamW])
def test_optimizer_over_other_parameters_is_refused(which, opt_class):
    """An optimizer over a subset, a superset or copies of the parameters gets a ValueError naming the first one."""
    x, y = batch()
    with rp.RoundPipe(mlp(3), devices=["cpu"] * 2) as model:
        params = list(model.parameters())
        if which == "subset":
            opt, match = opt_class(params[2:]), r"parameter '0\.0\.weight'.*not in the optimizer"
        elif which == "superset":
            opt, match = opt_class(params + [torch.nn.Parameter(torch.zeros(3))]), r"\['params'\]\[6\].*shape \(3,\)"
        else:
            opt, match = opt_class(copy.deepcopy(params)), r"\['params'\]\[0\].*not a parameter of this RoundPipe"
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        before = [p.detach().clone() for p in params]
        for asynchronous in (True, False):
            with pytest.raises(ValueError, match=match):
                model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(params, before))
        assert all(p.grad is not None for p in params)   # nothing consumed: a right step can still follow
        model.step(rp.optim.AdamW(params, lr=0.1), asynchronous=False)
        assert not any(torch.equal(p, q) for p, q in zip(params, before))


class FailingLayerwise:
    """A per-layer optimizer (the fused seam) that fails on one layer."""

    def __init__(self, inner, bad_layer_params):
        self.inner, self.bad = inner, {id(p) for p in bad_layer_params}

    def step_layer(self, params, upload):
        if any(id(p) in self.bad for p in params):
            raise FloatingPointError("non-finite update")
        self.inner.step_layer(params, upload)


class FailingAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        raise RuntimeError("optimizer exploded")


@pytest.mark.parametrize("kind", ["layerwise", "torch"])
@pytest.mark.parametrize("asynchronous", [True, False])
def test_optimizer_error_reaches_the_caller_and_never_wedges(kind, asynchronous):
    """The step's error reaches the caller (at once, or at the next call); every layer is fully updated or
    untouched; the next calls run and train (before: the next call hung)."""
    layers = mlp(4)
    x, y = batch()

    def run():
        with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
            params = list(model.parameters())
            good = rp.optim.AdamW(params, lr=0.1)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(good, asynchronous=False)
            before = [p.detach().clone() for p in params]
            if kind == "layerwise":
                opt, exc = FailingLayerwise(good, list(model.module[1].parameters())), FloatingPointError
            else:
                opt, exc = FailingAdamW(params, lr=0.1), RuntimeError
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            if asynchronous:   # raised by the call it happened under, or at the start of the next one
                model.step(opt, asynchronous=True)
                with pytest.raises(exc):
                    for _ in range(2):
                        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            else:
                with pytest.raises(exc):
                    model.step(opt, asynchronous=False)
            model.synchronize()
            for l in range(len(layers)):
                now = [p.detach() for p in model.module[l].parameters()]
                old = before[2 * l:2 * l + 2]
                moved = [not torch.equal(a, b) for a, b in zip(now, old)]
                assert all(moved) or not any(moved), l    # per layer: fully updated or untouched
            assert not any(not torch.equal(a, b) for a, b in zip(model.module[1].parameters(), before[2:4]))
            if not asynchronous:
                assert all(p.grad is None for p in params)  # the failed step consumed its gradients
            # usable: uploads follow the masters, and training goes on exactly
            ref = reference(list(model.module))
            torch.testing.assert_close(model(x), ref(x).detach())
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(good, asynchronous=False)
    run_with_watchdog(run, timeout_s=30)


@pytest.mark.parametrize("opt_class", [rp.optim.AdamW, torch.optim.AdamW])
@pytest.mark.parametrize("asynchronous", [True, False])
def test_lr_scheduler_steps_after_its_update(opt_class, asynchronous):
    """Each update uses the rate of plain `opt.step(); sched.step()`: with a 0/1 alternating rate, the
    weights move on every other step only (an off-by-one moves them on the others)."""
    layers = mlp(2)
    x, y = batch()
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = opt_class(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(s % 2 == 0))
        moved = []
        for _ in range(4):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            before = [p.detach().clone() for p in model.parameters()]
            model.step(opt, asynchronous=asynchronous, lr_scheduler=sched)
            model.synchronize()
            moved.append(not all(torch.equal(p, q) for p, q in zip(model.parameters(), before)))
        assert moved == [True, False, True, False]
        assert sched.last_epoch == 4


@pytest.mark.parametrize("opt_class", [rp.optim.AdamW, torch.optim.SGD])
def test_max_grad_norm_equals_clip_grad_norm(opt_class):
    """step(max_grad_norm=) equals torch.nn.utils.clip_grad_norm_ followed by the step."""
    layers = mlp(3)
    ref = reference(layers)
    ref_opt = (torch.optim.AdamW if opt_class is rp.optim.AdamW else opt_class)(ref.parameters(), lr=0.05)
    with rp.RoundPipe(layers, devices=["cpu"] * 2) as model:
        opt = opt_class(model.parameters(), lr=0.05)
        for i in range(5):
            x, y = batch(i)
            model.forward_backward(x * 10, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False, max_grad_norm=0.1)
            F.mse_loss(ref(x * 10), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            ref_opt.step()
            ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.detach(), q.detach()) <= 1e-5


def test_clip_coefficient_is_torchs():
    """The factor the fused path folds in is the one clip_grad_norm_ multiplies by."""
    from roundpipe.engine.step.optimizer_step import clip_coefficient
    grads = [torch.randn(5, 3), torch.randn(7)]
    copies = [g.clone() for g in grads]
    torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.zeros_like(g)) for g in grads], 1.0)   # no grads: 0
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, copies):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(ps, 0.5)
    c = clip_coefficient(grads, 0.5)
    for p, g in zip(ps, grads):
        assert torch.equal(p.grad, g * c)
    assert clip_coefficient(grads, 1e6) == 1.0 and clip_coefficient([], 1.0) == 1.0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(asynchronous="no"), TypeError, "asynchronous must be True or False"),
    (dict(asynchronous=1), TypeError, "asynchronous must be True or False"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm=0.0"),
    (dict(max_grad_norm=float("inf")), ValueError, "max_grad_norm=inf"),
    (dict(lr_scheduler=3), TypeError, "lr_scheduler must have a step"),
])
def test_bad_step_arguments(kwargs, exc, match):
    """Bad step() arguments raise before anything runs; the gradients stay for a right step."""
    x, y = batch()
    with rp.RoundPipe(mlp(2), devices=["cpu"]) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(exc, match=match):
            model.step(opt, **kwargs)
        other = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="another optimizer"):
            model.step(opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1), asynchronous=True)
        model.synchronize()
        assert all(p.grad is not None for p in model.parameters())


def test_the_default_step_is_synchronous():
    """model.step(opt) applies the update before it returns (docs/staleness.md "The default"): three steps give
    the losses of asynchronous=False bit for bit, and not those of the one-step-stale asynchronous=True."""
    def losses(**step_kw):
        torch.manual_seed(0)
        with rp.RoundPipe(mlp(4), devices=["cpu"] * 2, num_microbatches=2) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            out = []
            for i in range(4):
                x, y = batch(i)
                out.append(float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss)))
                model.step(opt, **step_kw)
            return out
    default = losses()
    assert default == losses(asynchronous=False) and default != losses(asynchronous=True)
