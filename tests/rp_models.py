"""Small models for the engine tests: low arithmetic density so that races show as wrong numbers."""
import copy
import random
import time

import torch
from torch import nn


class Mlp(nn.Sequential):
    def __init__(self, width=8):
        super().__init__(nn.Linear(width, width), nn.Tanh())


class ResidualLN(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class ToTuple(nn.Module):
    """Layer 0: takes (x, scale=...) and returns a tuple holding a non-tensor and a non-float leaf."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        return (self.fc(x) * scale, torch.arange(x.shape[0]), "tag")


class TupleToDict(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, t):
        h, ids, tag = t
        assert tag == "tag" and ids.dtype == torch.int64
        return {"h": torch.tanh(self.a(h)), "g": self.b(h), "ids": ids}


class DictToTensor(nn.Module):
    def forward(self, d):
        return d["h"] * torch.sigmoid(d["g"])


class RunningMean(nn.Module):
    """A buffer updated in every train-mode forward; the output does not depend on batch statistics."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
            self.calls += 1
        return torch.tanh(self.fc(x))


class InPlaceFirst(nn.Module):
    """Its first op writes the stage input in place whenever autograd allows it (forward stages run
    under no_grad), like ReLU(inplace=True) or `x += b` at the top of a block; out of place in a recompute."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        x = x.mul_(2.0).add_(1.0) if not x.requires_grad else x * 2.0 + 1.0
        return torch.tanh(self.fc(x))


class Slow(nn.Module):
    """Wraps a layer and sleeps a random time first, to shake up the schedule."""

    def __init__(self, inner, max_s=0.002):
        super().__init__()
        self.inner, self.max_s = inner, max_s

    def forward(self, *a, **k):
        time.sleep(random.random() * self.max_s)
        return self.inner(*a, **k)


def mlp(n=6, width=8):
    return [Mlp(width) for _ in range(n)]


def residual(n=6, width=8):
    return [nn.Linear(width, width)] + [ResidualLN(width) for _ in range(n - 1)]


def nested(width=8):
    return [ToTuple(width), TupleToDict(width), DictToTensor(), Mlp(width), Mlp(width)]


def buffered(width=8):
    return [Mlp(width), RunningMean(width), Mlp(width), RunningMean(width), Mlp(width)]


MODELS = {"mlp": mlp, "residual": residual, "nested": nested, "buffered": buffered}


def reference(layers):
    """A plain-PyTorch copy with identical weights."""
    return nn.Sequential(*copy.deepcopy(layers))


def max_rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def sync_steps_match(model, opt, ref, ref_opt, batches, loss_fn=None, tol=1e-5):
    """Trains `model` with synchronous steps and `ref` (plain PyTorch) on the same batches; every
    loss must agree within `tol` (relative)."""
    import torch.nn.functional as F

    loss_fn = loss_fn or F.mse_loss
    for x, y in batches:
        loss = model.forward_backward(x, labels=y, loss_fn=loss_fn)
        model.step(opt, asynchronous=False)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert max_rel_err(loss, ref_loss.detach()) <= tol


def ref_forward(seq, x, **kw):
    """The plain-PyTorch forward of `reference(layers)`: layer 0 gets the call's kwargs, each later one the output."""
    h = seq[0](x, **kw)
    for layer in seq[1:]:
        h = layer(h)
    return h


def assert_grads_equal(model, ref, tol):
    """Every parameter of model has a gradient within tol (max_rel_err) of ref's, parameter for parameter."""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        assert max_rel_err(p.grad, q.grad) <= tol, (name, max_rel_err(p.grad, q.grad))


class Adapted(nn.Module):
    """A frozen base linear plus a small trained adapter (LoRA's shape of training)."""

    def __init__(self, width=16, rank=2):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))
