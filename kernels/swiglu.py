"""SwiGLU gate: silu(gate) * up, forward and backward in one pass each.

Shapes: gate, up [..., I] (the two halves of the MLP's up projection); out like gate.

    y     = silu(g) * u                  silu(g) = g * sigmoid(g)
    dg    = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du    = dy * silu(g)

Pure bandwidth: the forward reads 2 and writes 1 tensor, the backward reads 3
and writes 2, and nothing but the inputs is saved (eager PyTorch keeps
silu(g) as well).  The kernels work on the flattened contiguous tensors in
blocks of 1,024 elements (an elementwise kernel needs no row structure) and
compute in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _triton
from ._triton import jit, tl, triton

BLOCK = 1024


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 reference, returned in gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


@jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _launch(kernel, *tensors: torch.Tensor) -> None:
    """Runs an elementwise kernel over contiguous tensors of equal numel."""
    n = tensors[0].numel()
    if n:
        _triton.launch(kernel, (triton.cdiv(n, BLOCK),), *tensors, n, BLOCK=BLOCK, num_warps=4)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd for swiglu; saves gate and up only."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        _launch(_swiglu_fwd_kernel, gate, up, y)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        _launch(_swiglu_bwd_kernel, dy.contiguous(), gate, up, dg, du)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for equal-shape fp16/bf16/fp32 tensors (Triton when it can run)."""
    _triton.check_float("gate", gate)
    _triton.check_float("up", up)
    _triton.check_same("up", up, "gate", gate)
    if up.shape != gate.shape:
        raise ValueError(f"up.shape={tuple(up.shape)} must equal gate.shape={tuple(gate.shape)}")
    if not _triton.use_triton(gate):
        return swiglu_ref(gate, up)
    return SwiGLUFunction.apply(gate, up)


class SwiGLU(nn.Module):
    """The gated MLP of Llama/Qwen: down(swiglu(gate(x), up(x))), without biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
