"""Staleness compensation (roundpipe/engine/step/staleness.py): prediction in the fused pass, PipeMare's rescheduling."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe import _native
from roundpipe.engine.step.staleness import StalenessCompensation, predicted

OPTIMIZERS = {
    "adamw": lambda ps: rp.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: rp.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "adagrad": lambda ps: rp.optim.Adagrad(ps, lr=1e-2, weight_decay=0.01),
    "lion": lambda ps: rp.optim.Lion(ps, lr=1e-3, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shadow_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
def test_the_fused_pass_writes_the_reference_prediction(name, shadow_dtype, level, restore_level):
    """step_layer(predict=alpha): the upload copy is the reference w + alpha (w - w_before) rounded once, the
    masters and state are exactly those of a step without prediction, at every SIMD level."""
    if level not in ("scalar",) and _native.simd_level() == "scalar":
        pytest.skip("no SIMD on this CPU")
    if _native.available():
        try:
            _native.set_simd_level(level)
        except (ValueError, RuntimeError):
            pytest.skip(f"{level} unsupported here")
    torch.manual_seed(0)
    p0 = [torch.randn(37, 5), torch.randn(1003)]
    grads = [torch.randn_like(p) for p in p0]
    runs = []
    for alpha in (0.0, 0.7):
        ps = [nn.Parameter(p.clone()) for p in p0]
        opt = OPTIMIZERS[name](ps)
        ups = [torch.empty_like(p, dtype=shadow_dtype) for p in ps]
        for step in range(3):
            before = [p.detach().clone() for p in ps]
            opt.step_layer(ps, ups, grads=[g * (step + 1) for g in grads], predict=alpha)
        runs.append(([p.detach().clone() for p in ps], ups, before))
    (plain, plain_up, _), (pred, pred_up, before) = runs
    for a, b in zip(plain, pred):
        assert torch.equal(a, b)                  # masters and state untouched by the prediction
    for u, p in zip(plain_up, plain):
        assert torch.equal(u, p.to(shadow_dtype))
    for u, p, b in zip(pred_up, pred, before):   # one fma rounding in the kernel, two in the reference
        tol = 1e-2 if shadow_dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(u.float(), predicted(p, b, 0.7), rtol=tol, atol=1e-6)


def test_async_training_with_prediction_equals_a_reference_loop():
    """RoundPipe async + StalenessCompensation(predict=1) equals a plain loop written from the definition: the
    gradient of call t is taken at u_(t-1) = w_(t-1) + (w_(t-1) - w_(t-2)) (the upload of step t-1) and applied
    to w_(t-1), one step stale (the first call reads w_0)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)]
    ref_layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)]
    for a, b in zip(ref_layers, layers):
        b.load_state_dict(a.state_dict())
    data = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(6)]
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compensation=StalenessCompensation(predict=1.0)) as model:
        opt = rp.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=True)
        model.synchronize()
        got = [p.detach().clone() for p in model.parameters()]
    ref = nn.Sequential(*ref_layers)
    w = [p.detach().clone() for p in ref.parameters()]
    reads = [t.clone() for t in w]          # what the next call reads
    pending = None                          # the gradient of the call before, applied by the next step
    for x, y in data:
        with torch.no_grad():
            for p, r in zip(ref.parameters(), reads):
                p.copy_(r)
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        grad = [p.grad.clone() for p in ref.parameters()]
        if pending is not None:   # the step issued after the previous call updates w with its gradient
            w_new = [t - 0.1 * g for t, g in zip(w, pending)]
            reads = [n + (n - o) for n, o in zip(w_new, w)]
            w = w_new
        pending = grad
    w = [t - 0.1 * g for t, g in zip(w, pending)]
    for a, b in zip(got, w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pipemare_rescheduling_factor():
    c = StalenessCompensation(predict=0.0, warmup_steps=4, delay=4.0)
    assert [round(c.lr_factor(k), 6) for k in range(6)] == [0.25, round(4 ** -0.75, 6), 0.5, round(4 ** -0.25, 6),
                                                            1.0, 1.0]
    assert StalenessCompensation(warmup_steps=10).lr_factor(0) == 1.0   # delay 1: tau^(-p) = 1


def test_bad_options_and_optimizers_are_refused():
    with pytest.raises(ValueError, match="predict=-1"):
        StalenessCompensation(predict=-1)
    with pytest.raises(ValueError, match="delay=0.5"):
        StalenessCompensation(delay=0.5)
    with pytest.raises(TypeError, match="compensation must be a roundpipe.StalenessCompensation"):
        rp.RoundPipe([nn.Linear(2, 2)], devices=["cpu"], compensation=1.0)
    with rp.RoundPipe([nn.Linear(2, 2)], devices=["cpu"], compensation=StalenessCompensation()) as model:
        model.forward_backward(torch.randn(2, 2), labels=torch.randn(2, 2), loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="compensation needs a roundpipe.optim optimizer"):
            model.step(torch.optim.SGD(model.parameters(), lr=0.1), asynchronous=True)
