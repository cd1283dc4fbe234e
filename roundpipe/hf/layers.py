"""The layers a Hugging Face decoder is cut into: embedding, one per decoder layer, norm + LM head.

Each holds the HF model's own submodules (the same parameters, so the host masters are the HF
model's weights and `named_parameters()` keeps HF names).  What travels between layers, per
microbatch of b sequences of T tokens with hidden size H:

    Embed    (input_ids [b, T], attention_mask [b, T] or None, position_ids [b|1, T] or None)
             -> Activation(hidden [b, T, H], masks, position_ids [b|1, T], cos, sin)
    Decoder  Activation -> Activation (hidden replaced)
    Head     Activation -> logits [b, T, V]                 (no autograd: forward-only calls)
                        -> (normed hidden [b, T, H], W)     (autograd: the fused tail's loss_fn)

`masks` maps an attention type ("full_attention", "sliding_attention") to the mask the HF model
builds for this microbatch with its own mask functions (None where attention is plainly causal);
cos/sin are the model's rotary embeddings for the microbatch's positions.  The decoder layers
read masks and cos/sin detached: they depend on no parameter, so no gradient is sent back for them.

The head returns its weight rather than logits under autograd so that the loss runs through
`roundpipe.kernels.linear_cross_entropy` and never materialises the [b, T, V] logits; the
engine runs the last layer only in the fused tail stage (forward, loss and backward back to back)
when training, and with autograd off in forward-only calls, which get logits.
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import nn


class Activation(NamedTuple):
    hidden: torch.Tensor
    masks: dict
    position_ids: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def _mask_fn_kwargs(fn, config, embeds, attention_mask, position_ids) -> dict:
    """create_causal_mask's keyword arguments under this transformers version's names."""
    names = inspect.signature(fn).parameters
    kw = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = embeds
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            kw[cache_name] = None
    if "cache_position" in names:
        kw["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return kw


class Embed(nn.Module):
    """Token embedding, position ids, this microbatch's attention masks and rotary embeddings."""

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module | None, config, attention_types: list[str]):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config
        self.attention_types = sorted(set(attention_types))

    def _masks(self, embeds: torch.Tensor, attention_mask, position_ids) -> dict:
        from transformers import masking_utils
        makers = {"full_attention": masking_utils.create_causal_mask,
                  "sliding_attention": getattr(masking_utils, "create_sliding_window_causal_mask", None)}
        out = {}
        for kind in self.attention_types:
            fn = makers.get(kind)
            if fn is None:
                raise ValueError(f"attention type {kind!r} of this model has no mask function in transformers."
                                 f"masking_utils; roundpipe.hf supports {sorted(k for k, v in makers.items() if v)}")
            out[kind] = fn(**_mask_fn_kwargs(fn, self.config, embeds, attention_mask, position_ids))
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> Activation:
        hidden = self.embed_tokens(input_ids)
        given = position_ids
        if position_ids is None:   # as the HF model does without a cache: 0..T-1 whatever the padding
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # Made here (0..T-1), they are not shown to the mask functions: with position ids transformers
        # searches them for packed sequences with .item(), a device sync per microbatch on CUDA and an
        # error on the meta device, where the planner's dry run then lost every activation byte of
        # the model (GPU workers planned HF models as if activations were free).
        masks = self._masks(hidden, attention_mask, given)
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(hidden, position_ids)
        return Activation(hidden, masks, position_ids, cos, sin)


def _detached(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


class Decoder(nn.Module):
    """One HF decoder layer, called as the HF model calls it."""

    def __init__(self, layer: nn.Module, attention_type: str):
        super().__init__()
        self.layer = layer
        self.attention_type = attention_type

    def forward(self, x: Activation) -> Activation:
        x = Activation(*x)
        kwargs: dict[str, Any] = {"attention_mask": _detached(x.masks[self.attention_type]),
                                  "position_ids": x.position_ids}
        if x.cos is not None:
            kwargs["position_embeddings"] = (_detached(x.cos), _detached(x.sin))
        out = self.layer(x.hidden, **kwargs)
        if isinstance(out, (tuple, list)):   # older transformers return (hidden, ...)
            out = out[0]
        return x._replace(hidden=out)


def fusable_head(lm_head: nn.Module) -> bool:
    """Whether the LM head is a bias-free linear map whose weight the fused loss can read."""
    return type(lm_head) is nn.Linear and lm_head.bias is None


class Head(nn.Module):
    """Final norm + LM head: logits without autograd, (normed hidden, head weight) with it.

    A head the fused loss cannot read (a bias, a LoRA-wrapped head) gives (logits, None) under
    autograd instead; the loss then takes the cross-entropy of those logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.fused = fusable_head(lm_head)

    def forward(self, x: Activation):
        h = self.norm(Activation(*x).hidden)
        if not torch.is_grad_enabled():
            return self.lm_head(h)
        if self.fused:
            return h, self.lm_head.weight
        return self.lm_head(h), None
