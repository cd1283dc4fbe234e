"""Gradient passes around the optimizer step: global norm, inf/NaN check, accumulation.

`grad_norm` reads every gradient once, in the dtype it was downloaded in, and
returns both the global L2 norm (for clipping) and whether every element is
finite (whether a loss-scaled step may run): the engine's only extra pass
before the fused step.  The native sum is exact per element (squares in double)
and summed in a fixed order, so it is the same at every SIMD level.
`accumulate_` adds a low-precision gradient into an fp32 buffer (micro-batch
accumulation) without materialising an fp32 copy.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from roundpipe import _native
from roundpipe.hostops import NATIVE_DTYPES, check_host_tensor, check_real, tensor_list


def grad_sumsq(grads: Sequence[torch.Tensor]) -> float:
    """Sum of squares of all elements (as stored, no unscaling); inf/NaN iff any element is."""
    grads = tensor_list("grads", grads)
    for i, g in enumerate(grads):
        check_host_tensor(f"grads[{i}]", g)
    if _native.available():
        return _native.lib.grad_sumsq([g.data_ptr() for g in grads], [NATIVE_DTYPES[g.dtype] for g in grads],
                                     [g.numel() for g in grads])
    total = 0.0
    for g in grads:
        total += float(g.double().square().sum())
    return total


def grad_norm(grads: Sequence[torch.Tensor], grad_scale: float = 1.0) -> tuple[float, bool]:
    """(global L2 norm of grads / grad_scale, whether every element is finite)."""
    grad_scale = check_real("grad_scale", grad_scale)
    if not (grad_scale > 0 and math.isfinite(grad_scale)):
        raise ValueError(f"grad_scale={grad_scale!r} must be a finite number > 0")
    sumsq = grad_sumsq(grads)
    if not math.isfinite(sumsq):
        return math.inf, False
    return math.sqrt(sumsq) / grad_scale, True


def clip_coef(total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (total_norm + eps))."""
    total_norm, max_norm = check_real("total_norm", total_norm), check_real("max_norm", max_norm)
    eps = check_real("eps", eps)
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0")
    if not math.isfinite(total_norm):
        raise ValueError(f"total_norm={total_norm!r} must be finite; skip the step instead of clipping")
    if total_norm < 0:
        raise ValueError(f"total_norm={total_norm!r} must be >= 0 (it is a norm)")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")
    if total_norm + eps == 0:
        return 1.0  # nothing to clip: a zero gradient with eps=0
    return min(1.0, max_norm / (total_norm + eps))


def accumulate_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst (float32) += src (float32/bfloat16/float16, same number of elements); returns dst."""
    check_host_tensor("dst", dst, {torch.float32: "float32"})
    check_host_tensor("src", src)
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements but src has {src.numel()}; they must match")
    if _native.available():
        _native.lib.accumulate(dst.data_ptr(), src.data_ptr(), NATIVE_DTYPES[src.dtype], dst.numel())
    else:
        d, s = dst.view(-1), src.view(-1)
        same = d.data_ptr() == s.data_ptr() and s.dtype == torch.float32
        if d.numel() and not same and d.data_ptr() < s.data_ptr() + s.numel() * s.element_size() \
                and s.data_ptr() < d.data_ptr() + 4 * d.numel():
            raise ValueError("dst and src overlap in memory; accumulate needs separate buffers (or the same fp32 one)")
        d.add_(s)
    return dst
