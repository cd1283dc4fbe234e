"""fp16 dynamic loss scaling in the engine (roundpipe/engine/step/loss_scale.py)."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine.step.loss_scale import LossScaler


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


# ---- the gradients and updates against torch autocast fp16 + GradScaler (SGD is linear in the gradient, so a
# missing, doubled or wrong-scale unscale moves the weights by that factor; AdamW would barely notice)

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def _load(module, weights):
    with torch.no_grad():
        for p, w in zip(module.parameters(), weights):
            p.copy_(w)


def torch_run(data, fp16, steps=(), stale=0, momentum=0.9, lr=0.1):
    """Plain PyTorch on one device: a call per batch (autocast fp16 with a GradScaler, else fp32), an SGD step
    after the calls numbered in `steps` (scaler.step + update).  Call t reads the weights after step t - stale
    (stale=1: the asynchronous step's one-step-old weights).  Returns the gradients of the calls after the last
    step, unscaled as scaler.unscale_ leaves them (None if there were none), and the weights."""
    model, reader = nn.Sequential(*layers()), nn.Sequential(*layers())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    weights = [snapshot(model)]   # weights[k]: after k steps
    acc = None
    for t, (x, y) in enumerate(data):
        _load(reader, weights[max(0, len(weights) - 1 - stale)] if stale else snapshot(model))
        reader.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.mse_loss(reader(x), y)
        scaler.scale(loss).backward()
        grads = [p.grad.detach().clone() for p in reader.parameters()]
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        if t + 1 in steps:
            for p, g in zip(model.parameters(), acc):
                p.grad = g
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            weights.append(snapshot(model))
            acc = None
    if acc is not None:   # unscaled exactly as GradScaler.unscale_ does it
        for p, g in zip(model.parameters(), acc):
            p.grad = g
        scaler.unscale_(opt)
        acc = [p.grad for p in model.parameters()]
    return acc, snapshot(model)


def assert_fp16_close(got, fp16, fp32, atol=0.0, rel=0.0):
    """The fp16 rule (STYLE.md 4): got is at most twice as far from the fp32 reference as PyTorch's own fp16
    result, plus atol + rel * the reference's largest magnitude, tensor by tensor (max over elements)."""
    for i, (a, b, r) in enumerate(zip(got, fp16, fp32)):
        err, ref_err = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * ref_err + atol + rel * r.abs().max().item(), (i, err, ref_err)


# A gradient travels home in fp16 (precision policy): one rounding more than autocast's fp32 parameter
# gradient, half an fp16 ulp of its largest element (2^-11 relative); a wrong unscale is off by 2x or more.
GRAD_REL = 2.0 ** -11


def rp_model():
    return rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=2, compute_dtype=torch.float16)


def make_sgd(kind, params, momentum=0.9, lr=0.1):
    return (rp.optim.SGD if kind == "rp" else torch.optim.SGD)(params, lr=lr, momentum=momentum)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("optimizer", ["rp", "torch"])
