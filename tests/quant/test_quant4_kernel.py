"""kernels/dequant4.py: the Triton 4-bit dequantize kernel against roundpipe.quant's PyTorch reference."""
import pytest
import torch
from _kernel_util import assert_launched, spy_launches

from roundpipe.kernels.dequant4 import dequant4, dequant4_ref
from roundpipe.quant import QuantLinear, dequantize, quantize_4bit

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(123, 300), (9, 33), (1,), (3, 1), (2, 3000), (4, 1111)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_kernel_bitwise_equals_reference(monkeypatch, shape, state_dtype, quant_type, double_quant):
    """Every output dtype (fp32, bf16, fp16) of the kernel is bitwise the reference, odd numels included."""
    launched = spy_launches(monkeypatch)
    w = (torch.randn(shape) * torch.rand(shape[0], *[1] * (len(shape) - 1)) * 4).to(state_dtype)
    state = quantize_4bit(w, quant_type, double_quant)
    for dtype in DTYPES:
        out, ref = dequant4(state, dtype), dequant4_ref(state, dtype)
        assert out.shape == w.shape and out.dtype == dtype
        assert torch.equal(_bits(out), _bits(ref)), (dtype, (out.float() - ref.float()).abs().max())
    assert dequant4(state).dtype == state_dtype
    assert_launched(launched, "_dequant4_kernel")


def test_kernel_rounds_bf16_to_nearest_even(monkeypatch):
    """Inexact fp32 products round to bf16 as torch's cast does (nearest, ties to even), not by truncation."""
    launched = spy_launches(monkeypatch)
    w = torch.randn(64 * 40)
    for quant_type in ("nf4", "fp4"):
        state = quantize_4bit(w, quant_type, double_quant=False)
        state = state.replace(absmax=state.absmax * (1 + torch.arange(40) / 997))   # inexact products
        assert (dequant4_ref(state).view(torch.int32) & 0xFFFF).any()
        assert torch.equal(_bits(dequant4(state, torch.bfloat16)), _bits(dequant4_ref(state, torch.bfloat16)))
    assert_launched(launched, "_dequant4_kernel")


def test_cpu_backend_uses_torch(monkeypatch):
    """roundpipe.quant.dequantize on CPU tensors is the PyTorch path (what CPU workers run), not the kernel."""
    launched = spy_launches(monkeypatch)
    state = quantize_4bit(torch.randn(16, 80))
    assert torch.equal(dequantize(state, torch.float32), dequant4_ref(state, torch.float32))
    assert launched == []


def test_bad_arguments():
    """A non-state or an unsupported dtype is refused with its name."""
    with pytest.raises(TypeError, match="Quant4State"):
        dequant4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int8"):
        dequant4(quantize_4bit(torch.randn(8, 8)), torch.int8)


@pytest.mark.cuda
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_cuda_kernel_equals_bitsandbytes_cuda(monkeypatch, quant_type, double_quant):
    """On a GPU the kernel is bitwise bitsandbytes' CUDA dequantize_4bit of the same packed state, and a
    QuantLinear's forward/backward there equals its CPU run."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    from roundpipe.quant import from_bnb

    launched = spy_launches(monkeypatch, "cuda")
    for dtype in DTYPES:
        w = torch.randn(1024, 3000, device="cuda").to(dtype)
        packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
        import bitsandbytes as bnb

        params = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, quant_type=quant_type,
                                   compress_statistics=double_quant, bnb_quantized=True)
        state = from_bnb(params)
        theirs = bnbf.dequantize_4bit(packed, qs)
        assert torch.equal(_bits(dequant4(state) + 0.0), _bits(theirs + 0.0))
        assert torch.equal(_bits(dequant4(state)), _bits(dequant4_ref(state)))
    assert_launched(launched, "_dequant4_kernel")
    linear = torch.nn.Linear(256, 320).requires_grad_(False)
    module = QuantLinear.from_linear(linear, quant_type, double_quant)
    x = torch.randn(5, 256, requires_grad=True)
    y = module(x)
    y.square().sum().backward()
    x_cuda = x.detach().cuda().requires_grad_(True)
    y_cuda = module.cuda()(x_cuda)
    y_cuda.square().sum().backward()
    torch.testing.assert_close(y_cuda.cpu(), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_cuda.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
