"""Host vector ops: argument validation and the torch fallback."""
import pytest
import torch

from roundpipe import hostops


def test_convert_returns_dst_with_converted_values():
    """convert_ writes src into dst's dtype and returns dst; shapes may differ if sizes match."""
    src = torch.randn(6, 5)
    dst = torch.empty(30, dtype=torch.bfloat16)
    assert hostops.convert_(dst, src) is dst
    assert torch.equal(dst, src.reshape(-1).to(torch.bfloat16))


@pytest.mark.parametrize("bad,exc,match", [
    ([1.0, 2.0], TypeError, "src must be a torch.Tensor, got list"),
    (torch.zeros(4, dtype=torch.float64), ValueError, "src has dtype float64"),
    (torch.zeros(4, 2).t(), ValueError, "src must be contiguous"),
    (torch.zeros(5), ValueError, "dst has 8 elements but src has 5"),
])
def test_convert_rejects_bad_src(bad, exc, match):
    """Non-tensors, unsupported dtypes, non-contiguous and mismatched sizes are rejected, dst untouched."""
    dst = torch.full((8,), 3.0, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        hostops.convert_(dst, bad)
    assert torch.equal(dst, torch.full((8,), 3.0, dtype=torch.bfloat16))


def test_convert_rejects_overlap():
    """Overlapping buffers of different dtypes are refused instead of producing garbage."""
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="overlap"):
        hostops.convert_(buf.view(torch.bfloat16)[:8], buf[:8])


def test_convert_rejects_meta_device():
    """Tensors off the CPU are rejected with the device named."""
    with pytest.raises(ValueError, match="dst must be on the CPU, got device meta"):
        hostops.convert_(torch.empty(4, device="meta"), torch.zeros(4))


def test_check_real_and_tensor_list_name_the_argument():
    """Scalars and tensor lists from users are checked with TypeErrors naming the argument."""
    assert hostops.check_real("x", 2) == 2.0 and hostops.check_real("x", torch.tensor(0.5)) == 0.5
    with pytest.raises(TypeError, match="max_norm must be a real number, got str"):
        hostops.check_real("max_norm", "1.0")
    with pytest.raises(TypeError, match="max_norm must be a real number, got Tensor"):
        hostops.check_real("max_norm", torch.ones(2))
    t = torch.ones(2)
    assert hostops.tensor_list("grads", (t, None)) == [t, None]
    with pytest.raises(TypeError, match="grads must be a sequence of tensors, got Tensor"):
        hostops.tensor_list("grads", t)
    with pytest.raises(TypeError, match="grads must be a sequence of tensors, got NoneType"):
        hostops.tensor_list("grads", None)
