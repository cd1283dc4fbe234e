"""SwiGLU kernels against the fp32 reference, values and gradients."""
import pytest
import torch
import torch.nn.functional as F
from _kernel_util import LOW_PRECISION, assert_launched, assert_within_torch_error, leaf, spy_launches

from roundpipe.kernels import SwiGLU, swiglu
from roundpipe.kernels.swiglu import swiglu_ref

KERNELS = ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel")


@pytest.mark.parametrize("shape", [(1, 123), (3, 3000), (2, 3, 77), (5,)])
def test_fp32_matches_reference(monkeypatch, shape):
    """fp32 output and both gradients match the autograd of the reference tightly."""
    launched = spy_launches(monkeypatch)
    g, u, dy = 3 * torch.randn(shape), torch.randn(shape), torch.randn(shape)
    ours, ref = [leaf(g), leaf(u)], [leaf(g), leaf(u)]
    y, y_ref = swiglu(*ours), swiglu_ref(*ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    y.backward(dy)
    y_ref.backward(dy)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert_launched(launched, *KERNELS)


def _check_low_precision(shape, dtype, device="cpu"):
    """Output and both gradients at most ~2x as far from the fp32 reference's autograd as eager PyTorch in `dtype`."""
    g, u, dy = (3 * torch.randn(shape, device=device), torch.randn(shape, device=device),
                torch.randn(shape, device=device))
    ref = [leaf(g), leaf(u)]
    y_ref = swiglu_ref(*ref)
    y_ref.backward(dy)
    out = {}
    for name, fn in (("ours", swiglu), ("torch", lambda a, b: F.silu(a) * b)):
        ins = [leaf(g, dtype), leaf(u, dtype)]
        y = fn(*ins)
        y.backward(dy.to(dtype))
        out[name] = [y, ins[0].grad, ins[1].grad]
    for i, label in enumerate(["y", "dgate", "dup"]):
        ref_t = [y_ref, ref[0].grad, ref[1].grad][i]
        assert_within_torch_error(f"{dtype} {label}", out["ours"][i].float(), out["torch"][i].float(), ref_t)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_within_twice_torch_error(monkeypatch, dtype):
    """fp16/bf16 output and gradients are at most ~2x as far from fp32 as eager PyTorch."""
    launched = spy_launches(monkeypatch)
    _check_low_precision((4, 3000), dtype)
    assert_launched(launched, *KERNELS)


def test_non_contiguous_inputs_and_module(monkeypatch):
    """Strided views (the halves of a fused projection) work; the module is a gated MLP."""
    launched = spy_launches(monkeypatch)
    gu = torch.randn(6, 2 * 123)
    g, u = gu[:, :123], gu[:, 123:]
    torch.testing.assert_close(swiglu(g, u), swiglu_ref(g, u))
    mlp = SwiGLU(16, 40)
    x = torch.randn(3, 16)
    expect = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expect, rtol=1e-5, atol=1e-6)
    assert_launched(launched, KERNELS[0])


def test_bad_arguments_name_the_argument():
    """Shape and dtype mismatches raise errors naming the argument."""
    with pytest.raises(ValueError, match="up.shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(TypeError, match="up.dtype"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="intermediate_size"):
        SwiGLU(4, 0)


@pytest.mark.cuda
def test_cuda_compiled_matches_reference(monkeypatch):
    """On a GPU the compiled kernels' bf16 output and gradients are within ~2x eager PyTorch's error at a
    realistic size."""
    launched = spy_launches(monkeypatch, "cuda")
    _check_low_precision((4096, 11008), torch.bfloat16, "cuda")
    assert_launched(launched, *KERNELS)
