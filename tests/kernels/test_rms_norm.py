"""RMSNorm (+ fused residual) kernels against the fp32 reference, values and gradients."""
import pytest
import torch
from _kernel_util import LOW_PRECISION, assert_launched, assert_within_torch_error, leaf, spy_launches

from roundpipe.kernels import RMSNorm, rms_norm
from roundpipe.kernels.rms_norm import rms_norm_ref

SHAPES = [(1, 123), (7, 3000), (2, 5, 64)]
KERNELS = ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel")


def _hf_style(x, w, eps, residual=None):
    """What eager PyTorch model code does in low precision (HF Llama/Qwen RMSNorm)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_fp32_matches_reference(monkeypatch, shape, with_residual):
    """fp32 outputs and x/weight/residual gradients match the autograd of the reference tightly."""
    launched = spy_launches(monkeypatch)
    x, r, w = torch.randn(shape), torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1])
    dy, ds = torch.randn(shape), torch.randn(shape)
    ins, ref_ins = [leaf(x), leaf(w), leaf(r)], [leaf(x), leaf(w), leaf(r)]
    outs = rms_norm(ins[0], ins[1], 1e-6, ins[2] if with_residual else None)
    refs = rms_norm_ref(ref_ins[0], ref_ins[1], 1e-6, ref_ins[2] if with_residual else None)
    outs, refs = (outs, refs) if with_residual else ((outs,), (refs,))
    for o, e in zip(outs, refs):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    seeds = (dy, ds)[:len(outs)]
    torch.autograd.backward(outs, seeds)
    torch.autograd.backward(refs, seeds)
    for a, b in zip(ins[:3 if with_residual else 2], ref_ins):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    assert_launched(launched, *KERNELS)


def _check_against_reference(shape, dtype, device="cpu"):
    """Outputs and x/weight/residual gradients of the fused form against the fp32 reference's autograd: fp16/bf16
    at most ~2x as far from it as eager PyTorch in that dtype (+ atol 1e-3), fp32 within 1e-5 / 1e-4."""
    x, r = torch.randn(shape, device=device), torch.randn(shape, device=device)
    w = 1 + 0.1 * torch.randn(shape[-1], device=device)
    dy, ds = torch.randn(shape, device=device), torch.randn(shape, device=device)
    ref_ins = [leaf(x), leaf(w), leaf(r)]
    y_ref, s_ref = rms_norm_ref(*ref_ins[:2], 1e-6, ref_ins[2])
    torch.autograd.backward([y_ref, s_ref], [dy, ds])
    refs = [y_ref, s_ref, ref_ins[0].grad, ref_ins[1].grad, ref_ins[2].grad]
    results = {}
    for name, fn in (("ours", rms_norm), ("torch", _hf_style)):
        ins = [leaf(x, dtype), leaf(w, dtype), leaf(r, dtype)]
        y, s = fn(ins[0], ins[1], 1e-6, ins[2])
        torch.autograd.backward([y, s], [dy.to(dtype), ds.to(dtype)])
        results[name] = [y, s] + [t.grad for t in ins]
    for i, label in enumerate(["y", "x+residual", "dx", "dweight", "dresidual"]):
        if dtype == torch.float32:
            tol = 1e-5 if i < 2 else 1e-4
            torch.testing.assert_close(results["ours"][i], refs[i], rtol=tol, atol=tol, msg=label)
        else:
            assert_within_torch_error(f"{dtype} {label}", results["ours"][i].float(), results["torch"][i].float(),
                                      refs[i], atol=1e-3)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", [(5, 123), (3, 3000)])
def test_low_precision_within_twice_torch_error(monkeypatch, dtype, shape):
    """fp16/bf16 outputs and gradients are at most ~2x as far from fp32 as eager PyTorch."""
    launched = spy_launches(monkeypatch)
    _check_against_reference(shape, dtype)
    assert_launched(launched, *KERNELS)


@pytest.mark.parametrize("layout", ["every-other", "column", "expanded"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_strided_weight(monkeypatch, layout, with_residual):
    """A weight that is not unit-stride (a slice, a matrix column, an expanded scalar) is read with its stride."""
    launched = spy_launches(monkeypatch)
    n, h = 5, 123
    x, r, dy = torch.randn(n, h), torch.randn(n, h), torch.randn(n, h)
    base = {"every-other": lambda: torch.randn(2 * h)[::2], "column": lambda: torch.randn(h, 3)[:, 1],
            "expanded": lambda: torch.randn(1).expand(h)}[layout]()
    w = base.detach().requires_grad_(True)
    assert w.stride(0) != 1
    w_ref = base.detach().contiguous().requires_grad_(True)
    xs, x_ref = leaf(x), leaf(x)
    out = rms_norm(xs, w, 1e-6, r if with_residual else None)
    ref = rms_norm_ref(x_ref, w_ref, 1e-6, r if with_residual else None)
    out, ref = (out[0], ref[0]) if with_residual else (out, ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(xs.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-4)
    assert_launched(launched, *KERNELS)


def test_module_and_empty_batch(monkeypatch):
    """The module forwards to rms_norm, and zero rows give an empty output and a zero weight grad."""
    launched = spy_launches(monkeypatch)
    norm = RMSNorm(123)
    x = torch.randn(0, 123, requires_grad=True)
    y = norm(x)
    y.sum().backward()
    assert y.shape == (0, 123) and torch.equal(norm.weight.grad, torch.zeros(123))
    x = torch.randn(4, 123)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight.detach()))
    assert_launched(launched, KERNELS[0])


def test_bad_arguments_name_the_argument():
    """Mismatched weight, residual shape and eps raise errors naming them."""
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight.shape"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="residual.shape"):
        rms_norm(x, torch.ones(8), residual=torch.randn(2, 7))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(8), eps=0.0)
    with pytest.raises(TypeError, match="x.dtype"):
        rms_norm(x.long(), torch.ones(8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_matches_reference(monkeypatch, dtype):
    """On a GPU the compiled kernels' outputs and gradients match the reference at a realistic size (fp32 tightly,
    bf16 within ~2x eager PyTorch's error)."""
    launched = spy_launches(monkeypatch, "cuda")
    _check_against_reference((4096, 4096), dtype, "cuda")
    assert_launched(launched, *KERNELS)
