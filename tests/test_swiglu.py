"""SwiGLU kernels against the fp32 reference, values and gradients."""
import pytest
import torch
import torch.nn.functional as F
from _kernel_util import LOW_PRECISION, assert_within_torch_error, leaf

from roundpipe.kernels import SwiGLU, swiglu
from roundpipe.kernels.swiglu import swiglu_ref


@pytest.mark.parametrize("shape", [(1, 123), (3, 3000), (2, 3, 77), (5,)])
def test_fp32_matches_reference(shape):
    """fp32 output and both gradients match the autograd of the reference tightly."""
    g, u, dy = 3 * torch.randn(shape), torch.randn(shape), torch.randn(shape)
    ours, ref = [leaf(g), leaf(u)], [leaf(g), leaf(u)]
    y, y_ref = swiglu(*ours), swiglu_ref(*ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    y.backward(dy)
    y_ref.backward(dy)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_within_twice_torch_error(dtype):
    """fp16/bf16 output and gradients are at most ~2x as far from fp32 as eager PyTorch."""
    g, u, dy = 3 * torch.randn(4, 3000), torch.randn(4, 3000), torch.randn(4, 3000)
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


def test_non_contiguous_inputs_and_module():
    """Strided views (the halves of a fused projection) work; the module is a gated MLP."""
    gu = torch.randn(6, 2 * 123)
    g, u = gu[:, :123], gu[:, 123:]
    torch.testing.assert_close(swiglu(g, u), swiglu_ref(g, u))
    mlp = SwiGLU(16, 40)
    x = torch.randn(3, 16)
    expect = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expect, rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_argument():
    """Shape and dtype mismatches raise errors naming the argument."""
    with pytest.raises(ValueError, match="up.shape"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(TypeError, match="up.dtype"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="intermediate_size"):
        SwiGLU(4, 0)


@pytest.mark.cuda
def test_cuda_compiled_matches_reference():
    """On a GPU the compiled kernels match the reference in bf16 at a realistic size."""
    g = torch.randn(4096, 11008, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn_like(g, requires_grad=True)
    y = swiglu(g, u)
    torch.testing.assert_close(y.float(), swiglu_ref(g.float(), u.float()), rtol=2e-2, atol=2e-2)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
