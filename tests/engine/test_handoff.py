"""Same-device hand-offs: a consumer that writes its input in place changes neither the host copy nor the recompute."""
import copy
import time

import pytest
import torch
import torch.nn.functional as F
from rp_models import InPlaceFirst, max_rel_err

import roundpipe as rp
from roundpipe import testing

PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])


def grads_error(workers, hook):
    torch.manual_seed(0)
    layers = [InPlaceFirst() for _ in range(6)]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    F.mse_loss(ref(x.clone()), y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=2, plan=PLAN) as model:
        with testing.inject_delays(hook):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
        return max(max_rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("workers", [1, 2])
def test_backward_stage_recomputes_from_the_host_copy(workers):
    """A backward stage on the producer's device recomputes from the kept host copy, not from the device
    tensors its forward consumer wrote in place (before: it got those, and gradients were off by ~70%)."""
    assert grads_error(workers, lambda kind: None) <= 1e-5


@pytest.mark.parametrize("workers", [1, 2])
def test_in_place_consumer_never_changes_a_pending_download(workers):
    """The host copy of a stage input is what the producer made even when its download is late and the
    same-device consumer writes its input in place (before: the consumer wrote the storage still being
    downloaded)."""
    assert grads_error(workers, lambda kind: time.sleep(0.01) if kind == "act_down" else None) <= 1e-5
