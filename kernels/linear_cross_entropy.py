"""LM head + cross-entropy in token chunks of bounded size, never eager's fp32 [T, V] logits and their gradient.

Shapes: hidden [T, H] (or [..., H]); weight [V, H] (the lm_head / tied
embedding); labels [T] (or [...]) int, `ignore_index` where no loss is wanted;
logits chunk [C, V] in hidden's dtype; loss [T] fp32.

For each chunk of C tokens (torch does the matmuls, Triton the softmax):

    logits = h_c @ W^T                     [C, V]   one reused buffer
    kernel: online max/sum-exp over V -> loss_t = lse_t - logit_t[label_t];
            second pass overwrites logits in place with
            dlogits = (softmax - onehot(label)) * scale_t   (0 for ignored rows)
    dh_c   = dlogits @ W                   [C, H]
    dW    += dlogits^T @ h_c               [V, H]   summed in accum_dtype

With reduction "mean"/"sum" the gradients are produced during the forward
(scale = 1/n_valid or 1) and the backward only multiplies them by the incoming
scalar, so the logits are computed once.  With "none" the per-token incoming
gradient is only known in the backward, which then recomputes the chunks.

Chunk size: traffic against memory.  Every chunk, whatever its C, reads W
twice and passes once over the [V, H] weight gradient (with fp32 sums: the
product written in the weight's dtype and read back, the fp32 sum read and
written), (4b + 2*4) V*H bytes for b-byte weights, 16 V*H in bf16; the logits
cost 6 C*V*b bytes (written, read twice and rewritten by the kernel, read by
the two gradient matmuls).  The old rule made a chunk's logits as large as
hidden (C = next_pow2(T*H/V), Liger-Kernel's rule), so at V = 151,936 there
were about V/H chunks and the [V, H] passes moved ~16 V^2 bytes whatever T and
H: at T = 4,096 (128 chunks at H = 1,024, 32 at H = 4,096) 326 GB per
microbatch in all, 240 GB of it dW's fp32 sums, against 7.5 GB of logits.
Now (`default_chunk_size`):

  - all T tokens form one chunk when their logits fit in MAX_CHUNK_BYTES (1 GiB)
    plus the fp32 accumulator that one chunk does without (dW is then written
    once): T = 4,096 at H = 1,024 or 4,096 moves 8.4 or 11.3 GB;
  - otherwise C = H tokens, cut to a multiple of 128 under MAX_CHUNK_BYTES:
    the [V, H] passes cost at most (4b + 8)/(6b) (1.33x in bf16) of the logits'
    own traffic plus one pass (T = 16,384, H = 4,096: 5 chunks of 3,456, 81 GB
    instead of 350 GB).

The temporaries (logits chunk and accumulator) stay within MAX_CHUNK_BYTES +
V*H*4 bytes: 3.5 GB instead of 2.6 GB at T = 16,384, H = 4,096.  These numbers
are `chunk_costs`' count of this file's tensor accesses (bench/kernels.py
prints them before and after); unmeasured on GPU.

Extra peak memory is C*V (logits) + T*H (dh) + V*H (dW) in the inputs' dtype
instead of eager's several [T, V] tensors, plus, with more than one chunk,
V*H*4 bytes for dW's fp32 accumulator when the weight is fp16/bf16 and
accum_dtype=torch.float32 (the default; 2.5 GB at V=151936, H=4096;
Liger-Kernel's accum_dtype=torch.float32 allocates the same accumulator).  dW
itself receives each chunk's product before it is added to the accumulator.
On CPU torch's mixed-dtype add_ also casts each chunk's [V, H] product through
a transient fp32 copy (V*H*4 more).

Precision: dW is the only sum across chunks (each chunk writes its own dh rows
once, from one matmul over V: dh's error measured the same with 1 and 32
chunks).  Summed in the weight's dtype (accum_dtype=None or weight.dtype,
Liger-Kernel's default) dW is rounded once per chunk and its error grows with
the chunk count; summed in fp32 each chunk's product is rounded once to the
weight's dtype, added in fp32, and the total rounded once at the end.  With 32
chunks (test_fp32_accumulation_keeps_weight_gradient_within_twice_torch_error,
CPU, Triton interpreter) dW's max error against the fp32 reference was, as a
multiple of eager PyTorch's in the same dtype: fp16 2.6x summed in fp16, 1.0x
in fp32; bf16 4.0x summed in bf16, 1.4x in fp32 (1.1x at one chunk: the
interpreter truncates bf16 stores).  The kernels promise at most ~2x, hence the
fp32 default; pass accum_dtype=None where the V*H*4 bytes matter more
(bench/kernels.py --ops lce times both settings on a GPU).

"mean" divides by the number of non-ignored labels; with every label ignored
the loss is 0 with zero gradients (F.cross_entropy gives nan, and a padding-only
micro-batch must not poison the step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import _triton
from ._triton import jit, tl, triton

Reduction = Literal["mean", "sum", "none"]
MAX_BLOCK_V = 8192
MAX_CHUNK_BYTES = 1 << 30


def linear_cross_entropy_ref(hidden, weight, labels, ignore_index: int = -100, reduction: Reduction = "mean"):
    """fp32 reference: F.cross_entropy(hidden @ weight.T) with the all-ignored mean defined as 0."""
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
    flat = labels.reshape(-1)
    losses = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (flat != ignore_index).sum().clamp(min=1)


@jit
def _cross_entropy_kernel(LOGITS, LABELS, LOSS, SCALE, stride_row, V, ignore_index,
                          COMPUTE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    label = tl.load(LABELS + row).to(tl.int64)
    # Out-of-range labels are rejected on CPU; on CUDA they are treated as ignored
    # rather than read out of bounds (validating would cost a device sync).
    valid = (label != ignore_index) & (label >= 0) & (label < V)
    m = float("-inf")
    d = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    target = tl.load(ptr + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))
    if COMPUTE_GRAD:
        if SCALE_PER_ROW:
            scale = tl.load(SCALE + row).to(tl.float32)
        else:
            scale = tl.load(SCALE).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
            tl.store(ptr + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def default_chunk_size(tokens: int, hidden: int, vocab: int, itemsize: int = 2, accum_itemsize: int | None = 4,
                       max_bytes: int | None = None) -> int:
    """Tokens per chunk: at least `hidden` (all `tokens` if fewer), with logits of at most `max_bytes`.

    See the module docstring: C >= H bounds the per-chunk passes over W and dW
    by the chunk's own logits traffic.  All tokens go in one chunk when its
    logits fit in `max_bytes` plus the fp32 accumulator that one chunk does
    without (`accum_itemsize` wider than `itemsize`), so the temporaries stay
    within max_bytes + V*H*accum_itemsize either way.  A chunk that the cap cuts
    is rounded down to a multiple of 128 tokens (matmul tiles) when that leaves any.
    max_bytes defaults to MAX_CHUNK_BYTES (read at the call).
    """
    max_bytes = MAX_CHUNK_BYTES if max_bytes is None else max_bytes
    for name, value in (("tokens", tokens), ("hidden", hidden), ("vocab", vocab), ("itemsize", itemsize),
                        ("max_bytes", max_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    saved = vocab * hidden * accum_itemsize if accum_itemsize not in (None, itemsize) else 0
    if tokens * vocab * itemsize <= max_bytes + saved:
        return tokens
    chunk = min(tokens, hidden)
    fits = max(1, max_bytes // (vocab * itemsize))
    if chunk > fits:
        chunk = fits - fits % 128 if fits >= 128 else fits
    return chunk


@dataclass(frozen=True)
class ChunkCosts:
    """What one forward+backward (reduction "mean"/"sum") moves and holds, by `chunk_costs`' count."""
    chunks: int
    logits_bytes_moved: int      # [C, V] chunks: written by the matmul, kernel passes, gradient matmuls
    weight_bytes_moved: int      # [V, H] per chunk: W read twice, dW's per-chunk product and sum
    other_bytes_moved: int       # hidden read, dh written, the final fp32 -> weight-dtype rounding
    temporary_bytes: int         # alive only inside the call: logits chunk, fp32 accumulator, loss
    gradient_bytes: int          # returned: dh [T, H] and dW [V, H] in the inputs' dtype

    @property
    def bytes_moved(self) -> int:
        return self.logits_bytes_moved + self.weight_bytes_moved + self.other_bytes_moved


