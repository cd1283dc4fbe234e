"""Rotary position embedding in the HuggingFace Llama/Qwen (rotate-half) layout.

Shapes: q [B, Hq, T, D], k [B, Hk, T, D] (any strides with unit stride on D, so
the transposed view of a [B, T, H, D] projection works as is); cos, sin
[B, T, D], [1, T, D] or [T, D]; D even, split in halves x1 = x[..., :D/2],
x2 = x[..., D/2:]:

    out1 = x1 * cos1 - x2 * sin1          (= x * cos + rotate_half(x) * sin)
    out2 = x2 * cos2 + x1 * sin2

The backward is the transpose of that rotation, which is the same kernel with
(sin1, sin2) replaced by (-sin2, -sin1).  One program handles one (batch,
token) position: it loads that position's cos/sin once and rotates every head
of q and k as a [heads, D/2] tile.  cos and sin get no gradient (they are
derived from positions, not learned).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _triton
from ._triton import jit, tl, triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(q, k, cos, sin):
    """fp32 reference (HF apply_rotary_pos_emb with unsqueeze_dim=1), in q's/k's dtypes."""
    cos, sin = cos.float().unsqueeze(-3), sin.float().unsqueeze(-3)
    rot = lambda x: (x.float() * cos + _rotate_half(x.float()) * sin).to(x.dtype)
    return rot(q), rot(k)


@jit
def _rope_tile(X, Y, sxb, sxh, sxt, syb, syh, syt, b, t, n_heads, half, c1, c2, s1, s2,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # int64: heads * sxh alone passes 2**31 for a [B, H, T, D]-contiguous q at T*D >= 2**31 / H
    # (T = 256K at 64 heads of 128); b and t are already int64 (from the program id).
    heads = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (cols < half)
    x_off = X + b * sxb + t * sxt + heads * sxh + cols
    y_off = Y + b * syb + t * syt + heads * syh + cols
    x1 = tl.load(x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_off + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_off, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_off + half, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(Q, K, QO, KO, COS, SIN,
                 sqb, sqh, sqt, skb, skh, skt, sqob, sqoh, sqot, skob, skoh, skot, scb, sct,
                 T, n_q_heads, n_k_heads, half,
                 BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    cols = tl.arange(0, BLOCK_D)[None, :]
    cmask = cols < half
    base = b * scb + t * sct + cols
    c1 = tl.load(COS + base, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + base + half, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + base, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + base + half, mask=cmask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        s1, s2 = -s2, -s1
    _rope_tile(Q, QO, sqb, sqh, sqt, sqob, sqoh, sqot, b, t, n_q_heads, half, c1, c2, s1, s2, BLOCK_HQ, BLOCK_D)
    _rope_tile(K, KO, skb, skh, skt, skob, skoh, skot, b, t, n_k_heads, half, c1, c2, s1, s2, BLOCK_HK, BLOCK_D)


def _as_btd(t: torch.Tensor) -> torch.Tensor:
    """cos/sin as [B or 1, T, D] with unit stride on D (a view when possible)."""
    t = t if t.dim() == 3 else t.unsqueeze(0)
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope(q, k, cos, sin, backward: bool):
    """Launches the rotation (or its transpose); returns new tensors laid out like q and k."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    B, hq, T, D = q.shape
    if q.numel() and k.numel():
        c, s = _as_btd(cos), _as_btd(sin)
        if c.stride() != s.stride():  # the kernel indexes both with one set of strides
            c, s = c.contiguous(), s.contiguous()
        scb = c.stride(0) if c.shape[0] > 1 else 0
        _triton.launch(_rope_kernel, (B * T,), q, k, qo, ko, c, s,
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                       scb, c.stride(1), T, hq, k.shape[1], D // 2, BACKWARD=backward,
                       BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
                       BLOCK_D=triton.next_power_of_2(D // 2), num_warps=4)
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    """Autograd for apply_rope; saves only cos and sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _rope(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def _check(q, k, cos, sin) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _triton.check_float(name, t)
        _triton.check_same(name, t, "q", q, dtype=False)
    _triton.check_same("k", k, "q", q)
    _triton.check_same("sin", sin, "cos", cos)
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or (q.shape[0], q.shape[2:]) != (k.shape[0], k.shape[2:]):
        raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} must be [B, H, T, D] with the "
                         "same B, T and an even D (heads may differ)")
    B, _, T, D = q.shape
    if cos.shape != sin.shape or cos.shape[-2:] != (T, D) or cos.dim() not in (2, 3) or \
            (cos.dim() == 3 and cos.shape[0] not in (1, B)):
        raise ValueError(f"cos.shape={tuple(cos.shape)} and sin.shape={tuple(sin.shape)} must both be "
                         f"[{B}, {T}, {D}], [1, {T}, {D}] or [{T}, {D}]")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotates q [B, Hq, T, D] and k [B, Hk, T, D] by cos/sin [B, T, D]; returns (q_rot, k_rot)."""
    _check(q, k, cos, sin)
    if not _triton.use_triton(q):
        return apply_rope_ref(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions (default RoPE, base `theta`); forward(q, k, position_ids [B, T])."""

    def __init__(self, head_dim: int, theta: float = 10000.0, device=None):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim!r} must be a positive even int")
        if not theta > 0:
            raise ValueError(f"theta={theta!r} must be positive")
        inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, T, D] for integer positions [B, T], computed in fp32 then cast."""
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = self.cos_sin(position_ids, q.dtype)
        return apply_rope(q, k, cos, sin)
