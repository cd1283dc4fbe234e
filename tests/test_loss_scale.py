"""fp16 dynamic loss scaling in the engine (roundpipe/engine/loss_scale.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine.loss_scale import LossScaler


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf") if Poison.armed else g


class Poison(nn.Module):
    """Passes x through; while `armed`, its backward makes every gradient below it inf."""

    armed = False

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return _InfGrad.apply(torch.tanh(self.fc(x)))


def layers():
    torch.manual_seed(0)
    return [nn.Linear(8, 8), Poison(), nn.Linear(8, 8)]


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("optimizer", ["rp", "torch"])
def test_an_injected_overflow_skips_exactly_that_step(asynchronous, optimizer):
    """fp16 on CPU workers, 6 steps, an inf gradient in the call of step 3: step 3 is skipped for every layer
    (masters, optimizer state and the lr scheduler untouched), the scale halves, every other step runs."""
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    Poison.armed = False
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, compute_dtype=torch.float16) as model:
        params = list(model.parameters())
        opt = rp.optim.AdamW(params, lr=1e-2) if optimizer == "rp" else torch.optim.AdamW(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        assert model.loss_scale == 2.0 ** 16
        before = {}
        for s in range(1, 7):
            Poison.armed = s == 3
            try:
                loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.synchronize()   # the call's last backward stages run after it returned: armed until then
            finally:
                Poison.armed = False
            assert torch.isfinite(loss)   # the loss itself is unscaled and finite
            before[s] = snapshot(model)
            model.step(opt, asynchronous=asynchronous, lr_scheduler=sched)
            model.synchronize()
            after = snapshot(model)
            changed = [not torch.equal(a, b) for a, b in zip(before[s], after)]
            if s == 3:
                assert not any(changed)
            else:
                assert all(changed), (s, changed)
        assert model.scaler.skipped == [3]
        assert model.loss_scale == 2.0 ** 15
        assert sched.last_epoch == 5
        assert all(float(st["step"]) == 5 for st in opt.state.values())


def test_the_scale_grows_after_growth_interval_good_steps_and_scaling_matches_fp32():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    precision = rp.Precision(torch.float16, loss_scale=rp.LossScale(init_scale=2.0 ** 8, growth_interval=2))
    results, scales = [], []
    for prec in (precision, rp.Precision(torch.float32)):
        with rp.RoundPipe(layers(), devices=["cpu"] * 2, precision=prec) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
            scales.append([])
            for _ in range(5):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False)
                scales[-1].append(model.loss_scale)
            results.append(snapshot(model))
    assert scales == [[256.0, 512.0, 512.0, 1024.0, 1024.0], [None] * 5]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)   # fp16 forward, unscaled updates


def test_scales_used_by_calls_follow_the_step_history():
    """After an asynchronous step s the calls of its window use history[s-1], after a synchronous one history[s]."""
    assert LossScaler.group_index(0, False) == 0
    assert LossScaler.group_index(3, True) == 2 and LossScaler.group_index(3, False) == 3
    sc = LossScaler(rp.LossScale(init_scale=8.0, growth_interval=2))
    sc.record(1, 0, found_inf=False)
    sc.record(2, 0, found_inf=True)    # 8 * 0.5
    sc.record(3, 1, found_inf=True)    # the same overflow seen again through the delay: halves once
    assert [sc.history[k][0] for k in (1, 2, 3)] == [8.0, 4.0, 4.0]
    sc.record(4, 3, found_inf=False)
    sc.record(5, 4, found_inf=False)   # two good steps in a row: doubles
    assert sc.scale == 8.0 and sc.skipped == [2, 3]


def test_loss_scale_options_are_checked():
    with pytest.raises(ValueError, match="backoff_factor=2"):
        rp.LossScale(backoff_factor=2)
    with pytest.raises(ValueError, match="growth_interval=0"):
        rp.LossScale(growth_interval=0)
    with pytest.raises(ValueError, match="init_scale=-1"):
        rp.LossScale(init_scale=-1)
    with pytest.raises(TypeError, match="loss_scale must be a roundpipe.LossScale"):
        rp.RoundPipe([nn.Linear(4, 4)], devices=["cpu"], precision=rp.Precision(torch.float16, loss_scale=2.0))
    with rp.RoundPipe([nn.Linear(4, 4)], devices=["cpu"],
                      precision=rp.Precision(torch.float16, loss_scale=rp.LossScale(enabled=False))) as model:
        assert model.loss_scale is None
