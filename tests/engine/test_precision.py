"""The precision policy (roundpipe/engine/calls/precision.py): autocast, inputs keep their dtype, no casts at stage
boundaries."""
import pytest
import torch
import torch.nn.functional as F
from _kernel_util import assert_within_torch_error
from torch import nn

import roundpipe as rp

MIN = torch.finfo(torch.float32).min


class MaskedAttention(nn.Module):
    """Single-head attention over (h, mask); the additive fp32 mask travels with the activations."""

    def __init__(self, width=16):
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, t):
        h, mask = t
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask   # bf16 + fp32 -> fp32
        return h + self.out(torch.softmax(scores, dim=-1) @ v), mask


class Embed(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, mask):
        return self.fc(x), mask


class Head(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(width, 4)

    def forward(self, t):
        return self.fc(t[0]).mean(dim=1)


def attention_model():
    torch.manual_seed(0)
    return [Embed(), MaskedAttention(), MaskedAttention(), Head()]


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 16, generator=g)
    mask = torch.zeros(4, 6, 6)
    mask[:, :, 4:] = MIN          # padding: keys 4, 5 masked for every query
    mask[1, 2, :] = MIN           # one query that sees nothing: a fully masked row
    return x, mask, torch.randint(0, 4, (4,), generator=g)


def plain_pytorch(x, mask, y, autocast: bool):
    """Loss and parameter gradients of the attention model in plain PyTorch, under autocast(bf16) or in fp32."""
    layers = attention_model()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = layers[0](x, mask)
        for layer in layers[1:]:
            h = layer(h)
        loss = F.cross_entropy(h.float(), y)
    loss.backward()
    return loss.detach(), [p.grad for p in nn.Sequential(*layers).parameters()]


def test_an_fp32_mask_stays_fp32_and_bf16_training_matches_plain_autocast():
    """Layers run under autocast(bf16) with the fp32 mask kept: a finite loss and gradients at most ~2x as far from
    fp32 PyTorch as plain PyTorch autocast (before: the mask was cast to bf16, MIN became -inf and the fully
    masked row NaN)."""
    x, mask, y = data()
    loss32, grads32 = plain_pytorch(x, mask, y, autocast=False)
    loss16, grads16 = plain_pytorch(x, mask, y, autocast=True)
    with rp.RoundPipe(attention_model(), devices=["cpu"] * 2, num_microbatches=2,
                      precision=rp.Precision(torch.bfloat16)) as model:
        loss = model.forward_backward(x, mask, labels=y, loss_fn=F.cross_entropy)
        model.synchronize()
        assert torch.isfinite(loss)
        assert_within_torch_error("loss", loss.detach(), loss16, loss32, atol=1e-4)   # one draw: its ratio is noise
        # A gradient travels home in bf16 (the precision policy): one rounding more than autocast's fp32
        # parameter gradient, at most half a bf16 ulp of its largest element (2^-9 of it).  Measured (seeded):
        # at most 1.7x autocast's error without that allowance.
        for i, (p, g16, g32) in enumerate(zip(model.parameters(), grads16, grads32)):
            assert_within_torch_error(f"grad {i}", p.grad, g16, g32, atol=2.0 ** -9 * g32.abs().max().item())
    with rp.RoundPipe(attention_model(), devices=["cpu"] * 2, num_microbatches=2,
                      precision=rp.Precision(torch.bfloat16, cast_inputs=True)) as model:
        assert torch.isnan(model.forward_backward(x, mask, labels=y, loss_fn=F.cross_entropy))   # the old cast


class Probe(nn.Module):
    """Records the dtype of its input; returns an fp32 tensor (what autocast leaves in fp32, e.g. a norm)."""

    seen: list = []

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        Probe.seen.append(x.dtype)
        return self.fc(x).float() * 1.5


def test_activations_keep_their_dtype_at_stage_boundaries_so_results_do_not_depend_on_the_plan():
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    results = []
    for plan in (rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)]),
                 rp.Plan(forward=[range(0, 1), range(1, 3)], backward=[range(3, 4), range(1, 3), range(0, 1)])):
        Probe.seen = []
        torch.manual_seed(0)
        layers = [Probe() for _ in range(4)]
        with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16, plan=plan) as model:
            loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.synchronize()
            results.append((loss, [p.grad.clone() for p in model.parameters()]))
        assert set(Probe.seen) == {torch.float32}   # the call input and every activation stay fp32
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_a_layer_norm_first_layer_on_cpu_needs_cast_inputs_and_the_error_says_so():
    torch.manual_seed(0)
    layers = [nn.LayerNorm(8), nn.Linear(8, 8)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
        with pytest.raises(RuntimeError, match="dtype") as info:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        assert any("cast_inputs=True" in n for n in getattr(info.value, "__notes__", []))
    with rp.RoundPipe(layers, devices=["cpu"] * 2,
                      precision=rp.Precision(torch.bfloat16, cast_inputs=True)) as model:
        assert torch.isfinite(model.forward_backward(x, labels=y, loss_fn=F.mse_loss))


def test_policy_arguments_are_checked():
    layers = [nn.Linear(4, 4)]
    with pytest.raises(ValueError, match="compute_dtype=torch.int8"):
        rp.Precision(torch.int8)
    with pytest.raises(TypeError, match="cast_inputs must be True or False"):
        rp.Precision(torch.bfloat16, cast_inputs="yes")
    with pytest.raises(TypeError, match="precision must be a roundpipe.Precision"):
        rp.RoundPipe(layers, devices=["cpu"], precision=torch.bfloat16)
    with pytest.raises(ValueError, match="disagree"):
        rp.RoundPipe(layers, devices=["cpu"], compute_dtype=torch.float16, precision=rp.Precision(torch.bfloat16))
    with rp.RoundPipe(layers, devices=["cpu"], compute_dtype=torch.bfloat16,
                      precision=rp.Precision(cast_inputs=True)) as model:
        assert model.precision == rp.Precision(torch.bfloat16, cast_inputs=True)
        assert model.compute_dtype == torch.bfloat16 and model.loss_scale is None