@pytest.mark.parametrize("look", [False, True])
def test_sgd_under_loss_scaling_matches_torch_grad_scaler(asynchronous, optimizer, look):
    """6 SGD steps with momentum under fp16 loss scaling end within the fp16 rule of torch autocast + GradScaler
    (an asynchronous step against torch reading one-step-old weights), whether or not p.grad was read
    (synchronize) before each step: the step unscales once, by the scale the calls used."""
    data = batches(6)
    _, ref16 = torch_run(data, True, steps=range(1, 7), stale=int(asynchronous))
    _, ref32 = torch_run(data, False, steps=range(1, 7), stale=int(asynchronous))
    with rp_model() as model:
        opt = make_sgd(optimizer, model.parameters())
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            if look:
                model.synchronize()
                assert all(p.grad is not None for p in model.parameters())
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        assert model.scaler.skipped == [] and model.loss_scale == 2.0 ** 16
        got = snapshot(model)
    assert_fp16_close(got, ref16, ref32, atol=1e-5)
    moved = max((a - b).abs().max().item() for a, b in zip(ref32, snapshot(nn.Sequential(*layers()))))
    assert moved > 1e-2   # what a wrong unscale would change: the tolerance is far below it


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("optimizer", ["rp", "torch"])
@pytest.mark.parametrize("calls", [[1], [3], [1, 1, 1]])
def test_p_grad_after_synchronize_is_the_unscaled_gradient(asynchronous, optimizer, calls):
    """After forward_backward calls, p.grad read after synchronize() is the true gradient summed over the calls
    (the fp16 rule against PyTorch's unscaled one), not the loss-scaled one; `calls` lists how many calls run
    before each synchronize() (accumulation, and accumulation into a p.grad already read).  The step that
    follows does not unscale again: the weights match torch's scaler.step."""
    data = batches(sum(calls))
    with rp_model() as model:
        opt = make_sgd(optimizer, model.parameters())
        done = 0
        for n in calls:
            for x, y in data[done:done + n]:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            done += n
            model.synchronize()
            model.synchronize()   # a second look does not unscale twice
            g16, _ = torch_run(data[:done], True)
            g32, _ = torch_run(data[:done], False)
            grads = [p.grad.clone() for p in model.parameters()]
            assert all(g.dtype == torch.float32 for g in grads)
            assert_fp16_close(grads, g16, g32, rel=GRAD_REL)
        model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        assert all(p.grad is None for p in model.parameters())
        got = snapshot(model)
    _, w16 = torch_run(data, True, steps={len(data)})
    _, w32 = torch_run(data, False, steps={len(data)})
    assert_fp16_close(got, w16, w32, atol=1e-5)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_p_grad_after_an_overflow_reads_as_unscale_leaves_it_and_the_step_is_skipped(asynchronous):
    """An inf gradient in a call: after synchronize() the layers below it read inf/NaN (as torch's unscale_
    leaves them), the layer above reads its true gradient; the step is skipped, the scale halves, and the next
    call's p.grad is unscaled by the scale that call used (after an asynchronous step, still the old one)."""
    (x, y), (x2, y2) = batches(2)
    with rp_model() as model:
        opt = make_sgd("rp", model.parameters())
        before = snapshot(model)
        Poison.armed = True
        try:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
        finally:
            Poison.armed = False
        *below, w2, b2 = [p.grad.clone() for p in model.parameters()]
        assert all(not torch.isfinite(g).all() for g in below)
        g16, _ = torch_run([(x, y)], True)
        g32, _ = torch_run([(x, y)], False)
        assert_fp16_close([w2, b2], g16[-2:], g32[-2:], rel=GRAD_REL)
        model.step(opt, asynchronous=asynchronous)
        model.forward_backward(x2, labels=y2, loss_fn=F.mse_loss)
        model.synchronize()
        assert model.scaler.skipped == [1] and model.loss_scale == 2.0 ** 15
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model))) and not opt.state
        g16, _ = torch_run([(x2, y2)], True)
        g32, _ = torch_run([(x2, y2)], False)
        assert_fp16_close([p.grad for p in model.parameters()], g16, g32, rel=GRAD_REL)
        model.step(opt, asynchronous=False)
        assert model.scaler.skipped == [1]


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("optimizer", ["rp", "torch"])
def test_gradients_read_after_synchronize_resume_bitwise_from_a_checkpoint(tmp_path, asynchronous, optimizer):
    """A checkpoint saved after synchronize() showed p.grad unscaled (asynchronous: with the step that reads them
    pending) resumes bitwise: the gradients are saved unscaled and marked so, then neither unscaled again by the
    step nor mixed with scaled ones by the next call's accumulation."""
    data = batches(4)
    path = tmp_path / "ckpt"

    def run(load):
        with rp_model() as model:
            opt = make_sgd(optimizer, model.parameters())
            if load:
                model.load_checkpoint(path, opt)
            else:
                model.forward_backward(data[0][0], labels=data[0][1], loss_fn=F.mse_loss)
                model.step(opt, asynchronous=asynchronous)
                model.forward_backward(data[1][0], labels=data[1][1], loss_fn=F.mse_loss)
                model.synchronize()
                if asynchronous:
                    model.step(opt, asynchronous=True)
                model.save_checkpoint(path, opt)
            for x, y in data[2:]:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=asynchronous)
            model.synchronize()
            assert model.scaler.skipped == []
            return snapshot(model)
    saved = run(load=False)
    manifest = json.load(open(path / "checkpoint.json"))
    if not (asynchronous and optimizer == "torch"):   # a torch optimizer's update already read (and cleared) them
        assert manifest["grads_unscaled"] == [2.0 ** -16] * 3
    resumed = run(load=True)
    assert all(torch.equal(a, b) for a, b in zip(saved, resumed))


def test_a_bad_grads_unscaled_record_in_a_checkpoint_is_named(tmp_path):
    """checkpoint.json's per-layer unscale factors are checked before anything is restored."""
    with rp_model() as model:
        model.forward_backward(torch.randn(8, 8), labels=torch.randn(8, 8), loss_fn=F.mse_loss)
        model.synchronize()
        model.save_checkpoint(tmp_path / "c")
    mpath = tmp_path / "c" / "checkpoint.json"
    manifest = json.load(open(mpath))
    manifest["grads_unscaled"] = [1.0, -2.0, None]
    json.dump(manifest, open(mpath, "w"))
    with rp_model() as model:
        with pytest.raises(ValueError, match=r"grads_unscaled=\[1.0, -2.0, None\] must be a list of 3 entries"):
            model.load_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_checkpoint_loads_into_a_model_that_has_already_stepped(tmp_path, asynchronous):
    """load_checkpoint into a model that issued steps before: the scale history is placed after its own
    steps (it was placed at step 0, and the next step waited forever for a scale no step would record;
    found by tests/engine/test_soak_features.py).  Training on from the load equals a fresh model's."""
    import threading
    data = batches(5)
    path = tmp_path / "ckpt"

    def train(model, opt, batch):
        model.forward_backward(batch[0], labels=batch[1], loss_fn=F.mse_loss)
        model.step(opt, asynchronous=asynchronous)

    def run(steps_before):
        with rp_model() as model:
            opt = make_sgd("rp", model.parameters())
            if steps_before is None:
                train(model, opt, data[0])
                model.save_checkpoint(path, opt)
                return None
            for x in data[1:1 + steps_before]:
                train(model, opt, x)
            model.load_checkpoint(path, opt)
            for x in data[3:]:
                train(model, opt, x)
            model.synchronize()
            return snapshot(model), model.loss_scale
    run(None)
    box = {}
    worker = threading.Thread(target=lambda: box.update(stepped=run(2)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the step after load_checkpoint waited forever for its loss scale"
    fresh = run(0)
    assert box["stepped"][1] == fresh[1]
    assert all(torch.equal(a, b) for a, b in zip(box["stepped"][0], fresh[0]))
