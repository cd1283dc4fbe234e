"""Gradient passes: sum of squares with inf/NaN detection, norms, clipping factor, accumulation."""
from __future__ import annotations

import math

import pytest
import torch

from roundpipe import _native
from roundpipe.optim import accumulate_, clip_coef, grad_norm, grad_sumsq

native = pytest.mark.skipif(not _native.available(), reason="native core unavailable")
LEVELS = _native.supported_simd_levels()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def grads(dtype, sizes=(1, 7, 1023, 1_000_003, 33)):
    return [torch.randn(n).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sumsq_matches_float64_reference(dtype):
    """The sum of squares equals torch's float64 sum to 1e-12 relative."""
    gs = grads(dtype)
    ref = sum(float(g.double().square().sum()) for g in gs)
    assert grad_sumsq(gs) == pytest.approx(ref, rel=1e-12)


@native
@pytest.mark.parametrize("dtype", DTYPES)
def test_sumsq_identical_across_simd_levels(dtype, restore_level):
    """Every SIMD level returns the same double, bit for bit."""
    gs = grads(dtype) + [torch.randn(1 + i % 50).to(dtype) for i in range(200)]
    values = set()
    for level in LEVELS:
        _native.set_simd_level(level)
        values.add(grad_sumsq(gs))
    assert len(values) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 1022, 1_000_002])
def test_nonfinite_element_is_detected(dtype, bad, where):
    """One inf or NaN anywhere (vector body or tail) makes the norm non-finite and finite=False."""
    gs = [torch.randn(1023).to(dtype), torch.randn(1_000_003).to(dtype)]
    target = gs[0] if where < 1023 else gs[1]
    target[where] = bad
    assert not math.isfinite(grad_sumsq(gs))
    norm, finite = grad_norm(gs, grad_scale=1024.0)
    assert not finite and norm == math.inf


def test_large_finite_values_do_not_look_infinite():
    """Squares beyond the fp32 range are summed in double, so finite bf16 gradients stay finite."""
    g = torch.full((100,), 3e38).to(torch.bfloat16)
    norm, finite = grad_norm([g], grad_scale=2.0)
    assert finite and norm == pytest.approx(math.sqrt(100) * float(g[0]) / 2.0, rel=1e-12)


def test_norm_unscales_and_clip_coef_follows_torch():
    """grad_norm divides by the loss scale; clip_coef is clip_grad_norm_'s factor."""
    gs = [torch.randn(1000), torch.randn(10)]
    scaled = [g * 256.0 for g in gs]
    norm, finite = grad_norm(scaled, grad_scale=256.0)
    ref = float(torch.cat(gs).double().norm())
    assert finite and norm == pytest.approx(ref, rel=1e-12)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    coef = clip_coef(norm, 0.5)
    for p, g in zip(params, gs):
        torch.testing.assert_close(p.grad, g * coef)
    assert clip_coef(0.1, 1.0) == 1.0
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_coef(1.0, 0)
    with pytest.raises(ValueError, match="grad_scale=0"):
        grad_norm(gs, grad_scale=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1023, 1_000_003])
def test_accumulate_equals_torch_add(dtype, n, restore_level):
    """dst += src equals torch's float32 add of the upcast source at every level."""
    src = torch.randn(n).to(dtype)
    base = torch.randn(n)
    want = base + src.float()
    for level in LEVELS or ["none"]:
        if level != "none":
            _native.set_simd_level(level)
        dst = base.clone()
        assert accumulate_(dst, src) is dst
        assert torch.equal(dst, want)


def test_accumulate_rejects_bad_inputs():
    """Wrong dtype, size mismatch and partial overlap raise ValueError naming the argument."""
    with pytest.raises(ValueError, match="dst has dtype bfloat16"):
        accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(ValueError, match="dst has 4 elements but src has 5"):
        accumulate_(torch.zeros(4), torch.zeros(5))
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="overlap"):
        accumulate_(buf[:8], buf[4:12])
    with pytest.raises(ValueError, match="src must be contiguous"):
        accumulate_(torch.zeros(4), torch.zeros(8)[::2])
    same = torch.ones(8)
    assert torch.equal(accumulate_(same, same), torch.full((8,), 2.0))


def test_fallback_without_native_core(monkeypatch):
    """Without the extension, grad_sumsq and accumulate_ give the same values through torch."""
    gs = grads(torch.bfloat16, sizes=(7, 1023))
    native_sum = grad_sumsq(gs)
    dst, src = torch.randn(1023), torch.randn(1023).to(torch.float16)
    want = dst + src.float()
    monkeypatch.setattr(_native, "lib", None)
    assert grad_sumsq(gs) == pytest.approx(native_sum, rel=1e-12)
    assert torch.equal(accumulate_(dst, src), want)
    with pytest.raises(ValueError, match="overlap"):
        accumulate_(dst[:8], dst[4:12])
