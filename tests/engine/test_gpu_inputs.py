"""Call inputs: a call owns a snapshot of them, so refilling the caller's buffer after it returned changes nothing."""
import copy
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err

import roundpipe as rp
from roundpipe import testing


class InPlaceInput(torch.nn.Module):
    """Layer 0: writes its input in place (data needs no grad, so autograd allows it in a recompute too)."""

    def __init__(self, width=16):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x.mul_(2.0).add_(1.0)))


class Late(torch.nn.Module):
    """Sleeps in its backward: the backward stages of the first layers run well after the call returned."""

    def __init__(self, width=16):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        y = self.fc(x)
        if y.requires_grad:
            y.register_hook(lambda g: time.sleep(0.01))
        return torch.tanh(y)


def layers(width=16):
    return [InPlaceInput(width)] + [Late(width) for _ in range(5)]


PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])


def refill_after_return(devices, device):
    """Max relative gradient error against PyTorch when the caller refills x in place right after the call."""
    torch.manual_seed(0)
    model_layers = layers()
    ref = torch.nn.Sequential(*copy.deepcopy(model_layers)).to(device)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    F.mse_loss(ref(x.clone()), y).backward()
    with rp.RoundPipe(model_layers, devices=devices, num_microbatches=2, plan=PLAN,
                      compute_dtype=torch.float32) as model:
        given = x.clone()
        with testing.inject_delays(testing.random_sleeps(0.002, seed=1)):
            model.forward_backward(given, labels=y, loss_fn=F.mse_loss)
            given.copy_(torch.randn(8, 16, device=device))   # the next batch, while backward stages still run
            refilled = given.clone()
            model.synchronize()
        assert torch.equal(given, refilled), "the call wrote the caller's tensor"
        return max(max_rel_err(p.grad.cpu(), q.grad.cpu()) for p, q in zip(model.parameters(), ref.parameters()))


def test_cpu_call_owns_its_inputs():
    """CPU inputs are staged into the arena on the caller's thread, and each consumer uploads its own copy:
    a refill right after the call and an in-place first layer change no gradient and not the caller's x."""
    assert refill_after_return(["cpu", "cpu"], "cpu") <= 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]])
def test_gpu_call_owns_a_snapshot_of_its_inputs(devices):
    """GPU-resident inputs: the call copies them on the caller's stream and each consumer clones that copy,
    so a refill after the call returned and an in-place first layer change no gradient (before: the last
    backward stage recomputed from the caller's tensor, refilled or written by the forward)."""
    assert refill_after_return(devices, "cuda:0") <= 1e-4


@pytest.mark.cuda
def test_gpu_input_snapshots_die_with_the_call():
    """The snapshot and the consumers' copies are activations in the ledger and none outlives the call."""
    torch.manual_seed(0)
    with rp.RoundPipe(layers(), devices=["cuda:0"], num_microbatches=2, plan=PLAN,
                      compute_dtype=torch.float32) as model:
        x, y = torch.randn(8, 16, device="cuda:0"), torch.randn(8, 16, device="cuda:0")
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.wait_calls()
        stats = model.workers[0].ledger.stats()
        assert stats["peak"]["activations"] >= x.nbytes
        assert sum(stats["current"].values()) == 0, stats
