"""Hugging Face's causal-LM loss, token-weighted over the whole batch.

HF: labels [B, T] are shifted inside (position t predicts label t+1, the last position
predicts nothing), -100 is ignored, and the loss is the sum of the per-token cross-entropies
divided by the number of counted tokens of the whole batch, or by `num_items_in_batch`
when given (HF's Trainer passes the count over a gradient-accumulation group).

The engine runs with `loss_reduction="sum"` (roundpipe/engine/calls/microbatch.py): each
microbatch's loss_fn returns its sum over tokens divided by the batch's count N, and the
engine adds them up, so the loss and every gradient are the whole batch's whatever the
microbatches' token counts (a per-microbatch mean weighted by sample count is not: padded
microbatches would count their few tokens as much as full ones).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels [B, T] -> the label each position predicts: labels[:, 1:] then one IGNORE_INDEX column."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.is_floating_point():
        what = f"a {labels.dtype} tensor of shape {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) \
            else type(labels).__name__
        raise ValueError(f"labels must be an integer tensor [batch, seq_len] (-100 where no loss is wanted), got {what}")
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def count_items(shifted: torch.Tensor, num_items_in_batch=None) -> float:
    """The divisor of the summed loss: num_items_in_batch when given, else the counted tokens (at least 1)."""
    if num_items_in_batch is None:
        return float(max(int((shifted != IGNORE_INDEX).sum()), 1))
    n = float(num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch)
    if not n > 0:
        raise ValueError(f"num_items_in_batch={num_items_in_batch!r} must be > 0 (the number of counted tokens)")
    return n


class TokenLoss:
    """loss_fn of one call: the microbatch's summed cross-entropy over shifted labels, divided by N.

    Reads the Head layer's output: (normed hidden, head weight) through the fused linear +
    cross-entropy (no [b, T, V] logits; the Triton kernel on CUDA, its fp32 reference on CPU),
    or (logits, None) for a head it cannot fuse."""

    def __init__(self, num_items: float):
        self.num_items = num_items

    def __call__(self, out, shifted: torch.Tensor) -> torch.Tensor:
        first, weight = out
        if weight is None:
            total = F.cross_entropy(first.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
        elif first.is_cuda:
            from roundpipe.kernels import linear_cross_entropy
            total = linear_cross_entropy(first, weight, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        else:
            from roundpipe.kernels.linear_cross_entropy import linear_cross_entropy_ref
            total = linear_cross_entropy_ref(first, weight, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / self.num_items
