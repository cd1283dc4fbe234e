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
import math
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
    if not isinstance(name, str) or name not in _NAMED_DTYPES:
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


# the tensors a 4-bit weight P has besides P itself, each a key "P.<suffix>"
STAT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# bitsandbytes' JSON blob is ~170 bytes; a longer one is not a quant state anyone wrote
MAX_QUANT_STATE_BYTES = 4096


def _quant_state_keys(name: str) -> list[str]:
    return [f"{name}.quant_state.bitsandbytes__{t}" for t in QUANT_TYPES]


def _field(tensors: Mapping[str, torch.Tensor], key: str, dtypes: tuple[torch.dtype, ...],
           numel: int | None = None, finite: bool = True) -> torch.Tensor:
    """tensors[key] flat, checked: present, one of `dtypes`, `numel` values (when given), finite (when asked)."""
    if key not in tensors:
        raise ValueError(f"the key {key!r} is missing")
    t = tensors[key]
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{key!r} is {what}; expected {' or '.join(str(d) for d in dtypes)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{key!r} has {t.numel()} values; expected {numel}")
    if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{key!r} holds NaN or infinite values")
    return t.reshape(-1)


def _meta(blob: torch.Tensor, key: str) -> dict:
    """The JSON object of a quant-state blob, its fields checked for type (values are checked by Quant4State)."""
    if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() > MAX_QUANT_STATE_BYTES:
        raise ValueError(f"{key!r} is {blob.dtype} {list(blob.shape)}; expected uint8 [n] of at most "
                         f"{MAX_QUANT_STATE_BYTES} bytes (JSON text)")
    try:
        meta = json.loads(bytes(blob.cpu().numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{key!r} is not JSON text (bitsandbytes' quant state)") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{key!r} is a JSON {type(meta).__name__}, not an object")
    ints = ("blocksize", "nested_blocksize")
    for field in ("quant_type", "blocksize", "dtype", "shape"):
        if field not in meta:
            raise ValueError(f"{key!r} has no {field!r}")
    for field in ints:
        if field in meta and (type(meta[field]) is not int or meta[field] < 1):
            raise ValueError(f"{key!r}: {field}={meta[field]!r} must be a positive integer")
    shape = meta["shape"]
    if not isinstance(shape, list) or not shape or not all(type(d) is int and d >= 1 for d in shape):
        raise ValueError(f"{key!r}: shape={shape!r} must be a list of positive integers")
    offset = meta.get("nested_offset", 0.0)
    if type(offset) not in (int, float) or not math.isfinite(offset):
        raise ValueError(f"{key!r}: nested_offset={offset!r} must be a finite number")
    return meta


def state_from_state_dict(tensors: Mapping[str, torch.Tensor], name: str) -> Quant4State:
    """The Quant4State of weight `name` (e.g. 'model.layers.0.mlp.up_proj.weight') in a bitsandbytes 4-bit
    checkpoint's tensors (a safetensors file's dict, or a Linear4bit module's state_dict).

    KeyError when `name` is no 4-bit weight there (none of its keys); ValueError naming the weight and the key
    when it is one but a key is missing or holds what bitsandbytes never writes (a wrong dtype or size, NaN
    statistics, a quant state that is not JSON or claims a shape its packed bytes do not hold): checkpoints
    come from anywhere, and nothing is allocated from what they claim."""
    meta_keys = [k for k in _quant_state_keys(name) if k in tensors]
    stats = [f"{name}.{s}" for s in STAT_SUFFIXES if f"{name}.{s}" in tensors]
    if not meta_keys and not stats:
        raise KeyError(f"{name!r} is not a bitsandbytes 4-bit weight here: expected keys {name!r} and one of "
                       f"{_quant_state_keys(name)}")
    try:
        if not meta_keys:
            raise ValueError(f"the key {_quant_state_keys(name)[0]!r} (or {_quant_state_keys(name)[1]!r}, "
                             f"bitsandbytes' quant state) is missing, though {stats[0]!r} is there")
        if len(meta_keys) > 1:
            raise ValueError(f"both {meta_keys[0]!r} and {meta_keys[1]!r} are there; a weight has one 4-bit type")
        return _state(tensors, name, meta_keys[0])
    except ValueError as e:
        raise ValueError(f"4-bit weight {name!r}: {e}") from None


def _state(tensors: Mapping[str, torch.Tensor], name: str, meta_key: str) -> Quant4State:
    meta = _meta(tensors[meta_key], meta_key)
    quant_type = check_quant_type(meta["quant_type"])
    if meta_key != f"{name}.quant_state.bitsandbytes__{quant_type}":
        raise ValueError(f"{meta_key!r} says quant_type={quant_type!r}")
    data = _field(tensors, name, (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32),
                  finite=False)
    if data.dtype != torch.uint8:   # bnb_4bit_quant_storage: the same bytes in another storage dtype
        data = data.view(torch.uint8)
    numel = math.prod(meta["shape"])
    if numel not in (2 * data.numel(), 2 * data.numel() - 1):
        raise ValueError(f"{meta_key!r} claims shape {meta['shape']} ({numel} values) but {name!r} packs "
                         f"{2 * data.numel()} (uint8 [{data.numel()}], two a byte)")
    _check_code(_field(tensors, f"{name}.quant_map", (torch.float32,), 16), quant_type, f"{name}.quant_map")
    nested = "nested_offset" in meta or f"{name}.nested_absmax" in tensors
    absmax = _field(tensors, f"{name}.absmax", (torch.uint8,) if nested else (torch.float32,))
    common = dict(data=data, shape=meta["shape"], dtype=_dtype(meta["dtype"], f"{meta_key} dtype"),
                  quant_type=quant_type, absmax=absmax, blocksize=meta["blocksize"])
    if not nested:
        return Quant4State(**common)
    for field in ("nested_blocksize", "nested_dtype", "nested_offset"):
        if field not in meta:
            raise ValueError(f"{meta_key!r} has no {field!r}, though {name!r} is double-quantized")
    _dtype(meta["nested_dtype"], f"{meta_key} nested_dtype")
    if meta["nested_dtype"] != "float32":
        raise ValueError(f"{name} nested_dtype={meta['nested_dtype']!r} is not supported; expected 'float32'")
    return Quant4State(nested_absmax=_field(tensors, f"{name}.nested_absmax", (torch.float32,)),
                       nested_code=_field(tensors, f"{name}.nested_quant_map", (torch.float32,), 256),
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
