"""Whole-model conversion: frozen nn.Linear -> QuantLinear, and bitsandbytes Linear4bit -> QuantLinear, in place.

`quantize_model` replaces every frozen `torch.nn.Linear` (exact type: subclasses
such as MultiheadAttention's out_proj are used through their weight, not their
forward) except:
- modules whose dotted name has a part in `skip` (default: the LM head, which is
  often tied to the embedding and is not a decoder layer),
- a Linear whose weight is shared with another module (tied weights),
- PEFT adapter modules (lora_A / lora_B / modules_to_save): their frozen base
  layers (`base_layer`) are what gets quantized.
Given `modules`, exactly those names are quantized, and each must be a Linear.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .format import check_quant_type
from .linear import QuantLinear

ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "modules_to_save"})


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def quantize_model(model: nn.Module, quant_type: str = "nf4", double_quant: bool = True,
                   skip: Iterable[str] = ("lm_head",), modules: Iterable[str] | None = None,
                   compute_dtype: torch.dtype | None = None) -> int:
    """Replaces the frozen Linear layers of `model` by QuantLinear in place; returns how many."""
    check_quant_type(quant_type)
    if modules is not None:
        names = list(modules)
        for name in names:
            module = model.get_submodule(name)
            if not isinstance(module, nn.Linear):
                raise TypeError(f"module {name!r} is a {type(module).__name__}, not a torch.nn.Linear; "
                                "only Linear layers can be quantized")
    else:
        skip, shared = frozenset(skip), _shared_weights(model)
        names = [name for name, m in model.named_modules() if type(m) is nn.Linear and not m.weight.requires_grad
                 and id(m.weight) not in shared and not (set(name.split(".")) & (skip | ADAPTER_PARTS))]
    for name in names:
        _replace(model, name, QuantLinear.from_linear(model.get_submodule(name), quant_type, double_quant,
                                                      compute_dtype))
    return len(names)


def convert_bnb_model(model: nn.Module) -> int:
    """Replaces every bitsandbytes Linear4bit in `model` (e.g. loaded by transformers with
    BitsAndBytesConfig(load_in_4bit=True), with or without PEFT) by a QuantLinear holding the same packed
    bytes and statistics; returns how many."""
    names = [name for name, m in model.named_modules() if type(m).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4")
             and type(m).__module__.startswith("bitsandbytes")]
    for name in names:
        try:
            _replace(model, name, QuantLinear.from_bnb(model.get_submodule(name)))
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
    return len(names)