def chunk_costs(tokens: int, hidden: int, vocab: int, chunk: int, itemsize: int = 2,
                accum_itemsize: int | None = 4) -> ChunkCosts:
    """DRAM bytes and temporary memory of `_chunked` with gradients, counted per tensor access.

    A model of this file's code, not a measurement: each matmul reads its
    inputs once and writes its output once, the kernel reads a logits row twice
    and writes it once.  `accum_itemsize` is dW's sum dtype size (None or
    `itemsize`: summed in the weight's dtype by addmm_).  Ignores the labels,
    the [T] loss traffic and caches.
    """
    T, H, V, b = tokens, hidden, vocab, itemsize
    n = -(-T // chunk)
    wide = accum_itemsize not in (None, b) and n > 1
    if wide:   # W read twice; the product written to dW and read back; the sum read (not the first) and written
        weight = n * (4 * V * H * b + 2 * V * H * accum_itemsize) - V * H * accum_itemsize
    else:      # W read twice; dW written by the first chunk, read and written by addmm_ in the others
        weight = n * 4 * V * H * b - V * H * b
    logits = 6 * T * V * b
    other = 3 * T * H * b + (V * H * (accum_itemsize + b) if wide else 0)
    temporary = min(chunk, T) * V * b + (V * H * accum_itemsize if wide else 0) + 4 * T
    return ChunkCosts(n, logits, weight, other, temporary, (T * H + V * H) * b)


def _chunked(hidden, weight, labels, ignore_index, scale, *, per_row, need_dh, need_dw, chunk, accum_dtype):
    """Loss [T] fp32 and, if asked, dh [T, H] and dW [V, H] scaled by `scale` (1 value or [T]).

    dW is summed over the chunks in `accum_dtype`.  When that is wider than the
    weight's dtype and there is more than one chunk, each chunk's product lands
    in dW (torch.mm writes its inputs' dtype), is added to an fp32 accumulator,
    and dW receives the rounded sum at the end.  One chunk writes dW once.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    compute_grad = need_dh or need_dw
    loss = torch.empty(T, dtype=torch.float32, device=hidden.device)
    dh = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device) if need_dh else None  # hidden may be strided
    dw = torch.empty_like(weight) if need_dw else None
    wide = need_dw and accum_dtype != weight.dtype and T > chunk
    acc = torch.empty_like(weight, dtype=accum_dtype) if wide else None
    logits_buf = torch.empty((min(chunk, T), V), dtype=hidden.dtype, device=hidden.device)
    block = min(triton.next_power_of_2(V), MAX_BLOCK_V)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        h = hidden[start:end]
        logits = logits_buf[:end - start]
        torch.mm(h, weight.t(), out=logits)
        row_scale = scale[start:end] if per_row else scale
        _triton.launch(
            _cross_entropy_kernel, (end - start,), logits, labels[start:end], loss[start:end], row_scale,
            logits.stride(0), V, ignore_index, COMPUTE_GRAD=compute_grad, SCALE_PER_ROW=per_row, BLOCK_V=block,
            num_warps=_triton.num_warps(block))
        if need_dh:
            torch.mm(logits, weight, out=dh[start:end])
        if need_dw and (wide or start == 0):
            torch.mm(logits.t(), h, out=dw)
            if wide and start == 0:
                acc.copy_(dw)
            elif wide:
                acc.add_(dw)
        elif need_dw:
            dw.addmm_(logits.t(), h)
    if wide:
        dw.copy_(acc)
    return loss, dh, dw


def _scale(labels, ignore_index, reduction):
    """The per-token gradient factor of the summed loss: 1/n_valid (on device, no sync) or 1."""
    if reduction == "mean":
        return (labels != ignore_index).sum().clamp(min=1).to(torch.float32).reciprocal().reshape(1)
    return torch.ones(1, dtype=torch.float32, device=labels.device)


def _reduce(loss, scale, reduction):
    return loss if reduction == "none" else (loss.sum() * scale[0] if reduction == "mean" else loss.sum())


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for linear_cross_entropy on flat [T, H] / [T] inputs.

    The saved gradients are scaled in place in the backward, so (as with
    Liger-Kernel) the graph supports one backward pass, not retain_graph reuse.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, chunk, accum_dtype):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        now = reduction != "none"
        scale = _scale(labels, ignore_index, reduction)
        loss, dh, dw = _chunked(hidden, weight, labels, ignore_index, scale, per_row=False,
                                need_dh=need_dh and now, need_dw=need_dw and now, chunk=chunk,
                                accum_dtype=accum_dtype)
        ctx.args = (ignore_index, reduction, chunk, accum_dtype, need_dh, need_dw)
        ctx.save_for_backward(*((dh, dw) if now else (hidden, weight, labels)))
        return _reduce(loss, scale, reduction)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ignore_index, reduction, chunk, accum_dtype, need_dh, need_dw = ctx.args
        if reduction == "none":
            hidden, weight, labels = ctx.saved_tensors
            _, dh, dw = _chunked(hidden, weight, labels, ignore_index, grad.float().contiguous(), per_row=True,
                                 need_dh=need_dh, need_dw=need_dw, chunk=chunk, accum_dtype=accum_dtype)
        else:
            dh, dw = ctx.saved_tensors
            for g in (dh, dw):
                if g is not None:
                    g.mul_(grad)
        return dh, dw, None, None, None, None, None


def _check_accum_dtype(accum_dtype, weight_dtype: torch.dtype | None = None) -> None:
    """accum_dtype must be None, torch.float32 or the weight's dtype (any supported one while that is unknown)."""
    if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype={accum_dtype!r} must be a torch.dtype or None")
    allowed = (torch.float32, weight_dtype) if weight_dtype else (torch.float32, torch.float16, torch.bfloat16)
    if accum_dtype is not None and accum_dtype not in allowed:
        raise ValueError(f"accum_dtype={accum_dtype} must be None, torch.float32 or the weight's dtype"
                         f" ({weight_dtype or 'float16, bfloat16 or float32'})")


def _check(hidden, weight, labels, ignore_index, reduction, chunk_size, accum_dtype) -> None:
    _triton.check_float("hidden", hidden)
    _triton.check_float("weight", weight)
    _triton.check_same("weight", weight, "hidden", hidden)
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an int64 or int32 tensor, got {getattr(labels, 'dtype', type(labels))}")
    _triton.check_same("labels", labels, "hidden", hidden, dtype=False)
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight.shape={tuple(weight.shape)} must be [V, {hidden.shape[-1] if hidden.dim() else 'H'}]"
                         f" to match hidden.shape={tuple(hidden.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels.shape={tuple(labels.shape)} must equal hidden.shape[:-1]={tuple(hidden.shape[:-1])}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index={ignore_index!r} must be an int")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None")
    _check_accum_dtype(accum_dtype, weight.dtype)
    if labels.device.type == "cpu" and labels.numel():
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bad.any():
            raise ValueError(f"labels contain {labels[bad][0].item()}, outside [0, {weight.shape[0]}) "
                             f"and not ignore_index={ignore_index}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: Reduction = "mean", chunk_size: int | None = None,
                         accum_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """Cross-entropy of hidden @ weight.T against labels without materialising all logits; fp32 loss.

    hidden [..., H] and weight [V, H] share a float dtype; labels [...] int.
    Returns a scalar ("mean", "sum") or labels.shape ("none").  chunk_size
    overrides the tokens per chunk (default: default_chunk_size).  accum_dtype
    is the dtype dW is summed over the chunks in: torch.float32 (default;
    V*H*4 extra bytes for fp16/bf16 weights) or None / weight.dtype (no extra
    buffer, one rounding per chunk); see the module docstring.
    """
    _check(hidden, weight, labels, ignore_index, reduction, chunk_size, accum_dtype)
    if not _triton.use_triton(hidden):
        return linear_cross_entropy_ref(hidden, weight, labels, ignore_index, reduction)
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1).contiguous()
    if h.shape[0] == 0:
        return linear_cross_entropy_ref(hidden, weight, labels, ignore_index, reduction)
    accum = accum_dtype or weight.dtype
    chunk = chunk_size or default_chunk_size(h.shape[0], h.shape[1], weight.shape[0], weight.element_size(),
                                             accum.itemsize)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = LinearCrossEntropyFunction.apply(h, weight, flat, ignore_index, reduction, chunk, accum)
    else:
        scale = _scale(flat, ignore_index, reduction)
        loss = _chunked(h, weight, flat, ignore_index, scale, per_row=False, need_dh=False, need_dw=False,
                        chunk=chunk, accum_dtype=accum)[0]
        out = _reduce(loss, scale, reduction)
    return out.view(labels.shape) if reduction == "none" else out


class LinearCrossEntropyLoss(nn.Module):
    """Module form: forward(hidden, weight, labels) -> linear_cross_entropy with fixed options."""

    def __init__(self, ignore_index: int = -100, reduction: Reduction = "mean", chunk_size: int | None = None,
                 accum_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        _check(torch.empty(0, 1), torch.empty(1, 1), torch.empty(0, dtype=torch.long), ignore_index, reduction,
               chunk_size, None)
        _check_accum_dtype(accum_dtype)  # against the weight's dtype again in forward
        self.ignore_index, self.reduction, self.chunk_size = ignore_index, reduction, chunk_size
        self.accum_dtype = accum_dtype

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, self.ignore_index, self.reduction, self.chunk_size,
                                    self.accum_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_size={self.chunk_size}, "
                f"accum_dtype={self.accum_dtype}")
