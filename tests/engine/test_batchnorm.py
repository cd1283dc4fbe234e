"""BatchNorm running statistics: per microbatch (default) or once per call from the whole batch
(RoundPipe(batchnorm="whole-batch"), roundpipe/engine/calls/batchnorm.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp


def bn_layers(dims, momentum=0.1):
    """Three layers, two with a BatchNorm of `dims` spatial dimensions (0: BatchNorm1d on [B, C])."""
    torch.manual_seed(0)
    if dims == 0:
        conv = lambda: nn.Linear(4, 4)
        bn = lambda: nn.BatchNorm1d(4, momentum=momentum)
    else:
        Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        Bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        conv = lambda: Conv(4, 4, 3, padding=1)
        bn = lambda: Bn(4, momentum=momentum)
    return [nn.Sequential(conv(), bn(), nn.Tanh()), nn.Sequential(conv(), bn(), nn.Tanh()), conv()]


def batches(dims, n=5, batch=10):
    g = torch.Generator().manual_seed(1)
    shape = (batch, 4) + (5,) * dims
    return [(torch.randn(*shape, generator=g) * 2 + 1, torch.randn(*shape, generator=g)) for _ in range(n)]


class WholeBatchReference:
    """Plain PyTorch: each microbatch forward and backward as the engine runs it (normalised with its
    own statistics, gradients accumulated with the sample weights), and one running-statistics update
    per batch made by an nn.BatchNorm twin on the concatenation of the inputs its BatchNorm saw."""

    def __init__(self, layers, num_mb, lr):
        self.net = nn.Sequential(*copy.deepcopy(layers))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr)
        self.num_mb = num_mb
        self.bns = [m for m in self.net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.seen = {id(m): [] for m in self.bns}
        for m in self.bns:
            m.register_forward_pre_hook(lambda mod, args: self.seen[id(mod)].append(args[0].detach()))

    def step(self, x, y):
        saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in self.bns]
        for xm, ym in zip(x.tensor_split(self.num_mb), y.tensor_split(self.num_mb)):
            (F.mse_loss(self.net(xm), ym) * (len(xm) / len(x))).backward()
        for m, (rm, rv, nbt) in zip(self.bns, saved):
            twin = copy.deepcopy(m).train()
            twin._forward_pre_hooks.clear()   # the twin's input is not one the engine's BatchNorm saw
            with torch.no_grad():
                twin.running_mean.copy_(rm)
                twin.running_var.copy_(rv)
                twin.num_batches_tracked.copy_(nbt)
                twin(torch.cat(self.seen[id(m)]))
                m.running_mean.copy_(twin.running_mean)
                m.running_var.copy_(twin.running_var)
                m.num_batches_tracked.copy_(twin.num_batches_tracked)
            self.seen[id(m)].clear()
        self.opt.step()
        self.opt.zero_grad()


@pytest.mark.parametrize("dims", [0, 1, 2, 3])
@pytest.mark.parametrize("num_mb", [1, 2, 3, 5])
def test_whole_batch_statistics_are_one_update_from_the_whole_batch(dims, num_mb):
    """After 3 synchronous steps the running statistics (and the training) equal plain PyTorch run
    microbatch by microbatch with one BatchNorm update per batch from all its inputs."""
    layers = bn_layers(dims)
    ref = WholeBatchReference(layers, num_mb, lr=0.05)
    data = batches(dims, n=3)   # three running-statistics updates, each starting from the one before
    workers = 1 + num_mb % 3
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb, batchnorm="whole-batch") as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
            ref.step(x, y)
        model.synchronize()
        for (name, b), c in zip(nn.Sequential(*layers).named_buffers(), ref.net.buffers()):
            if b.is_floating_point():
                torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
            else:
                assert int(b) == int(c) == len(data), name   # once per call; recomputes not counted
        for layer in layers:
            layer.eval()
        ref.net.eval()
        torch.testing.assert_close(model(data[0][0]), ref.net(data[0][0]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_mb", [1, 2, 4, 5])
def test_first_batchnorm_equals_pytorch_on_the_full_batch(num_mb):
    """A BatchNorm fed by no other BatchNorm sees the batch's own values: its statistics after 5 calls
    equal plain PyTorch's full-batch forward (rel 1e-5), whatever the microbatch count."""
    layers = bn_layers(2)
    ref = nn.Sequential(*copy.deepcopy(layers))
    data = batches(2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=num_mb, batchnorm="whole-batch") as model:
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            with torch.no_grad():
                ref(x)
        model.synchronize()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layers[0][1], name), getattr(ref[0][1], name), rtol=1e-5, atol=1e-6)


def test_cumulative_average_when_momentum_is_none():
    """momentum=None: the running statistics are the cumulative average over calls, as in PyTorch."""
    layers = bn_layers(2, momentum=None)
    ref = nn.Sequential(*copy.deepcopy(layers))
    data = batches(2, n=3)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, batchnorm="whole-batch") as model:
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            ref(x)
        model.synchronize()
    for b, c in zip(layers[0][1].buffers(), ref[0][1].buffers()):   # fed by no other BatchNorm
        torch.testing.assert_close(b.float(), c.float(), rtol=1e-5, atol=1e-6)
    assert int(layers[1][1].num_batches_tracked) == 3


def test_default_updates_once_per_microbatch_and_async_whole_batch_counts_calls():
    layers = bn_layers(2)
    data = batches(2, n=2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        for x, y in data:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
    assert int(layers[0][1].num_batches_tracked) == 6   # 2 calls x 3 microbatches, recomputes not counted
    layers = bn_layers(2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, batchnorm="whole-batch") as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            for x, y in data:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # calls overlap (continuous pipeline)
                model.step(opt, asynchronous=True)
        model.synchronize()
    assert int(layers[0][1].num_batches_tracked) == int(layers[1][1].num_batches_tracked) == 6


def test_bad_batchnorm_mode_is_named():
    with pytest.raises(ValueError, match="batchnorm='deferred'"):
        rp.RoundPipe(bn_layers(0), devices=["cpu"], batchnorm="deferred")


@pytest.mark.parametrize("mode", ["per-microbatch", "whole-batch"])
def test_uploads_of_written_buffers_are_ordered_after_their_writes(mode):
    """Under the strict device model with every weight upload late, a stage's upload of running statistics never
    reads them while a landing or a call's end writes them (before: CopyRaceError in most runs, a backward
    stage's upload beside its round's forward landing, or a later call's beside the whole-batch update)."""
    from roundpipe.workers import strict

    layers = bn_layers(2)
    with strict.model(strict.DeviceModel(seed=3, max_delay_s=0.05, prob=1.0)):
        with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, batchnorm=mode) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in batches(2, n=6):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=True)
            model.synchronize()
    assert int(layers[0][1].num_batches_tracked) == (6 if mode == "whole-batch" else 18)
