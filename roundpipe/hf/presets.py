"""Where the parts of a Hugging Face causal LM are: presets by model type, else a generic search.

A decoder is cut into embedding, decoder layers, final norm + LM head (roundpipe/hf/layers.py).
A preset names the attributes for a known `config.model_type`; the generic path finds them in any
model shaped like one (get_input_embeddings(), a ModuleList of decoder layers and a final norm on
the base model, get_output_embeddings()) and otherwise raises a ValueError naming what is missing.

    model_type          base model  layers   norm   rotary       attention per layer  router loss
    llama               .model      .layers  .norm  .rotary_emb  full                 -
    mistral             .model      .layers  .norm  .rotary_emb  sliding_window       -
    qwen2, qwen3        .model      .layers  .norm  .rotary_emb  config.layer_types   -
    qwen3_moe, mixtral  .model      .layers  .norm  .rotary_emb  sliding_window       output_router_logits
    gpt_oss             .model      .layers  .norm  .rotary_emb  config.layer_types   output_router_logits
                        (all: lm_head on the top model; gpt_oss: attention sinks, biased router)

Attention per layer is HF's own rule, for every model: `config.layer_types` where the config has
it (gpt_oss alternates sliding and full layers), else every layer sliding when `config.sliding_window`
is set (Mistral, Mixtral, Qwen3-MoE with use_sliding_window, Phi-3: their forward builds one sliding
mask for all layers) and full otherwise.

Router loss: with `config.output_router_logits=True` (read when wrapping) an MoE model's forward adds
`router_aux_loss_coef * load_balancing_loss_func(router logits of all layers, ...)` to its loss.  The
routers are the modules its transformers class records `router_logits` from (`_can_record_outputs`,
the hooks HF's own forward collects them with); `Router` holds what the loss needs.  A model with the
flag on whose class records no router logits, or lacks num_experts / num_experts_per_tok /
router_aux_loss_coef, is a ValueError.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Preset:
    """Attribute names of a model type's parts on its base model (`model.model`)."""

    layers: str = "layers"
    norm: str = "norm"
    rotary: str | None = "rotary_emb"


PRESETS = {name: Preset() for name in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")}

_LAYER_NAMES = ("layers", "h", "blocks", "decoder_layers")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")


@dataclass(frozen=True)
class Router:
    """The routers of an MoE model whose loss adds the load-balancing term, and that term's constants.

    classes/index: modules of these classes inside a decoder layer are routers, and output[index] of
    their forward is the router logits [tokens, num_experts] (as HF's OutputRecorder says)."""

    classes: tuple[type, ...]
    index: int
    num_experts: int
    top_k: int
    coef: float


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
    router: Router | None = None  # output_router_logits: the router loss is added (else None)


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
    n = getattr(config, "num_hidden_layers", len(layers))
    layer_list = list(layers)[:n]
    return Parts(config, embed, layer_list, norm, head, rotary if isinstance(rotary, nn.Module) else None,
                 attention_types(config, len(layer_list), sys.modules.get(type(lm).__module__)), preset is not None,
                 find_router(lm) if getattr(config, "output_router_logits", False) else None)


def attention_types(config, n: int, modeling=None) -> list[str]:
    """Each decoder layer's attention type, by HF's rule: config.layer_types, else all sliding when
    config.sliding_window is set (the models without layer_types build one sliding mask then) and the
    model's modeling module (when given) uses the sliding mask at all, else all full."""
    given = getattr(config, "layer_types", None)
    if given:
        return list(given)[:n]
    sliding = getattr(config, "sliding_window", None) is not None and (
        modeling is None or hasattr(modeling, "create_sliding_window_causal_mask"))
    return ["sliding_attention" if sliding else "full_attention"] * n


def _recorded_routers(lm: nn.Module) -> tuple[tuple[type, ...], int] | None:
    """The router classes and output index HF records router_logits from, or None when it records none."""
    specs = None
    for cls in type(lm).__mro__:
        specs = (vars(cls).get("_can_record_outputs") or {}).get("router_logits")
        if specs is not None:
            break
    if specs is None:
        return None
    classes, indices = [], set()
    for spec in specs if isinstance(specs, list) else [specs]:
        target = getattr(spec, "target_class", spec)   # an OutputRecorder, or a bare class (output[1] then, as HF)
        if not isinstance(target, type) or getattr(spec, "layer_name", None) or getattr(spec, "class_name", None):
            return None
        classes.append(target)
        indices.add(getattr(spec, "index", 1))
    return (tuple(classes), indices.pop()) if len(indices) == 1 else None


def find_router(lm: nn.Module) -> Router:
    """What the router loss of an MoE causal LM with config.output_router_logits=True needs; a ValueError
    naming what is missing when roundpipe.hf cannot compute it as the model's own forward does."""
    recorded = _recorded_routers(lm)
    consts = {k: getattr(lm, k, None) for k in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")}
    missing = [f"{k} on {type(lm).__name__}" for k, v in consts.items() if v is None]
    if recorded is None:
        missing.insert(0, f"a router class that {type(lm).__name__} records router_logits from "
                          "(_can_record_outputs, by class)")
    if missing:
        raise ValueError(f"{type(lm).__name__}: config.output_router_logits=True adds the router's auxiliary loss, "
                         f"which roundpipe.hf computes only for models with {' and '.join(missing)}; set "
                         "config.output_router_logits = False to train without it")
    return Router(recorded[0], recorded[1], int(consts["num_experts"]), int(consts["num_experts_per_tok"]),
                  float(consts["router_aux_loss_coef"]))
