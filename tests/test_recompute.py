"""Recompute RNG: dropout masks equal the forward's, runs are bitwise reproducible."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from rp_models import Mlp
from roundpipe.engine.recompute import segment_seed
from roundpipe.testing import inject_delays, random_sleeps


def dropout_layers():
    torch.manual_seed(5)
    return [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(3)] + [Mlp(), nn.Dropout(0.3), Mlp()]


PLAN = rp.Plan(forward=[range(0, 3)], backward=[range(3, 6), range(1, 3), range(0, 1)])


def grads_of(layers, workers, seed=0, num_mb=4, per_round=2, delays=False):
    torch.manual_seed(seed)
    model = rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb, plan=PLAN,
                         microbatches_per_round=per_round)
    model._check_recompute = True   # every backward stage compares its recompute with the forward
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with model:
        if delays:
            with inject_delays(random_sleeps(0.002)):
                loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        else:
            loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        model.step(lambda: None)
    return loss, grads


def test_recomputed_masks_equal_forward_masks_and_runs_repeat():
    """Recompute reproduces every dropout mask; two seeded runs give bitwise-equal gradients."""
    layers = dropout_layers()
    loss_a, a = grads_of(layers, workers=3, delays=True)
    loss_b, b = grads_of(layers, workers=3)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(g, h) for g, h in zip(a, b))
    _, c = grads_of(layers, workers=3, seed=1)
    assert not all(torch.equal(g, h) for g, h in zip(a, c))   # the masks really are random


def test_gradients_do_not_depend_on_the_pool_size():
    """With the same rounds, 1 and 4 workers give bitwise-equal gradients (seeds follow the data, not the worker)."""
    layers = dropout_layers()
    _, a = grads_of(layers, workers=1)
    _, b = grads_of(layers, workers=4)
    assert all(torch.equal(g, h) for g, h in zip(a, b))


class Unrestorable(nn.Module):
    """Draws from its own generator, which recompute cannot rewind: the check must notice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.fc(x) * torch.rand(x.shape, generator=self.g)


def test_recompute_check_detects_a_mismatch():
    """The internal recompute check fails loudly for randomness outside the restored generators."""
    layers = [Mlp(), Unrestorable(), Mlp(), Mlp()]
    model = rp.RoundPipe(layers, devices=["cpu"] * 2,
                         plan=rp.Plan(forward=[range(0, 3)], backward=[range(3, 4), range(0, 3)]))
    model._check_recompute = True
    with model, pytest.raises(AssertionError, match="recompute of layers 0-2"):
        model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)


def test_caller_stream_advances_by_one_draw():
    """A call consumes exactly one draw of the caller's generator, whatever the workers did."""
    layers = dropout_layers()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, plan=PLAN) as model:
        x = torch.randn(4, 8)
        torch.manual_seed(7)
        model.forward_backward(x, labels=x, loss_fn=F.mse_loss)
        after = torch.rand(3)
    torch.manual_seed(7)
    torch.randint(0, 2**62, (1,))
    assert torch.equal(after, torch.rand(3))


def test_segment_seeds_differ():
    """Seeds differ between segments and microbatches and fit in 63 bits."""
    seeds = {segment_seed(123, b, m) for b in range(20) for m in range(20)}
    assert len(seeds) == 400 and max(seeds) < 2**63
