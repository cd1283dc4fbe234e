"""bitsandbytes interop: a Params4bit / Linear4bit, or a saved 4-bit checkpoint's tensors, to and from Quant4State.

Nothing here dequantizes: the packed bytes and statistics are taken as they are
(views of bitsandbytes' tensors where it holds them).  A checkpoint stores, for
a weight named P (bitsandbytes' QuantState.as_dict(packed=True)):

    P                                     uint8 [ceil(n / 2), 1]   packed data
    P.absmax                              fp32 [blocks] | uint8 [blocks] (double-quantized)
    P.quant_map                           fp32 [16]     the NF4/FP4 table
    P.nested_absmax, P.nested_quant_map   fp32          (double-quantized only)
    P.quant_state.bitsandbytes__<type>    uint8 JSON: quant_type, blocksize, dtype, shape
                                          (+ nested_blocksize, nested_dtype, nested_offset)

`to_state_dict` writes the same keys, bytes and JSON text, so a round trip is bitwise.
"""
from __future__ import annotations

import json
from typing import Mapping

import torch

from .format import QUANT_TYPES, Quant4State, check_quant_type, code_table
from .reference import quantize_4bit

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAMED_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _check_code(quant_map: torch.Tensor, quant_type: str, where: str) -> None:
    ours = code_table(quant_type, quant_map.device)
    if quant_map.dtype != torch.float32 or not torch.equal(quant_map.view(torch.int32), ours.view(torch.int32)):
        raise ValueError(f"{where} is not bitsandbytes' {quant_type} table; a custom 4-bit code is not supported")


def _dtype(name: str, where: str) -> torch.dtype:
    if name not in _NAMED_DTYPES:
        raise ValueError(f"{where}={name!r} is not one of {tuple(_NAMED_DTYPES)}")
    return _NAMED_DTYPES[name]


def from_bnb(weight) -> Quant4State:
    """A bitsandbytes Params4bit (or a Linear4bit, for its weight) as a Quant4State, without dequantizing.

    A Params4bit that bitsandbytes has not quantized yet (still float) is
    quantized here, with its quant_type, blocksize and compress_statistics:
    bitwise what bitsandbytes would make of it on the CPU.
    """
    weight = getattr(weight, "weight", weight)
    if type(weight).__name__ != "Params4bit":
        raise TypeError(f"from_bnb needs a bitsandbytes Params4bit or Linear4bit, got {type(weight).__name__}")
    if weight.requires_grad:
        raise ValueError("the Params4bit requires grad, but a quantized weight is frozen; "
                         "call .requires_grad_(False) on it first")
    qs = weight.quant_state
    if qs is None or not getattr(weight, "bnb_quantized", True):
        return quantize_4bit(weight.data, check_quant_type(weight.quant_type), weight.compress_statistics,
                             weight.blocksize)
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("this Linear4bit was repacked by bitsandbytes' CPU inference path (an eval-mode forward "
                         "without grad on an AVX512-BF16 CPU), which rounds absmax to bf16: its original "
                         "statistics are gone.  Convert before any such forward, or keep the module in train mode")
    quant_type = check_quant_type(qs.quant_type)
    _check_code(qs.code, quant_type, "quant_state.code")
    common = dict(data=weight.data.view(torch.uint8).reshape(-1), shape=qs.shape, dtype=qs.dtype,
                  quant_type=quant_type, absmax=qs.absmax, blocksize=qs.blocksize)
    if not qs.nested:
        return Quant4State(**common)
    if qs.state2.dtype != torch.float32:
        raise ValueError(f"nested absmax dtype {qs.state2.dtype} is not supported; expected torch.float32")
    return Quant4State(nested_absmax=qs.state2.absmax, nested_code=qs.state2.code,
                       offset=qs.offset.float().reshape(()), nested_blocksize=qs.state2.blocksize, **common)


def state_from_state_dict(tensors: Mapping[str, torch.Tensor], name: str) -> Quant4State:
    """The Quant4State of weight `name` (e.g. 'model.layers.0.mlp.up_proj.weight') in a bitsandbytes 4-bit
    checkpoint's tensors (a safetensors file's dict, or a Linear4bit module's state_dict)."""
    meta_keys = [f"{name}.quant_state.bitsandbytes__{t}" for t in QUANT_TYPES if
                 f"{name}.quant_state.bitsandbytes__{t}" in tensors]
    if name not in tensors or len(meta_keys) != 1:
        raise KeyError(f"{name!r} is not a bitsandbytes 4-bit weight here: expected keys {name!r} and one of "
                       f"{[f'{name}.quant_state.bitsandbytes__{t}' for t in QUANT_TYPES]}")
    meta = json.loads(bytes(tensors[meta_keys[0]].cpu().numpy()).decode("utf-8"))
    quant_type = check_quant_type(meta["quant_type"])
    _check_code(tensors[f"{name}.quant_map"], quant_type, f"{name}.quant_map")
    common = dict(data=tensors[name].view(torch.uint8).reshape(-1), shape=meta["shape"],
                  dtype=_dtype(meta["dtype"], f"{name} dtype"), quant_type=quant_type,
                  absmax=tensors[f"{name}.absmax"], blocksize=meta["blocksize"])
    if "nested_absmax" not in meta and f"{name}.nested_absmax" not in tensors:
        return Quant4State(**common)
    _dtype(meta["nested_dtype"], f"{name} nested_dtype")
    if meta["nested_dtype"] != "float32":
        raise ValueError(f"{name} nested_dtype={meta['nested_dtype']!r} is not supported; expected 'float32'")
    return Quant4State(nested_absmax=tensors[f"{name}.nested_absmax"],
                       nested_code=tensors[f"{name}.nested_quant_map"],
                       offset=torch.tensor(float(meta["nested_offset"]), dtype=torch.float32),
                       nested_blocksize=meta["nested_blocksize"], **common)


def to_state_dict(state: Quant4State, name: str) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes saves for a 4-bit weight named `name` (keys, order, bytes and JSON text)."""
    out = {name: state.data.view(-1, 1), f"{name}.absmax": state.absmax,
           f"{name}.quant_map": code_table(state.quant_type, state.device)}
    meta = {"quant_type": state.quant_type, "blocksize": state.blocksize, "dtype": _DTYPE_NAMES[state.dtype],
            "shape": list(state.shape)}
    if state.double_quant:
        out[f"{name}.nested_absmax"] = state.nested_absmax
        out[f"{name}.nested_quant_map"] = state.nested_code
        meta.update(nested_blocksize=state.nested_blocksize, nested_dtype="float32",
                    nested_offset=state.offset.item())
    out[f"{name}.quant_state.bitsandbytes__{state.quant_type}"] = torch.tensor(
        list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
    return out
