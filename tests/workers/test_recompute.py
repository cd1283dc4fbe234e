"""Recompute RNG: dropout masks equal the forward's, runs are bitwise reproducible."""
import pytest
import torch
import torch.nn.functional as F
from rp_models import Mlp
from torch import nn

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps
from roundpipe.workers.rng import layer_seed


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
        model.step(lambda: None, asynchronous=True)
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
        model.wait_calls()   # the recompute runs in the call's last stage, maybe after it returned


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
    seeds = {layer_seed(123, b, m) for b in range(20) for m in range(20)}
    assert len(seeds) == 400 and max(seeds) < 2**63


def test_dropout_does_not_depend_on_the_plan():
    """Each layer draws from its own seed (call, layer, microbatch), so two different plans give bitwise-equal
    losses and gradients (before: seeds followed the stage boundaries, and a re-plan changed every mask)."""
    layers = dropout_layers()
    other = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(2, 4), range(0, 2)])

    def run(plan):
        torch.manual_seed(3)
        with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=4, plan=plan) as model:
            model._check_recompute = True
            x, y = torch.randn(8, 8), torch.randn(8, 8)
            loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            grads = [p.grad.clone() for p in model.parameters()]
            model.step(lambda: None, asynchronous=True)
        return loss, grads

    loss_a, a = run(PLAN)
    loss_b, b = run(other)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(g, h) for g, h in zip(a, b))


class RandomEverywhere(nn.Module):
    """Randomness through several doors: functional dropout, torch.rand, an in-place draw, channel dropout and
    attention dropout (no generator argument: runs on the default generator with the worker's state)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = F.dropout(self.fc(x), 0.3, training=True)
        h = h + 0.1 * torch.rand(h.shape) + 0.1 * torch.empty_like(h).normal_()
        h = F.dropout1d(h.unsqueeze(-1), 0.2, training=True).squeeze(-1)
        q = h.view(h.shape[0], 1, 2, 4)
        return h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.25).reshape(h.shape)


def test_every_kind_of_draw_is_recomputed_exactly_and_repeats():
    layers = [Mlp(), RandomEverywhere(), RandomEverywhere(), Mlp()]
    plan = rp.Plan(forward=[range(0, 3)], backward=[range(3, 4), range(1, 3), range(0, 1)])

    def run(seed):
        torch.manual_seed(seed)
        with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=3, plan=plan) as model:
            model._check_recompute = True   # asserts recompute == forward, per stage and microbatch
            loss = model.forward_backward(torch.randn(6, 8), labels=torch.randn(6, 8), loss_fn=F.mse_loss)
            model.synchronize()
            grads = [p.grad.clone() for p in model.parameters()]
            model.step(lambda: None, asynchronous=True)
        return loss, grads

    (la, a), (lb, b), (lc, _) = run(0), run(0), run(1)
    assert torch.equal(la, lb) and all(torch.equal(g, h) for g, h in zip(a, b))
    assert not torch.equal(la, lc)


class SlowDropout(nn.Module):
    """A long forward (it sleeps at least LONG_COMPUTE_S, releasing the GIL) that draws, inside `meeting`."""

    meeting = None

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        import time
        with SlowDropout.meeting:
            time.sleep(0.005)
            return F.dropout(self.fc(x), 0.5, training=True)


def test_workers_draw_random_numbers_side_by_side():
    """Forwards with dropout on two CPU workers overlap: the workers meet inside them, as each draws from its
    own generator (before: one lock around every forward segment on the shared CPU generator serialised them,
    so a worker waiting inside for the other would wait in vain)."""
    from test_workers import Meeting

    layers = [SlowDropout() for _ in range(4)]
    plan = rp.Plan(forward=[range(0, 2), range(2, 3)], backward=[range(3, 4), range(2, 3), range(0, 2)])
    SlowDropout.meeting = Meeting()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=plan) as model:
        for _ in range(2):
            model.forward_backward(torch.randn(6, 8), labels=torch.randn(6, 8), loss_fn=F.mse_loss)
        model.synchronize()
    assert len(SlowDropout.meeting.seen) == 2
    assert SlowDropout.meeting.met, "the two workers never drew random numbers at the same time"


def test_a_pool_of_mixed_gpu_models_refuses_random_draws(monkeypatch):
    """Two GPU models in one pool (their random kernels' grids differ with the SM count): the reason names the
    devices and the fix, and a layer drawing dropout on such a worker raises it as a ValueError, while eval-mode
    dropout and layers without randomness run; one model, or CPUs only, refuse nothing."""
    from roundpipe.workers import rng as recompute
    props = {0: ("NVIDIA H100 80GB HBM3", 132, 2048), 1: ("NVIDIA A100-SXM4-40GB", 108, 2048),
             2: ("NVIDIA H100 80GB HBM3", 132, 2048)}
    monkeypatch.setattr(recompute, "device_model", lambda d: props[d.index])
    cuda = [torch.device("cuda", i) for i in range(3)]
    reason = recompute.mixed_models(cuda[:2])
    assert reason is not None and "cuda:0: NVIDIA H100" in reason and "cuda:1: NVIDIA A100" in reason
    assert "one model" in reason
    assert recompute.mixed_models([cuda[0], cuda[2]]) is None
    assert recompute.mixed_models([torch.device("cpu")] * 2) is None

    layers = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(3)]
    with rp.RoundPipe(layers, devices=["cpu", "cpu"], num_microbatches=2) as model:
        for w in model.workers:   # what make_workers does for a mixed CUDA pool
            w.rng.refuse = reason
        with pytest.raises(ValueError, match=r"mix GPU models \(cuda:0: NVIDIA H100"):
            model.forward_backward(torch.randn(4, 8), labels=torch.randn(4, 8), loss_fn=F.mse_loss)
        model.eval()
        model(torch.randn(4, 8))   # eval-mode dropout draws nothing
    rng = recompute.WorkerRng(torch.device("cpu"))
    rng.refuse = reason
    with rng.stream():
        torch.tanh(torch.randn(2, generator=torch.Generator()))   # a generator of the layer's own: not routed
        with pytest.raises(ValueError, match="mix GPU models"):
            torch.rand(3)


def test_each_route_of_the_worker_mode_draws_from_the_worker_state():
    """Under WorkerRng.stream() every kind of draw comes from the worker's generator, seeded as given: a function
    with generator= (passed one), dropout (a Bernoulli mask from it), a function without one (the default
    generator with the worker's state swapped in) and attention with dropout; non-random calls and attention
    without dropout run as they are, and the caller's default generator does not move."""
    from roundpipe.workers.rng import WorkerRng
    rng = WorkerRng(torch.device("cpu"))
    x = torch.ones(64, 8)
    q = torch.randn(2, 1, 4, 8)
    torch.manual_seed(11)
    before = torch.get_rng_state()

    def draws():
        return [torch.rand(5), F.dropout(x, 0.5, training=True), F.alpha_dropout(x, 0.5, training=True),
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), F.scaled_dot_product_attention(q, q, q),
                torch.tanh(x)]
    rng.reseed(5)
    with rng.stream():
        got = draws()
    assert torch.equal(torch.get_rng_state(), before)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(got[0], torch.rand(5, generator=g))
    assert torch.equal(got[1], x * torch.empty_like(x).bernoulli_(0.5, generator=g).div_(0.5))
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(g.get_state())
        assert torch.equal(got[2], F.alpha_dropout(x, 0.5, training=True))
        assert torch.equal(got[3], F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    assert torch.equal(got[4], F.scaled_dot_product_attention(q, q, q)) and torch.equal(got[5], torch.tanh(x))
