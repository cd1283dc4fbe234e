"""Weights shared between layers (tied embeddings) and loss_reduction="sum" in plain rp.RoundPipe."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.testing import inject_delays, random_sleeps

V, H = 24, 16


class TiedHead(nn.Module):
    """Logits through the embedding's weight (the same Parameter)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h):
        return h @ self.weight.t()


def tied_layers(seed=0):
    """Embedding and head share a weight; layers 1 and 3 share a Linear; layer 2 has its own."""
    torch.manual_seed(seed)
    emb = nn.Embedding(V, H)
    shared = nn.Linear(H, H)
    return [emb, nn.Sequential(shared, nn.Tanh()), nn.Sequential(nn.Linear(H, H), nn.Tanh()),
            nn.Sequential(shared, nn.Tanh()), TiedHead(emb)]


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def data(step, b=6, t=5):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, V, (b, t), generator=g)
    return x, (x * 3 + 1) % V


def plain(layers, x, y):
    h = x
    for layer in layers:
        h = layer(h)
    return lm_loss(h, y)


PLANS = [None, rp.Plan(forward=[], backward=[range(0, 5)]),
         rp.Plan(forward=[range(0, 2), range(2, 3)], backward=[range(3, 5), range(1, 3), range(0, 1)])]


@pytest.mark.parametrize("plan", PLANS, ids=["default", "one_stage", "three_stages"])
@pytest.mark.parametrize("workers", [1, 3])
def test_shared_weights_get_the_summed_gradient(plan, workers):
    """A weight used by several layers is one master whose gradient sums every use, whatever the plan."""
    layers = tied_layers()
    ref = copy.deepcopy(nn.Sequential(*layers))
    x, y = data(0)
    plain(list(ref), x, y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=3, plan=plan) as model:
        params = list(model.parameters())
        assert len(params) == len({id(p) for p in params}) == 5   # embedding, shared w + b, own w + b: once each
        model.forward_backward(x, labels=y, loss_fn=lm_loss)
        model.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert model.memory_stats()["host"]["masters"] == sum(p.nbytes for p in params)


@pytest.mark.parametrize("optim", ["torch", "rp"])
def test_shared_weights_synchronous_steps_equal_pytorch(optim):
    """Synchronous steps update a shared master once per step, as PyTorch does."""
    layers = tied_layers()
    ref = copy.deepcopy(nn.Sequential(*layers))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3) as model:
        opt = (torch.optim.AdamW if optim == "torch" else rp.optim.AdamW)(model.parameters(), lr=1e-2)
        for step in range(6):
            x, y = data(step)
            loss = model.forward_backward(x, labels=y, loss_fn=lm_loss)
            model.step(opt, asynchronous=False, max_grad_norm=0.5)
            ref_loss = plain(list(ref), x, y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt_ref.step()
            opt_ref.zero_grad()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_shared_weights_asynchronous_steps_one_step_stale_under_delays():
    """Asynchronous steps with shared weights and random delays: call t reads W_(t-1), nothing torn."""
    layers = tied_layers()
    ref = copy.deepcopy(nn.Sequential(*layers))
    stale = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with rp.RoundPipe(layers, devices=["cpu"] * 3, num_microbatches=4) as model, \
            inject_delays(random_sleeps(0.002, seed=3)):
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(6):
            x, y = data(step)
            loss = model.forward_backward(x, labels=y, loss_fn=lm_loss)
            model.step(opt, asynchronous=True)
            ref_loss = plain(list(stale), x, y)
            ref_loss.backward()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item(), step
            before = copy.deepcopy(ref)
            for p, q in zip(ref.parameters(), stale.parameters()):
                p.grad = q.grad
            opt_ref.step()
            opt_ref.zero_grad()
            stale = before if step > 0 else copy.deepcopy(stale)
            stale.zero_grad()
        model.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_shared_weights_low_precision_gradients_sum():
    """With bf16 compute, both uses' gradients reach the one master (held bf16 sums turn fp32)."""
    layers = tied_layers()
    ref = copy.deepcopy(nn.Sequential(*layers))
    x, y = data(0)
    plain(list(ref), x, y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2, compute_dtype=torch.bfloat16) as model:
        model.forward_backward(x, labels=y, loss_fn=lm_loss)
        model.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float32
            assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() < 0.05, name


def test_loss_reduction_sum_adds_microbatch_losses():
    """loss_reduction="sum": the loss is the plain sum of loss_fn's values, token-weighted losses become exact."""
    torch.manual_seed(0)
    layers = [nn.Embedding(V, H), nn.Linear(H, V)]
    ref = copy.deepcopy(nn.Sequential(*layers))
    x, y = data(0)
    y[1:, 2:] = -100   # microbatches with very different numbers of counted tokens
    n = (y != -100).sum().item()

    def token_loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    with rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, loss_reduction="sum") as model:
        loss = model.forward_backward(x, labels=y, loss_fn=token_loss)
        model.synchronize()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        rp.RoundPipe([nn.Linear(2, 2)], devices=["cpu"], loss_reduction="avg")
