"""The layers a Hugging Face decoder is cut into: embedding, one per decoder layer, norm + LM head.

Each holds the HF model's own submodules (the same parameters, so the host masters are the HF
model's weights and `named_parameters()` keeps HF names).  What travels between layers, per
microbatch of b sequences of T tokens with hidden size H:

    Embed    (input_ids [b, T], attention_mask [b, T] or None, position_ids [b|1, T] or None, head, adapters)
             -> Activation(hidden [b, T, H], masks, position_ids [b|1, T], cos, sin, ..., head, adapters)
    Decoder  Activation -> Activation (hidden replaced)
    Head     Activation -> logits [b, T, V]                 (head="logits", or no autograd: model(...) calls)
                        -> (normed hidden [b, T, H], W)     (head="loss", autograd: the fused tail's loss_fn)
                        -> (normed hidden, W, coef * aux)   (the same, with the router loss on)
                        -> (logits, None[, coef * aux])     (head="loss+logits", or a head the loss cannot fuse)

`masks` maps an attention type ("full_attention", "sliding_attention") to the mask the HF model
builds for this microbatch with its own mask functions (None where attention is plainly causal);
cos/sin are the model's rotary embeddings for the microbatch's positions.  The decoder layers
read masks and cos/sin detached: they depend on no parameter, so no gradient is sent back for them.

With the router loss on (an MoE model with config.output_router_logits, presets.py `Router`) the
Activation also carries the microbatch's attention_mask [b, T] (or None) and `router`, the loss's
running sums (roundpipe/hf/loss.py `RouterStats`: probs [E] fp32 with its gradient, counts [E + 1]
int64); each Decoder adds its routers' logits to them, read by a forward hook that lives only for
that call on the module running it (each worker runs its own replica, so no hook is shared between
threads, and the user's model keeps no hook), and the Head turns them into coef * aux.  Without it
both are None.

Recompute: a backward stage that recomputes the Embed gets the forward's masks and cos/sin through
rp.save_for_recompute (roundpipe/engine/calls/recompute_data.py) instead of building them again: the
mask builder reads the padding mask on the host (`.all()`, a device sync on CUDA) and both cost kernels.
A tensor among them is kept while its bytes are at most `KEEP_BYTES`; a larger one crosses the host link
twice (down after the forward, up before the recompute) for what the device rebuilds in a few kernels at
memory bandwidth, so the recompute rebuilds it, a mask with HF's causal-skip check off (the forward has
shown the mask is needed: the same mask, and no sync).  A mask HF left out (None) is kept at no cost.
Position ids are the call's own or an arange: nothing to keep.

`head` says what the call wants of the Head (`HEAD_FORMS`), and it travels with the activation because only
the call knows: forward_backward asks for "loss", so that the Head returns its weight rather than logits and
the loss runs through `roundpipe.kernels.linear_cross_entropy` without materialising the [b, T, V] logits
(or "loss+logits" when the caller wants the logits back, return_outputs=True); every other call gets the
head's own output, logits, with autograd or without.  A composed call (`model(...)` under autograd, a
backward through its logits later: roundpipe/engine/calls/composed.py) runs its backward as a training call
seeded with the logits' gradient, so its Head must give logits there too, which a rule read from
`torch.is_grad_enabled()` alone could not tell apart from forward_backward's (issue 52: the seed [b, T, V]
met (hidden [b, T, H], W)).

`adapters` is the PEFT adapter state of the call (`AdapterState`: disabled or not, the active adapters),
read from the user's model when the call starts (`adapter_state`).  The workers run replicas, deep copies
made once when wrapping (roundpipe/engine/calls/replica.py), so `with peft_model.disable_adapter():` or
`set_adapter()` on the user's model would not reach them; each layer sets its replica's PEFT modules to the
state its input carries before it runs (`set_adapters`).  Carried rather than read from the model when a
layer runs: a training call's last backward stages run on after it returned, and their recompute must use
the state of their own call, not of the one the caller has started since.
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import nn

from roundpipe.core.tree import detached
from roundpipe.engine.calls.recompute_data import doing_recompute, get_recompute_data, save_for_recompute
from roundpipe.hf.loss import RouterStats, add_router_logits, empty_router_stats, load_balancing_loss
from roundpipe.hf.presets import Router

# The largest mask or rotary table the Embed keeps for its recompute (bytes).  Rebuilding one on a GPU
# costs a handful of kernel launches (~5 us each) plus its bytes at memory bandwidth (~2-3 TB/s); keeping
# it costs its bytes twice over PCIe (~25 GB/s): 2 * 256 KiB / 25 GB/s = 21 us, the launches' order.
# An estimate from those rates, not a measurement: no GPU was at hand when it was set.
KEEP_BYTES = 256 << 10
_REBUILD = "rebuild"   # what the forward keeps in place of a tensor the recompute rebuilds

# What a call wants of the Head (module docstring): its logits; the fused loss's inputs; the loss's inputs as logits
LOGITS, LOSS, LOSS_LOGITS = "logits", "loss", "loss+logits"
HEAD_FORMS = (LOGITS, LOSS, LOSS_LOGITS)


class AdapterState(NamedTuple):
    """PEFT's switches for one call, model-wide: every adapter off (disable_adapter()), and the active adapters."""

    disabled: bool
    active: tuple[str, ...]


