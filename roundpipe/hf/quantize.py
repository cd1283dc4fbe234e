"""A 4-bit frozen base for wrapped HF models (QLoRA): `rp.hf.wrap(model, quantize="nf4")` and 4-bit checkpoints.

Three ways in, one result: the decoder layers' frozen Linear weights become
roundpipe.quant.QuantLinear (bitsandbytes' 4-bit format; roundpipe/quant/),
whose packed bytes and statistics are constant buffers of the engine: one arena
block each, uploaded packed with the stage's parameters, dequantized on the
worker just before each product, never downloaded back (roundpipe/engine/step/host_state.py).

    quantize="nf4"|"fp4"   every frozen nn.Linear of the decoder layers is quantized here
                           (a PEFT model's base layers; never the adapters, the LM head or
                           the embeddings); trainable Linears stay as they are; a module with
                           frozen fused 3-D expert tensors (transformers 5's MoE experts) becomes
                           roundpipe.quant.QuantExperts (4-bit per expert); MoE routers stay as
                           they are (an [E, H] matrix whose logits pick the experts)
    bitsandbytes model     Linear4bit layers (transformers' BitsAndBytesConfig(load_in_4bit=True),
                           with or without PEFT) are taken as they are: their packed bytes,
                           not a host dequantization (roundpipe.quant.convert_bnb_model)
    4-bit checkpoint       `load_bnb_checkpoint` reads a folder bitsandbytes' save_pretrained
                           wrote (quant-state keys) without bitsandbytes: a meta-device skeleton,
                           QuantLinear from the stored states, the rest assigned as stored
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from roundpipe.quant import QuantExperts, QuantLinear, convert_bnb_model, quantize_model, state_from_state_dict
from roundpipe.quant.convert import ADAPTER_PARTS
from roundpipe.quant.experts import fused_expert_weights

QUANTIZE = (None, "nf4", "fp4")


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """rp.hf.wrap's options of its own (besides the engine's, roundpipe/engine/config.py): the frozen base 4-bit.
    Checked once here; the functions below take the checked object."""

    quantize: Literal["nf4", "fp4"] | None = None
    """Store the frozen Linear weights of the decoder layers in this 4-bit type; None: as they are."""
    double_quant: bool = True
    """Quantize the 4-bit blocks' absmax statistics to 8 bits too (~0.52 instead of ~0.56 bytes a weight)."""

    def __post_init__(self):
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize={self.quantize!r} is not a 4-bit type; expected one of {QUANTIZE} (None: keep "
                             "the frozen weights as they are)")
        if not isinstance(self.double_quant, bool):
            raise TypeError(f"double_quant must be True or False, got {self.double_quant!r}")


HF_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(QuantizeConfig))


def _is_router(module: nn.Module) -> bool:
    """A MoE router (transformers 5 names them *Router: Qwen3MoeTopKRouter, MixtralTopKRouter, ...)."""
    return "Router" in type(module).__name__


def _quantize_experts(layer: nn.Module, quantize: str, double_quant: bool) -> int:
    """Replaces every module of `layer` holding frozen fused 3-D expert tensors by a QuantExperts; how many."""
    names = [n for n, m in layer.named_modules() if not set(n.split(".")) & ADAPTER_PARTS
             and not isinstance(m, QuantExperts) and fused_expert_weights(m)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, QuantExperts(layer.get_submodule(name), quantize, double_quant))
    return len(names)


def _unquantizable(layer: nn.Module, prefix: str) -> None:
    """TypeError naming a frozen matrix of a decoder layer that quantize= cannot take (not an nn.Linear's, not
    fused experts, not a router's)."""
    inside_experts = {id(m) for q in layer.modules() if isinstance(q, QuantExperts) for m in q.base.modules()}
    for name, module in layer.named_modules():
        if set(name.split(".")) & ADAPTER_PARTS or type(module) is nn.Linear:
            continue
        if id(module) in inside_experts or _is_router(module):   # per-expert biases; the router's [E, H]
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() >= 2 and p.is_floating_point() and not p.requires_grad:
                where = ".".join(s for s in (prefix, name, pname) if s)
                raise TypeError(f"quantize=: {where} is a frozen {tuple(p.shape)} weight of a {type(module).__name__}, "
                                "which cannot be quantized (only torch.nn.Linear layers and fused 3-D MoE expert "
                                "tensors can, and bitsandbytes' Linear4bit is taken as it is); wrap without "
                                "quantize=, or unfreeze it")


