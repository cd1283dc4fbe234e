"""The device step (roundpipe/engine/step/device_step.py): resident trained layers keep fp32 masters, optimizer
state and gradient sums on their worker and are updated there.

Every test compares with the host step (device_step=False) on CPU workers, whose "device" tensors are host
tensors: the device update is the optimizer's formula in torch ops, the host one its native kernel, so they
agree within fp32 rounding, not bit for bit.  What changes is the traffic: after the first step the device
layers upload nothing and download no gradient (counted from the workers' copy reports).
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from rp_models import MODELS, Adapted
from torch import nn

import roundpipe as rp

# 6 layers: forward stages [0-1] [2-4], fused tail [5], backward stages [2-4] [0-1]
PLAN6 = rp.Plan(forward=[range(0, 2), range(2, 5)], backward=[range(5, 6), range(2, 5), range(0, 2)])
WIDTH = 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _mlp():
    torch.manual_seed(0)
    return MODELS["mlp"](6)


class Copies:
    """Bytes each call copied per queue (param_up, grad_down) on a model's workers."""

    def __init__(self, model):
        self.bytes: dict[str, int] = {}
        self.lock = threading.Lock()
        for w in model.workers:
            w.copies.record_copies(self._on_copy)

    def _on_copy(self, queue, nbytes, t0, t1):
        with self.lock:
            self.bytes[queue] = self.bytes.get(queue, 0) + nbytes

    def take(self, queue) -> int:
        with self.lock:
            return self.bytes.pop(queue, 0)


def _batches(n, seed=1):
    torch.manual_seed(seed)
    return [(torch.randn(7, WIDTH), torch.randn(7, WIDTH)) for _ in range(n)]


def _model(layers, device_step, device="cpu", **kw):
    kw.setdefault("resident_layers", 6)
    return rp.RoundPipe(layers, devices=[device], num_microbatches=3, plan=PLAN6, microbatches_per_round=3,
                        device_step=device_step, **kw)


def _train(model, opt, batches, per_step=1, max_grad_norm=None, copies=None, traffic=None):
    losses = []
    for i in range(0, len(batches), per_step):
        for x, y in batches[i:i + per_step]:
            losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss)))
        model.wait_calls()
        if copies is not None:
            traffic.append((copies.take("param_up"), copies.take("grad_down")))
        model.step(opt, max_grad_norm=max_grad_norm)
    return losses


def _run(layers, device_step, steps=3, per_step=1, max_grad_norm=None, **kw):
    """Trains; returns (losses, state_dict, optimizer state_dict, (param_up, grad_down) bytes per step)."""
    traffic = []
    with _model(layers, device_step, **kw) as model:
        copies = Copies(model)
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = _train(model, opt, _batches(steps * per_step), per_step, max_grad_norm, copies, traffic)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        opt_state = opt.state_dict()
    return losses, state, opt_state, traffic


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **TOL, msg=k)