def is_tuner(module: nn.Module) -> bool:
    """Whether the module is one of PEFT's adapter-holding modules (a LoRA layer, a modules_to_save wrapper):
    those keep the switches `disable_adapter()` and `set_adapter()` flip (peft's BaseTunerLayer and
    AuxiliaryTrainingWrapper; duck-typed, so that nothing imports peft)."""
    return hasattr(module, "_disable_adapters") and hasattr(module, "_active_adapter")


def _state_of(module: nn.Module) -> AdapterState:
    active = module._active_adapter
    return AdapterState(bool(module._disable_adapters), (active,) if isinstance(active, str) else tuple(active))


def adapter_state(tuners: list[tuple[str, nn.Module]]) -> AdapterState | None:
    """The call's AdapterState from the user's model's PEFT modules (name, module), None without any.

    PEFT's own switches set every module alike; modules set apart by hand are a ValueError, since a call
    carries one state for the whole model."""
    if not tuners:
        return None
    first_name, first = tuners[0]
    state = _state_of(first)
    for name, module in tuners[1:]:
        other = _state_of(module)
        if other != state:
            raise ValueError(f"the PEFT modules of the wrapped model are set apart: {first_name} has adapters "
                             f"{'disabled' if state.disabled else 'enabled'}, active {list(state.active)}, {name} "
                             f"{'disabled' if other.disabled else 'enabled'}, active {list(other.active)}; the workers "
                             "run every module with one state: switch them together with the PEFT model's "
                             "disable_adapter() / set_adapter()")
    return state


def set_adapters(layer: nn.Module, state: AdapterState | None) -> None:
    """Sets the PEFT modules of `layer` (a worker's replica: Embed, Decoder or Head, whose `tuner_names` name
    them) to the call's state, unless they hold it already (`adapters_set`: what this replica was set to last).
    Set directly: PEFT's enable_adapters() would also flip requires_grad, which the engine binds per call from
    the user's model."""
    if state is None or state == layer.adapters_set:
        return
    for name in layer.tuner_names:
        module = layer.get_submodule(name)
        module._disable_adapters = state.disabled
        current = module._active_adapter
        module._active_adapter = state.active[0] if isinstance(current, str) and len(state.active) == 1 \
            else list(state.active)
    layer.adapters_set = state


def _tuner_names(layer: nn.Module) -> list[str]:
    """The PEFT modules of a layer, by name: a replica (a deep copy) finds its own."""
    return [n for n, m in layer.named_modules() if is_tuner(m)]


class Activation(NamedTuple):
    hidden: torch.Tensor
    masks: dict
    position_ids: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    attention_mask: torch.Tensor | None = None   # [b, T], carried only for the router loss
    router: RouterStats | None = None
    head: str = LOGITS                  # what the call wants of the Head (HEAD_FORMS)
    adapters: AdapterState | None = None   # the call's PEFT adapter state (None: no PEFT module)


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

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module | None, config, attention_types: list[str],
                 router: Router | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config
        self.attention_types = sorted(set(attention_types))
        self.router = router
        self.tuner_names = _tuner_names(self)   # LoRA on the embedding
        self.adapters_set: AdapterState | None = None

    def _masks(self, embeds: torch.Tensor, attention_mask, position_ids, kept: dict | None = None) -> dict:
        """The microbatch's mask per attention type; kept: the forward's (a recompute), _REBUILD where too large."""
        from transformers import masking_utils
        makers = {"full_attention": masking_utils.create_causal_mask,
                  "sliding_attention": getattr(masking_utils, "create_sliding_window_causal_mask", None)}
        out = {}
        for kind in self.attention_types:
            if kept is not None and not _is_rebuild(kept[kind]):
                out[kind] = kept[kind]
                continue
            fn = makers.get(kind)
            if fn is None:
                raise ValueError(f"attention type {kind!r} of this model has no mask function in transformers."
                                 f"masking_utils; roundpipe.hf supports {sorted(k for k, v in makers.items() if v)}")
            kw = _mask_fn_kwargs(fn, self.config, embeds, attention_mask, position_ids)
            if kept is not None and "allow_is_causal_skip" in inspect.signature(fn).parameters:
                kw["allow_is_causal_skip"] = False   # the forward's mask was not None: no skip, so no check (sync)
            out[kind] = fn(**kw)
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, head: str = LOGITS,
                adapters: AdapterState | None = None) -> Activation:
        if head not in HEAD_FORMS:
            raise ValueError(f"head={head!r} must be one of {HEAD_FORMS}")
        set_adapters(self, adapters)
        hidden = self.embed_tokens(input_ids)
        given = position_ids
        if position_ids is None:   # as the HF model does without a cache: 0..T-1 whatever the padding
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # Made here (0..T-1), they are not shown to the mask functions: with position ids transformers
        # searches them for packed sequences with .item(), a device sync per microbatch on CUDA and an
        # error on the meta device, where the planner's dry run then lost every activation byte of
        # the model (GPU workers planned HF models as if activations were free).
        kept = get_recompute_data() if doing_recompute() else None   # the forward's (recompute_data.py)
        masks = self._masks(hidden, attention_mask, given, None if kept is None else kept[0])
        cos = sin = None
        if kept is not None and not _is_rebuild(kept[1]):
            cos, sin = kept[1]
        elif self.rotary_emb is not None:
            cos, sin = self.rotary_emb(hidden, position_ids)
        if kept is None:   # a no-op unless a backward stage recomputes this run
            rotary = (cos, sin) if all(_keepable(t) is t for t in (cos, sin)) else _REBUILD
            save_for_recompute({k: _keepable(v) for k, v in masks.items()}, rotary)
        if self.router is None or head == LOGITS:   # the router loss is summed for a loss only
            return Activation(hidden, masks, position_ids, cos, sin, head=head, adapters=adapters)
        stats = empty_router_stats(self.router.num_experts, hidden.device)
        return Activation(hidden, masks, position_ids, cos, sin, attention_mask, stats, head, adapters)