def quantize_decoder(hf_model: nn.Module, layers: list[nn.Module], options: QuantizeConfig) -> int:
    """The model's 4-bit layers as QuantLinear, in place: bitsandbytes' Linear4bit converted as they are, and with
    `options.quantize` every frozen nn.Linear of the decoder `layers` (and fused expert tensors as QuantExperts);
    returns how many QuantLinear and QuantExperts the layers hold."""
    quantize, double_quant = options.quantize, options.double_quant
    names = {id(m): n for n, m in hf_model.named_modules()}
    convert_bnb_model(hf_model)
    if quantize is not None:
        for layer in layers:
            _quantize_experts(layer, quantize, double_quant)
            _unquantizable(layer, names.get(id(layer), ""))
            quantize_model(layer, quantize, double_quant, skip=())
    held = sum(isinstance(m, (QuantLinear, QuantExperts)) for layer in layers for m in layer.modules())
    if quantize is not None and held == 0:
        trained = next((f"{names.get(id(layer), '')}.{n}" for layer in layers for n, m in layer.named_modules()
                        if type(m) is nn.Linear and m.weight.requires_grad), None)
        raise ValueError(f"quantize={quantize!r}: the decoder layers hold no frozen Linear to quantize"
                         + (f" ({trained}.weight requires grad)" if trained else "")
                         + "; freeze the base first (model.requires_grad_(False)) or wrap a PEFT model "
                         "(peft.get_peft_model), whose base layers are frozen")
    return held


# ---- reading a bitsandbytes 4-bit checkpoint ---------------------------------------------------------------

def is_bnb_4bit(config) -> bool:
    """Whether a transformers config says its checkpoint holds bitsandbytes 4-bit weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return qc.get("quant_method") == "bitsandbytes" and bool(qc.get("load_in_4bit"))


def _compute_dtype(config) -> torch.dtype | None:
    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    name = qc.get("bnb_4bit_compute_dtype")
    return getattr(torch, name.removeprefix("torch.")) if isinstance(name, str) else name


def load_bnb_checkpoint(path: str | os.PathLike, config, dtype: torch.dtype | str = "auto",
                        peft_config=None) -> nn.Module:
    """A causal LM from a folder of bitsandbytes 4-bit safetensors (transformers' save_pretrained of a model
    loaded with BitsAndBytesConfig(load_in_4bit=True)), its 4-bit Linears as QuantLinear over the stored
    bytes; with `peft_config`, that PEFT adapter around it (get_peft_model's, freshly initialised)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(path)!r} has no *.safetensors files; a 4-bit checkpoint is read from safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    quantized = sorted({k.split(".quant_state.bitsandbytes__")[0] for k in tensors if ".quant_state.bitsandbytes__" in k})
    plain = {k: v for k, v in tensors.items() if not any(k == q or k.startswith(q + ".") for q in quantized)}
    if dtype == "auto":
        dtype = next((t.dtype for t in plain.values() if t.is_floating_point()), torch.float32)
    plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in plain.items()}
    config = copy.deepcopy(config)
    compute_dtype = _compute_dtype(config)
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    top = model
    if peft_config is not None:
        import peft
        top = peft.get_peft_model(model, peft_config)   # adapters around the meta Linears, initialised below
    for weight in quantized:
        name = weight.removesuffix(".weight")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        owner = getattr(parent, child)
        if hasattr(owner, "base_layer"):   # a PEFT adapter: its base layer is the stored Linear
            parent, child, owner = owner, "base_layer", owner.base_layer
        if not isinstance(owner, nn.Linear):
            raise TypeError(f"{str(path)!r}: 4-bit weight {weight!r} is of a {type(owner).__name__}, not a Linear")
        bias = plain.pop(f"{name}.bias", None)
        setattr(parent, child, QuantLinear(state_from_state_dict(tensors, weight), bias, compute_dtype))
    own = set(model.state_dict())
    renamed = {}
    for k, v in plain.items():   # a PEFT adapter moved its Linear's tensors under .base_layer
        head, _, leaf = k.rpartition(".")
        renamed[k if k in own or f"{head}.base_layer.{leaf}" not in own else f"{head}.base_layer.{leaf}"] = v
    unexpected = model.load_state_dict(renamed, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise ValueError(f"{str(path)!r}: tensors {unexpected[:5]} are not in {type(model).__name__}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    _materialize(model, peft_config)
    return top


def _materialize(model: nn.Module, peft_config) -> None:
    """The tensors the checkpoint does not hold, off the meta device: non-persistent buffers (rotary tables:
    transformers' _init_weights computes them) and fresh PEFT adapters (their own initialisation)."""
    for name, module in model.named_modules():
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        adapter = peft_config is not None and bool(set(name.split(".")) & ADAPTER_PARTS)
        meta_params = [n for n, p in module.named_parameters(recurse=False) if p.is_meta and adapter]
        for n in meta_buffers:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        for n in meta_params:
            p = module._parameters[n]
            module._parameters[n] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if meta_buffers:
            model._init_weights(module)
    if peft_config is not None:
        for module in model.modules():
            if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, peft_config.init_lora_weights)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the checkpoint holds no value for {left[:5]}; is it a complete save_pretrained folder?")