def _close_opt(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            torch.testing.assert_close(v, b["state"][i][k], **TOL, msg=f"{i}.{k}")


@pytest.mark.parametrize("per_step", [1, 2])
def test_equals_the_host_step_and_moves_no_bytes_after_the_first_step(per_step):
    host = _run(_mlp(), False, per_step=per_step)
    dev = _run(_mlp(), True, per_step=per_step)
    torch.testing.assert_close(torch.tensor(dev[0]), torch.tensor(host[0]), **TOL)
    _close(dev[1], host[1])
    _close_opt(dev[2], host[2])
    up, down = zip(*dev[3])
    assert up[0] > 0 and down[0] == 0   # weights go up once; no gradient ever comes down
    assert up[1:] == (0,) * (len(up) - 1), dev[3]
    assert all(u > 0 and d > 0 for u, d in host[3]), host[3]


def test_a_lora_shaped_model_uploads_only_once():
    torch.manual_seed(0)
    layers = [Adapted(WIDTH) for _ in range(6)]
    torch.manual_seed(0)
    again = [Adapted(WIDTH) for _ in range(6)]
    host, dev = _run(layers, False), _run(again, True)
    _close(dev[1], host[1])
    assert [t for t in dev[3][1:]] == [(0, 0), (0, 0)], dev[3]
    assert all(d > 0 for _, d in host[3])


def test_clipping_reads_the_device_gradients():
    host = _run(_mlp(), False, max_grad_norm=0.05)
    dev = _run(_mlp(), True, max_grad_norm=0.05)
    _close(dev[1], host[1])
    unclipped = _run(_mlp(), True)
    assert max((dev[1][k] - unclipped[1][k]).abs().max() for k in dev[1]) > 1e-4   # the clip did bite


def test_only_the_resident_layers_are_stepped_on_the_device():
    host = _run(_mlp(), False, resident_layers=2)
    dev = _run(_mlp(), True, resident_layers=2)
    _close(dev[1], host[1])
    up, down = zip(*dev[3])
    assert 0 < down[1] < host[3][1][1] and 0 < up[1] < host[3][1][0], (dev[3], host[3])


def test_synchronize_shows_the_gradients_and_the_next_step_reads_them():
    batches = _batches(2)
    results = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            x, y = batches[0]
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            grads = [p.grad.clone() for p in model.parameters()]
            model.step(opt)
            _train(model, opt, batches[1:])
            results.append((grads, model.state_dict()))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(b, a, **TOL)
    _close(results[1][1], results[0][1])


def test_masters_come_home_at_sync_points_only():
    with _model(_mlp(), True) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        p0 = next(model.parameters())
        before = p0.detach().clone()
        _train(model, opt, _batches(1))
        assert torch.equal(p0.detach(), before)   # a synchronous step is not a sync point for device masters
        assert opt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0   # the optimizer's state_dict brings it home
        model.synchronize()
        assert not torch.equal(p0.detach(), before)


def test_an_edit_after_synchronize_is_trained_from_and_one_before_is_refused():
    batches = _batches(3)
    results = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, opt, batches[:1])
            model.synchronize()
            with torch.no_grad():
                next(model.parameters()).mul_(0.5)
            _train(model, opt, batches[1:])
            results.append(model.state_dict())
    _close(results[1], results[0])
    with _model(_mlp(), True) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, batches[:1])
        with torch.no_grad():
            next(model.parameters()).mul_(0.5)   # stale: the newer master is on the worker
        x, y = batches[1]
        with pytest.raises(ValueError, match="synchronize"):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)


ARMED = threading.Event()   # a module-level flag: the workers' replicas copy a layer's attributes once


