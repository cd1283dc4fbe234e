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

Router loss (MoE models with config.output_router_logits, roundpipe/hf/presets.py `Router`): HF adds
`coef * load_balancing_loss_func(router logits of all layers, E, k, attention_mask)`, with E experts,
top-k routing and R = the counted rows (every router layer's tokens, or its unmasked ones):

    aux = E * sum_e (T_e / R) * (P_e / R)    T_e = sum over layers, tokens of mask * [e in top-k(p)]
                                             P_e = sum over layers, tokens of mask * p_e, p = softmax(logits)

It is not a sum of per-layer terms, but it reduces to sums, so what travels with the hidden state is
`RouterStats`: P [E] fp32 (the only part with a gradient, back to each router) and the integer counts
T [E] and R, exact as HF's fp32 sums of 0/1 masks are (below 2^24 rows).  E + (E + 1) numbers instead
of every layer's [tokens, E] logits.  Each decoder layer adds its routers' sums in HF's order (layers in
turn, each a sum over its tokens), so with one microbatch the loss and gradients are HF's.

With several microbatches the aux loss is per microbatch, as transformers computes it under gradient
accumulation (each microbatch a forward of its own), and the engine weights microbatch m's by its share
of the batch's sequences, b_m / B: the weighted mean of per-microbatch losses, `loss_reduction="mean"`'s
weighting (1 each with one microbatch; equal microbatches: their plain mean).  A microbatch with no
counted row (all padding) adds 0 where HF's would be 0/0 = NaN.
"""
from __future__ import annotations

from typing import NamedTuple

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


class RouterStats(NamedTuple):
    """The router loss's sums so far in a microbatch (module docstring): probs [E] fp32, counts [E + 1]
    int64 (T_0..T_{E-1}, then R)."""

    probs: torch.Tensor
    counts: torch.Tensor


def empty_router_stats(num_experts: int, device) -> RouterStats:
    return RouterStats(torch.zeros(num_experts, dtype=torch.float32, device=device),
                       torch.zeros(num_experts + 1, dtype=torch.int64, device=device))


def add_router_logits(stats: RouterStats, logits: torch.Tensor, top_k: int,
                      attention_mask: torch.Tensor | None) -> RouterStats:
    """stats plus one router's logits [tokens, E] (tokens = the microbatch's b * T, rows of attention_mask
    [b, T] flattened): the sums load_balancing_loss_func makes of them, in its ops."""
    num_experts = stats.probs.shape[0]
    if logits.shape[-1] != num_experts:
        raise ValueError(f"router logits of shape {tuple(logits.shape)}: expected [tokens, {num_experts}] "
                         f"(num_experts={num_experts})")
    weights = torch.softmax(logits.reshape(-1, num_experts), dim=-1)
    _, chosen = torch.topk(weights, top_k, dim=-1)
    if attention_mask is None:
        rows = torch.ones(weights.shape[0], dtype=torch.int64, device=logits.device)
        probs = weights.float().sum(dim=0)
    else:
        rows = attention_mask.reshape(-1).to(device=logits.device, dtype=torch.int64)
        probs = (weights.float() * rows.to(torch.float32).unsqueeze(-1)).sum(dim=0)
    # scatter_add rather than bincount: no device-to-host sync for the output size on CUDA
    hits = torch.zeros(num_experts, dtype=torch.int64, device=logits.device).scatter_add_(
        0, chosen.reshape(-1), rows.repeat_interleave(top_k))
    counts = torch.cat([hits, rows.sum().reshape(1)])
    return RouterStats(stats.probs + probs, stats.counts.detach() + counts)


def load_balancing_loss(stats: RouterStats) -> torch.Tensor:
    """HF's load_balancing_loss_func from the sums (E * sum_e T_e/R * P_e/R); 0 when no row was counted."""
    num_experts = stats.probs.shape[0]
    counts = stats.counts.detach()
    rows = counts[-1:].clamp(min=1).to(torch.float32)
    tokens_per_expert = counts[:-1].to(torch.float32) / rows
    prob_per_expert = stats.probs / rows
    return torch.sum(tokens_per_expert * prob_per_expert.unsqueeze(0)) * num_experts


class TokenLoss:
    """loss_fn of one call: the microbatch's summed cross-entropy over shifted labels, divided by N.

    Reads the Head layer's output: (normed hidden, head weight) through the fused linear +
    cross-entropy (no [b, T, V] logits; the Triton kernel on CUDA, its fp32 reference on CPU),
    or (logits, None) for a head it cannot fuse; a third element, when the model adds a router
    loss, is the microbatch's coef * aux (module docstring), added weighted by b_m / batch_size
    times aux_share (data parallel: this rank's share of the ranks' counted tokens, so that the
    ranks' summed gradients average their aux losses by tokens)."""

    def __init__(self, num_items: float, batch_size: int = 1, aux_share: float = 1.0):
        self.num_items = num_items
        self.batch_size = batch_size
        self.aux_share = aux_share

    def __call__(self, out, shifted: torch.Tensor) -> torch.Tensor:
        first, weight, *aux = out
        if weight is None:
            total = F.cross_entropy(first.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
        elif first.is_cuda:
            from roundpipe.kernels import linear_cross_entropy
            total = linear_cross_entropy(first, weight, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        else:
            from roundpipe.kernels.linear_cross_entropy import linear_cross_entropy_ref
            total = linear_cross_entropy_ref(first, weight, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = total / self.num_items
        if aux:
            loss = loss + aux[0] * (self.aux_share * shifted.shape[0] / self.batch_size)
        return loss
