"""Where the parts of a Hugging Face causal LM are: presets by model type, else a generic search.

A decoder is cut into embedding, decoder layers, final norm + LM head (roundpipe/hf/layers.py).
A preset names the attributes for a known `config.model_type`; the generic path finds them in any
model shaped like one (get_input_embeddings(), a ModuleList of decoder layers and a final norm on
the base model, get_output_embeddings()) and otherwise raises a ValueError naming what is missing.

    model_type               base model   layers   norm   rotary       (all: lm_head on the top model)
    llama, mistral           .model       .layers  .norm  .rotary_emb
    qwen2, qwen3, qwen3_moe  .model       .layers  .norm  .rotary_emb  (+ sliding-window layers)
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Preset:
    """Attribute names of a model type's parts on its base model (`model.model`)."""

    layers: str = "layers"
    norm: str = "norm"
    rotary: str | None = "rotary_emb"


PRESETS = {name: Preset() for name in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")}

_LAYER_NAMES = ("layers", "h", "blocks", "decoder_layers")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")


@dataclass
class Parts:
    """The pieces of one causal LM, as modules of that model."""

    config: object
    embed_tokens: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module | None
    attention_types: list[str]   # per decoder layer: "full_attention" or "sliding_attention"
    preset: bool = False         # found by a preset (else by the generic search, checked by a forward)


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a model (a PEFT model's base model, else the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) and type(model).__module__.startswith("peft") else model
    if not callable(getattr(inner, "get_output_embeddings", None)) or not hasattr(inner, "config"):
        raise TypeError(f"hf_model must be a transformers causal LM (e.g. AutoModelForCausalLM.from_config(...)) "
                        f"or a PEFT model around one, got {type(model).__name__}")
    return inner


def _first_attr(owner: nn.Module, names: tuple[str, ...], kind):
    for n in names:
        v = getattr(owner, n, None)
        if isinstance(v, kind):
            return v
    return None


def find_parts(model: nn.Module) -> Parts:
    """Embedding, decoder layers, final norm, LM head and rotary embedding of a causal LM."""
    lm = causal_lm(model)
    config = lm.config
    model_type = getattr(config, "model_type", None)
    base = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if not isinstance(base, nn.Module) or base is lm:
        raise ValueError(f"{type(lm).__name__} (model_type {model_type!r}): no base model at "
                         f".{getattr(lm, 'base_model_prefix', 'model')}; roundpipe.hf needs a causal LM made of a "
                         "base model (embeddings, decoder layers, final norm) and an LM head")
    preset = PRESETS.get(model_type)
    missing = []
    embed = lm.get_input_embeddings()
    if not isinstance(embed, nn.Module):
        missing.append("input embeddings (get_input_embeddings() returned None)")
    if preset is not None:
        layers, norm = getattr(base, preset.layers, None), getattr(base, preset.norm, None)
        rotary = getattr(base, preset.rotary, None) if preset.rotary else None
    else:
        layers = _first_attr(base, _LAYER_NAMES, nn.ModuleList)
        norm = _first_attr(base, _NORM_NAMES, nn.Module)
        rotary = getattr(base, "rotary_emb", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        missing.append(f"a non-empty nn.ModuleList of decoder layers (looked for {', '.join(_LAYER_NAMES)} "
                       f"on {type(base).__name__})")
    if not isinstance(norm, nn.Module):
        missing.append(f"a final norm (looked for {', '.join(_NORM_NAMES)} on {type(base).__name__})")
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Module):
        missing.append("an LM head (get_output_embeddings() returned None)")
    if missing:
        raise ValueError(f"cannot cut {type(lm).__name__} (model_type {model_type!r}) into roundpipe layers: "
                         f"missing {'; '.join(missing)}")
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"{type(lm).__name__}: config.output_router_logits=True adds the router's auxiliary loss, "
                         "which roundpipe.hf does not compute; set config.output_router_logits = False")
    n = getattr(config, "num_hidden_layers", len(layers))
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    layer_list = list(layers)[:n]
    return Parts(config, embed, layer_list, norm, head, rotary if isinstance(rotary, nn.Module) else None,
                 types[:len(layer_list)], preset is not None)
