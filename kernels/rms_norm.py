"""RMSNorm with an optional fused residual add, forward and backward.

Shapes: x, residual [..., H] viewed as rows [N, H]; weight [H] with any stride
(a slice of a packed buffer, an expanded scalar: the kernels index it with its
stride); rstd [N] fp32.

    s = x + residual            (stored in x's dtype, returned as the new residual)
    y = s * rsqrt(mean(s^2) + eps) * weight

One program normalises one row held whole in registers (BLOCK = next power of
two >= H, so H up to 65,536).  The backward is persistent: each program walks a
contiguous slab of rows and keeps its weight-gradient partial sum in fp32
registers; the [programs, H] partials are reduced by one torch sum, so the
weight gradient is summed over rows in fp32 without atomics.  All arithmetic is
fp32 whatever the storage dtype (the Triton interpreter gets bf16 arithmetic
wrong, and fp32 is what the reference does).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _triton
from ._triton import jit, tl, triton

MAX_HIDDEN = 65536


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """fp32 reference: y (and x + residual, added in x's dtype) in x's dtype."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype) if residual is None else (y.to(x.dtype), x)


@jit
def _rms_norm_fwd_kernel(X, R, S, Y, W, RSTD, stride_x, stride_r, stride_s, stride_y, stride_w, H, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)  # normalise what the caller gets back as the residual
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols.to(tl.int64) * stride_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@jit
def _rms_norm_bwd_kernel(DY, DS, X, W, RSTD, DX, DW_PART, stride_dy, stride_ds, stride_x, stride_dx, stride_w,
                         n_rows, rows_per_program, H, HAS_DS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols.to(tl.int64) * stride_w, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / H)) * rstd
        if HAS_DS:
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid * H + cols, dw, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] with unit column stride (a view when possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _rms_norm_fwd(x, weight, eps, residual):
    """Launches the forward; returns y, s (or None), rstd, all as [N, H] / [N]."""
    x2 = _rows(x)
    n, h = x2.shape
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    s = torch.empty_like(y) if residual is not None else x2
    if n:
        block = triton.next_power_of_2(h)
        _triton.launch(_rms_norm_fwd_kernel, (n,), x2, r2, s, y, weight, rstd, x2.stride(0), r2.stride(0),
                       s.stride(0), y.stride(0), weight.stride(0), h, eps, HAS_RESIDUAL=residual is not None,
                       BLOCK=block, num_warps=_triton.num_warps(block))
    return y, (s if residual is not None else None), rstd


def _rms_norm_bwd(dy, ds, s, weight, rstd):
    """Launches the backward on rows; returns dx [N, H] and dweight [H] (fp32-reduced)."""
    n, h = s.shape
    dx = torch.empty_like(s)
    programs = _triton.num_programs(s.device, n)
    dw_part = torch.zeros((programs, h), dtype=torch.float32, device=s.device)
    if n:
        block = triton.next_power_of_2(h)
        ds2 = ds if ds is not None else dy
        _triton.launch(_rms_norm_bwd_kernel, (programs,), dy, ds2, s, weight, rstd, dx, dw_part, dy.stride(0),
                       ds2.stride(0), s.stride(0), dx.stride(0), weight.stride(0), n, triton.cdiv(n, programs), h,
                       HAS_DS=ds is not None, BLOCK=block, num_warps=_triton.num_warps(block))
    return dx, dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd for rms_norm; saves the normalised input (x + residual) and rstd, not y."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        y, s, rstd = _rms_norm_fwd(x, weight, eps, residual)
        ctx.shape = x.shape
        ctx.has_residual = residual is not None
        ctx.save_for_backward(s if s is not None else _rows(x), weight, rstd)
        y = y.view(x.shape)
        return (y, s.view(x.shape)) if s is not None else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        s, weight, rstd = ctx.saved_tensors
        ds = _rows(ds) if ds is not None else None
        dx, dw = _rms_norm_bwd(_rows(dy), ds, s, weight, rstd)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_residual else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual) fused.

    x: [..., H] fp16/bf16/fp32; weight: [H]; residual: like x.  Runs the Triton
    kernels when they can run on x's device, else the fp32 reference.
    """
    _triton.check_float("x", x)
    _triton.check_float("weight", weight)
    _triton.check_same("weight", weight, "x", x, dtype=False)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight.shape={tuple(weight.shape)} must be ({x.shape[-1] if x.dim() else '?'},), "
                         f"the last dim of x.shape={tuple(x.shape)}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps={eps!r} must be a positive number")
    if residual is not None:
        _triton.check_float("residual", residual)
        _triton.check_same("residual", residual, "x", x)
        if residual.shape != x.shape:
            raise ValueError(f"residual.shape={tuple(residual.shape)} must equal x.shape={tuple(x.shape)}")
    if x.shape[-1] > MAX_HIDDEN or not _triton.use_triton(x):
        return rms_norm_ref(x, weight, eps, residual)
    return RMSNormFunction.apply(x, weight, residual, float(eps))


class RMSNorm(nn.Module):
    """RMSNorm with a learned [hidden_size] scale (initialised to ones); forward(x, residual=None)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size!r} must be a positive int")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