def _keepable(value):
    """What the forward keeps of a value for the recompute: itself (None, a tensor of at most KEEP_BYTES),
    else _REBUILD (a larger tensor; any other object, such as flex attention's BlockMask, which holds
    device tensors that would not travel)."""
    if value is None or (isinstance(value, torch.Tensor) and value.numel() * value.element_size() <= KEEP_BYTES):
        return value
    return _REBUILD


def _is_rebuild(value) -> bool:
    return isinstance(value, str) and value == _REBUILD


class Decoder(nn.Module):
    """One HF decoder layer, called as the HF model calls it (adding its routers' sums to x.router)."""

    def __init__(self, layer: nn.Module, attention_type: str, router: Router | None = None):
        super().__init__()
        self.layer = layer
        self.attention_type = attention_type
        self.router = router
        # by name: a replica (a deep copy of this layer) finds its own router modules
        self.router_names = [] if router is None else \
            [n for n, m in layer.named_modules() if isinstance(m, router.classes)]
        self.tuner_names = _tuner_names(self)
        self.adapters_set: AdapterState | None = None

    def forward(self, x: Activation) -> Activation:
        x = Activation(*x)
        set_adapters(self, x.adapters)
        kwargs: dict[str, Any] = {"attention_mask": detached(x.masks[self.attention_type]),
                                  "position_ids": x.position_ids}
        if x.cos is not None:
            kwargs["position_embeddings"] = (detached(x.cos), detached(x.sin))
        logits: list[torch.Tensor] = []
        index = self.router.index if self.router is not None else 0

        def record(module, args, output):
            logits.append(output[index] if isinstance(output, (tuple, list)) else output)

        hooks = [self.layer.get_submodule(n).register_forward_hook(record) for n in self.router_names]
        try:
            out = self.layer(x.hidden, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        if isinstance(out, (tuple, list)):   # older transformers return (hidden, ...)
            out = out[0]
        if self.router is None or x.router is None:
            return x._replace(hidden=out)
        stats, mask = RouterStats(*x.router), detached(x.attention_mask)
        for t in logits:
            stats = add_router_logits(stats, t, self.router.top_k, mask)
        return x._replace(hidden=out, router=stats)


def fusable_head(lm_head: nn.Module) -> bool:
    """Whether the LM head is a bias-free linear map whose weight the fused loss can read."""
    return type(lm_head) is nn.Linear and lm_head.bias is None


class Head(nn.Module):
    """Final norm + LM head: logits, or for a loss under autograd (head="loss") (normed hidden, head weight).

    A head the fused loss cannot read (a bias, a LoRA-wrapped head), and head="loss+logits", give
    (logits, None) for the loss instead; the loss then takes the cross-entropy of those logits.  With the
    router loss on, a third element: coef * the microbatch's load-balancing loss (loss.py)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, router: Router | None = None):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.fused = fusable_head(lm_head)
        self.router = router
        self.tuner_names = _tuner_names(self)
        self.adapters_set: AdapterState | None = None

    def forward(self, x: Activation):
        x = Activation(*x)
        set_adapters(self, x.adapters)
        h = self.norm(x.hidden)
        if x.head == LOGITS or not torch.is_grad_enabled():
            return self.lm_head(h)
        out = (h, self.lm_head.weight) if self.fused and x.head == LOSS else (self.lm_head(h), None)
        if self.router is None or x.router is None:
            return out
        return (*out, load_balancing_loss(RouterStats(*x.router)) * self.router.coef)