class Fails(nn.Module):
    """A linear layer whose backward raises while ARMED is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return _Raise.apply(self.lin(x))


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ARMED.is_set():
            raise RuntimeError("injected backward failure")
        return g


def test_a_failed_call_takes_its_device_gradients_back():
    """Layer 0's backward runs in the last stage: layers 2-5 have landed the failed call's gradients by then."""
    batches = _batches(3)
    results = []
    for fail in (False, True):
        torch.manual_seed(0)
        layers = [Fails()] + list(MODELS["mlp"](5))
        with _model(layers, True) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            x, y = batches[0]
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # accumulated with the next good call
            model.wait_calls()   # its last backward stages ran (they would fail too, armed)
            if fail:
                ARMED.set()
                x, y = batches[2]
                try:
                    with pytest.raises(RuntimeError, match="injected"):
                        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                        model.wait_calls()
                finally:
                    ARMED.clear()
            x, y = batches[1]
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt)
            results.append(model.state_dict())
    _close(results[1], results[0])


@pytest.mark.parametrize("saver,loader", [(True, False), (False, True)])
def test_checkpoints_are_interchangeable_with_the_host_step(tmp_path, saver, loader):
    batches = _batches(4)
    with _model(_mlp(), saver) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, batches[:2])
        x, y = batches[2]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # a gradient pending in the checkpoint
        model.save_checkpoint(tmp_path / "ck", opt)
        model.step(opt)
        _train(model, opt, batches[3:])
        unbroken = model.state_dict()
    with _model(_mlp(), loader) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        model.load_checkpoint(tmp_path / "ck", opt)
        model.step(opt)
        _train(model, opt, batches[3:])
        resumed = model.state_dict()
    _close(resumed, unbroken)


def test_bf16_compute_keeps_fp32_gradients_and_masters_on_the_worker():
    with _model(_mlp(), True, compute_dtype=torch.bfloat16) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, _batches(4))
        stats = model.memory_stats()["workers"]["cpu:0"]
        model.synchronize()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        n = sum(p.numel() for p in model.parameters())
        # masters 4 + moments 8 + weights 2 bytes per parameter, nothing else between steps
        assert stats["device_step_bytes"] == 14 * n, stats
        assert stats["current"]["optimizer"] == 12 * n and stats["current"]["gradients"] == 0, stats
    assert losses[-1] < losses[0]


def test_bad_combinations_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="one worker"):
        rp.RoundPipe(_mlp(), devices=["cpu", "cpu"], device_step=True)
    with pytest.raises(ValueError, match="fp32 masters"):
        rp.RoundPipe(_mlp(), devices=["cpu"], device_step=True, master_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="loss scaling"):
        rp.RoundPipe(_mlp(), devices=["cpu"], device_step=True, compute_dtype=torch.float16)
    with pytest.raises(TypeError, match="device_step"):
        rp.RoundPipe(_mlp(), devices=["cpu"], device_step=1)
    with _model(_mlp(), True) as model:
        x, y = _batches(1)[0]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="asynchronous"):
            model.step(rp.optim.AdamW(model.parameters()), asynchronous=True)
        with pytest.raises(ValueError, match="roundpipe.optim"):
            model.step(torch.optim.AdamW(model.parameters()))
        before = [p.detach().clone() for p in model.parameters()]
        model.step(rp.optim.AdamW(model.parameters(), lr=1e-2))   # the refused steps lost nothing
        model.synchronize()
        assert all(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_a_forward_only_call_reads_the_device_stepped_weights():
    x = torch.randn(5, WIDTH)
    outs = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, opt, _batches(2))
            outs.append(model(x))
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    assert not torch.equal(outs[0], nn.Sequential(*_mlp())(x))   # the steps changed the weights


def test_the_memory_model_counts_what_the_device_step_keeps():
    """Per trained parameter of a device-stepped layer: fp32 moments 8 + two fp32 gradient sums 8, plus an fp32
    master 4 when the compute dtype is not fp32; under a cap the resident prefix is shorter for it."""
    from types import SimpleNamespace

    from roundpipe.engine.device_memory import device_step_bytes
    from roundpipe.engine.step.host_state import HostState
    from roundpipe.planner.memory import LayerMemory, resident_prefix, worker_peaks

    layers = _mlp()
    n = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert device_step_bytes(HostState(layers, torch.float32, pinned=False)) == [16 * k for k in n]
    assert device_step_bytes(HostState(_mlp(), torch.bfloat16, pinned=False)) == [20 * k for k in n]
    tasks = {"w": [SimpleNamespace(kind="F", layers=range(0, 3), mbs=[0]),
                   SimpleNamespace(kind="fused", layers=range(3, 4), mbs=[0]),
                   SimpleNamespace(kind="B", layers=range(0, 3), mbs=[0])]}
    mem, weights, grads, held = [LayerMemory.rough(20)] * 4, [100] * 4, [200] * 4, [400] * 4
    plain = worker_peaks(tasks, weights, grads, mem, False, resident=2)["w"]
    assert worker_peaks(tasks, weights, grads, mem, False, resident=2, held=held)["w"] == plain + 800
    cap = {"w": int(worker_peaks(tasks, weights, grads, mem, False, resident=4)["w"] / 0.85) + 1}
    assert resident_prefix(tasks, weights, grads, mem, False, cap) == 4
    assert resident_prefix(tasks, weights, grads, mem, False, cap, held=held) < 4


@pytest.mark.cuda
def test_on_a_gpu_the_device_step_equals_the_host_step():
    """One CUDA worker (bf16 compute): masters, moments and gradient sums on the GPU, updated on the compute stream
    and bound by the next call; the host step's numbers within bf16's reach (its gradients travel in bf16)."""
    host = _run(_mlp(), False, device="cuda:0", compute_dtype=torch.bfloat16)
    dev = _run(_mlp(), True, device="cuda:0", compute_dtype=torch.bfloat16)
    for k in host[1]:
        torch.testing.assert_close(dev[1][k], host[1][k], rtol=2e-2, atol=2e-3, msg=k)
    assert [t for t in dev[3][1:]] == [(0, 0), (0, 0)], dev[3]


def test_running_out_of_memory_brings_the_device_state_home():
    """A call that runs out of device memory ends residency: the device step's masters, state and gradients come
    home and its layers are stepped on the host from then on, as a model that never stepped on the device."""
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)

    def train(device_step, fail):
        with _model(_mlp(), device_step, device_memory=1_000_000, resident_layers=6 if device_step else 0) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt)
            if fail:
                assert model.memory_stats()["workers"]["cpu:0"]["device_step_layers"] == 6
                model.workers[0].inject_oom("backward")
                with pytest.raises(torch.OutOfMemoryError):
                    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                    model.wait_calls()
            losses = []
            for _ in range(2):
                losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.mse_loss)))
                model.step(opt)
            stats = model.memory_stats()["workers"]["cpu:0"]
            return losses, model.state_dict(), stats.get("device_step_bytes", 0), stats["current"]["optimizer"]
    failed, clean = train(True, True), train(False, False)
    torch.testing.assert_close(torch.tensor(failed[0]), torch.tensor(clean[0]), **TOL)
    _close(failed[1], clean[1])
    assert failed[2:] == (0, 0), failed[2:]


def test_a_checkpoint_with_a_pending_asynchronous_step_loads(tmp_path):
    """Saved by the host step with its asynchronous step pending: a device-step model re-issues it on the host (it
    holds nothing on the device after a load), with its stale window; the masters equal the host step's."""
    batches = _batches(2)
    with _model(_mlp(), False) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=True)
        model.save_checkpoint(tmp_path / "ck", opt)
    loaded = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            model.load_checkpoint(tmp_path / "ck", opt)
            model.synchronize()
            loaded.append(model.state_dict())
    _close(loaded[1], loaded[0])


def test_a_new_optimizer_starts_from_its_own_state_and_the_old_one_keeps_its_own():
    batches = _batches(4)
    results = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            first = rp.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, first, batches[:2])
            second = rp.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
            _train(model, second, batches[2:])
            results.append((model.state_dict(), first.state_dict(), second.state_dict()))
    _close(results[1][0], results[0][0])
    _close_opt(results[1][1], results[0][1])
    _close_opt(results[1][2], results[0][2])


def test_clipping_after_a_sync_point_reads_each_gradient_once(tmp_path):
    """save_checkpoint brings the device gradient sums home into p.grad; the calls after it land theirs on the
    worker again: the clip's norm is that of their sum (found by the soak: it combined the two parts' norms)."""
    batches = _batches(2)
    results = []
    for device_step in (False, True):
        with _model(_mlp(), device_step) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            for i, (x, y) in enumerate(batches):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                if i == 0:
                    model.save_checkpoint(tmp_path / f"ck{device_step}", opt)
            norm = float(model.grad_norm())
            model.step(opt, max_grad_norm=0.05)
            results.append((norm, model.state_dict()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    _close(results[1][1], results[0][1])
