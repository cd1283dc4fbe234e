"""Host-side vector operations over the native core, with PyTorch fallbacks.

These are the element-wise primitives the optimizer and the offload paths are
built from.  Each takes CPU tensors, validates them, and runs the SIMD kernel of
roundpipe._C (multi-threaded, GIL released) or, without the extension, the
equivalent torch expression.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from roundpipe import _native

NATIVE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_host_tensor(name: str, t: object, dtypes=NATIVE_DTYPES) -> torch.Tensor:
    """Returns `t` if it is a contiguous CPU tensor of an accepted dtype, else raises naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def tensor_list(name: str, value: object) -> list:
    """list(value) for a sequence of tensors (or Nones); TypeError naming `name` for one tensor or a non-sequence."""
    if isinstance(value, (torch.Tensor, str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of tensors, got {type(value).__name__}")
    return list(value)


def check_real(name: str, value: object) -> float:
    """float(value) for a real number (int, float, numpy scalar, one-element tensor), else TypeError naming `name`."""
    if isinstance(value, (str, bytes, complex)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def convert_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst <- src converted to dst's dtype (float32/bfloat16/float16, round to nearest even).

    Same number of elements required (shapes may differ); returns dst.
    """
    check_host_tensor("dst", dst)
    check_host_tensor("src", src)
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements but src has {src.numel()}; they must match")
    if dst.numel() and _overlaps(dst, src) and not (dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype):
        raise ValueError("dst and src overlap in memory; the conversion needs separate buffers")
    if _native.available():
        _native.lib.convert(src.data_ptr(), NATIVE_DTYPES[src.dtype], dst.data_ptr(), NATIVE_DTYPES[dst.dtype], src.numel())
    else:
        dst.view(-1).copy_(src.view(-1))
    return dst
