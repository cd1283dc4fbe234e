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

And one way out: `bnb_save_state` gives what transformers' save_pretrained writes for a bitsandbytes
4-bit model (HFRoundPipe.save_pretrained of a model without an adapter), so the folder loads both here and
in transformers.  Every folder read is checked first (`checkpoint_files`): it may come from anywhere.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from roundpipe.quant import QuantExperts, QuantLinear, convert_bnb_model, quantize_model, state_from_state_dict
from roundpipe.quant.bnb import STAT_SUFFIXES, to_state_dict
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
    made = 0
    if quantize is not None:
        for layer in layers:
            made += _quantize_experts(layer, quantize, double_quant)
            _unquantizable(layer, names.get(id(layer), ""))
            made += quantize_model(layer, quantize, double_quant, skip=())
    held = sum(isinstance(m, (QuantLinear, QuantExperts)) for layer in layers for m in layer.modules())
    if quantize is not None and made == 0 and held:
        warnings.warn(f"quantize={quantize!r} is ignored: the frozen Linears of the decoder layers are 4-bit already "
                      f"({', '.join(base_types(hf_model))}, as loaded) and are kept as they are", stacklevel=4)
    if quantize is not None and held == 0:
        trained = next((f"{names.get(id(layer), '')}.{n}" for layer in layers for n, m in layer.named_modules()
                        if type(m) is nn.Linear and m.weight.requires_grad), None)
        raise ValueError(f"quantize={quantize!r}: the decoder layers hold no frozen Linear to quantize"
                         + (f" ({trained}.weight requires grad)" if trained else "")
                         + "; freeze the base first (model.requires_grad_(False)) or wrap a PEFT model "
                         "(peft.get_peft_model), whose base layers are frozen")
    return held


def base_types(model: nn.Module) -> list[str]:
    """The 4-bit types the model's quantized layers hold (sorted; empty when none is 4-bit)."""
    return sorted({m.quant_type for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))})


# ---- a checkpoint folder from anywhere -------------------------------------------------------------------------
# A folder handed to rp.hf.from_pretrained may come from an untrusted source.  Before transformers or the reader
# below sees it: every file read must be a regular file inside the folder (a symlink may point into a Hugging Face
# hub cache's blobs/ next to a snapshot, nowhere else); config.json, generation_config.json and the shard index must
# be JSON objects of at most MAX_JSON_BYTES; the shard index may name only the folder's own *.safetensors files.
# safetensors headers are checked by the reader that reads them (TensorFile here, the safetensors library's
# safe_open for transformers), whose errors become a ValueError naming the file.

MAX_JSON_BYTES = 16 << 20   # a causal LM's config.json is a few KB; its shard index a few hundred KB
JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def _inside(folder: Path, path: Path) -> Path:
    """path with its symlinks resolved: a regular file inside folder (or a hub cache's blobs/), else ValueError."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:   # a dangling link, a loop
        raise ValueError(f"{path}: cannot be opened ({e})") from None
    roots = [folder]
    if folder.parent.name == "snapshots":   # ~/.cache/huggingface/hub/models--x/snapshots/<rev>/f -> ../../blobs/<hash>
        roots.append(folder.parent.parent / "blobs")
    if not any(real.is_relative_to(root) for root in roots):
        raise ValueError(f"{path}: a symlink to {real}, outside the folder {folder}; a checkpoint's files must be "
                         "inside its folder")
    if not stat.S_ISREG(real.stat().st_mode):
        raise ValueError(f"{path}: not a regular file (a FIFO, device or directory)")
    return real


def read_json(folder: Path, name: str) -> dict | None:
    """The JSON object in folder/name (None when there is no such file), checked: size, nesting, an object."""
    path = folder / name
    if not path.exists() and not path.is_symlink():
        return None
    real = _inside(folder, path)
    size = real.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {size} bytes; a {name} of more than {MAX_JSON_BYTES} bytes is not one anyone wrote")
    with open(real, "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{path}: the JSON nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The folder's *.safetensors files, after the checks above (config.json must be there)."""
    folder = Path(path).resolve()
    if read_json(folder, "config.json") is None:
        raise ValueError(f"{str(path)!r} has no config.json; give a folder written by save_pretrained")
    read_json(folder, "generation_config.json")
    index = read_json(folder, "model.safetensors.index.json")
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        _inside(folder, f)
    if index is not None:
        weight_map = index.get("weight_map")
        names = {f.name for f in files}
        if not isinstance(weight_map, dict):
            raise ValueError(f"{folder / 'model.safetensors.index.json'}: weight_map is {type(weight_map).__name__}, "
                             "not an object of tensor -> file")
        for key, file in weight_map.items():
            if not isinstance(file, str) or file not in names:
                raise ValueError(f"{folder / 'model.safetensors.index.json'}: weight_map[{key[:80]!r}] = {file!r} is not "
                                 f"one of the folder's *.safetensors files")
    return files


def check_headers(files: list[Path]) -> int:
    """Opens each safetensors file's header with the safetensors library (what transformers reads it with): its
    errors as a ValueError naming the file; returns how many tensors the files hold."""
    from safetensors import SafetensorError, safe_open
    count = 0
    for f in files:
        try:
            with safe_open(f, "pt") as opened:
                count += len(opened.keys())
        except SafetensorError as e:
            raise ValueError(f"{f}: not a valid safetensors file ({e})") from None
    return count


def check_layers(config, tensors: int, path) -> None:
    """ValueError when config.json claims more decoder layers than the files hold tensors (each layer holds some):
    building them would take forever before any tensor is read."""
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > max(tensors, 1):
        raise ValueError(f"{Path(path) / 'config.json'}: num_hidden_layers={layers}, but the checkpoint holds only "
                         f"{tensors} tensors")


# ---- reading a bitsandbytes 4-bit checkpoint ---------------------------------------------------------------

def is_bnb_4bit(config) -> bool:
    """Whether a transformers config says its checkpoint holds bitsandbytes 4-bit weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return qc.get("quant_method") == "bitsandbytes" and bool(qc.get("load_in_4bit"))


def _compute_dtype(config, path) -> torch.dtype | None:
    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    name = qc.get("bnb_4bit_compute_dtype")
    if name is None:
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else name
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{Path(path) / 'config.json'}: quantization_config.bnb_4bit_compute_dtype={name!r} is not a "
                         "floating torch dtype")
    return dtype


def _read_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the files (read by the checked reader, TensorFile) and the file each came from."""
    from roundpipe.engine.state.tensor_file import TensorFile
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        with TensorFile(str(f)) as opened:
            for key in opened.entries:
                if key in tensors:
                    raise ValueError(f"{f}: tensor {key!r} is in {where[key]} too")
                tensors[key], where[key] = opened.read(key), f
    return tensors, where


def make_stand_ins(model: nn.Module, quantized: set[str], dtype: torch.dtype) -> list[nn.Parameter]:
    """Gives every meta `weight` of the skeleton a CPU stand-in of its shape that costs one value (a zero-stride
    view): uint8 for a stored 4-bit weight (bitsandbytes' Linear4bit holds uint8), else `dtype`.  PEFT creates a
    LoRA adapter on the CPU, draws its initial values there and then moves it to its base layer's device: over a
    meta base the drawn values would be lost.  Over these stand-ins the adapters keep the values PEFT drew, the
    same draws in the same order as get_peft_model over transformers' bitsandbytes model; the stand-ins are
    replaced by the stored tensors before anything reads them, and a stand-in left over is an error."""
    stand_ins = []
    for name, module in model.named_modules():
        p = module._parameters.get("weight")
        if p is None or not p.is_meta:
            continue
        four_bit = f"{name}.weight" in quantized
        value = torch.zeros((), dtype=torch.uint8 if four_bit else dtype).expand(p.shape)
        module._parameters["weight"] = nn.Parameter(value, requires_grad=p.requires_grad and not four_bit)
        stand_ins.append(module._parameters["weight"])
    return stand_ins


def load_bnb_checkpoint(path: str | os.PathLike, config, dtype: torch.dtype | str = "auto",
                        peft_config=None) -> nn.Module:
    """A causal LM from a folder of bitsandbytes 4-bit safetensors (transformers' save_pretrained of a model
    loaded with BitsAndBytesConfig(load_in_4bit=True)), its 4-bit Linears as QuantLinear over the stored
    bytes; with `peft_config`, that PEFT adapter around it (get_peft_model's, initialised as over transformers'
    own bitsandbytes model with the same seed).  Every malformed tensor, key or shape is a ValueError naming
    the file and the tensor."""
    from transformers import AutoModelForCausalLM

    check_peft_init(peft_config)
    files = checkpoint_files(path)
    if not files:
        raise ValueError(f"{str(path)!r} has no *.safetensors files; a 4-bit checkpoint is read from safetensors")
    tensors, where = _read_tensors(files)
    check_layers(config, len(tensors), path)
    quantized = {k.split(".quant_state.bitsandbytes__")[0] for k in tensors if ".quant_state.bitsandbytes__" in k}
    quantized |= {k.rpartition(".")[0] for k in tensors if k.endswith(tuple(f".{s}" for s in STAT_SUFFIXES))}
    states = {}
    for weight in sorted(quantized):
        try:
            states[weight] = state_from_state_dict(tensors, weight)
        except ValueError as e:
            raise ValueError(f"{where.get(weight, Path(path))}: {e}") from None
    plain = {k: v for k, v in tensors.items() if not any(k == q or k.startswith(q + ".") for q in quantized)}
    if dtype == "auto":
        dtype = next((t.dtype for t in plain.values() if t.is_floating_point()), torch.float32)
    plain = {k: v.to(dtype) if v.is_floating_point() else v for k, v in plain.items()}
    config = copy.deepcopy(config)
    compute_dtype = _compute_dtype(config, path)
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    stand_ins = make_stand_ins(model, quantized, dtype)
    top = model
    if peft_config is not None:
        import peft
        top = peft.get_peft_model(model, peft_config)   # the adapters drawn on the CPU, over the stand-ins
    for weight, state in states.items():
        parent, child, owner = _stored_linear(model, weight, where[weight] if weight in where else Path(path))
        if tuple(state.shape) != (owner.out_features, owner.in_features):
            raise ValueError(f"{where.get(weight, Path(path))}: 4-bit weight {weight!r} has shape {list(state.shape)} "
                             f"but {type(model).__name__} (config.json) has [{owner.out_features}, {owner.in_features}]")
        bias = plain.pop(f"{weight.removesuffix('.weight')}.bias", None)
        setattr(parent, child, QuantLinear(state, bias, compute_dtype))
    own = model.state_dict()
    renamed = {}
    for k, v in plain.items():   # a PEFT adapter moved its Linear's tensors under .base_layer
        head, _, leaf = k.rpartition(".")
        name = k if k in own or f"{head}.base_layer.{leaf}" not in own else f"{head}.base_layer.{leaf}"
        if name not in own:
            raise ValueError(f"{where[k]}: tensor {k!r} is not in {type(model).__name__} (config.json)")
        if tuple(own[name].shape) != tuple(v.shape) or own[name].is_floating_point() != v.is_floating_point():
            hint = (" (a packed 4-bit weight without its statistics and quant_state?)"
                    if v.dtype == torch.uint8 else "")
            raise ValueError(f"{where[k]}: tensor {k!r} is {v.dtype} {list(v.shape)} but {type(model).__name__} "
                             f"(config.json) has {own[name].dtype} {list(own[name].shape)}{hint}")
        renamed[name] = v
    model.load_state_dict(renamed, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    materialize_rest(model, stand_ins)
    return top


def check_peft_init(peft_config) -> None:
    """ValueError for a LoRA initialisation that reads the base weight (PiSSA, OLoRA, CorDA, LoftQ, EVA) or DoRA:
    a base roundpipe reads itself (a 4-bit checkpoint, base_in_ram=False) gets its adapters before its stored
    weights are in place."""
    if peft_config is None:
        return
    init = getattr(peft_config, "init_lora_weights", True)
    if not (isinstance(init, bool) or init in ("gaussian", "orthogonal")) or getattr(peft_config, "use_dora", False):
        what = "use_dora=True" if getattr(peft_config, "use_dora", False) else f"init_lora_weights={init!r}"
        raise ValueError(f"peft_config: {what} initialises the adapter from the base weight, which a base read by "
                         "roundpipe (a 4-bit checkpoint, base_in_ram=False) does not have when the adapter is built; "
                         "use init_lora_weights=True, False, 'gaussian' or 'orthogonal' (or load the base into RAM: "
                         "transformers, + bitsandbytes for a 4-bit folder, and wrap it)")


def _stored_linear(model: nn.Module, weight: str, file: Path) -> tuple[nn.Module, str, nn.Linear]:
    """(parent, attribute, the Linear) that 4-bit weight `weight` belongs to (a PEFT adapter's base layer)."""
    name = weight.removesuffix(".weight")
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
        owner = getattr(parent, child) if weight.endswith(".weight") else None
    except AttributeError:
        owner = None
    if hasattr(owner, "base_layer"):   # a PEFT adapter: its base layer is the stored Linear
        parent, child, owner = owner, "base_layer", owner.base_layer
    if not isinstance(owner, nn.Linear):
        what = f"of a {type(owner).__name__}" if owner is not None else f"names no Linear of {type(model).__name__}"
        raise ValueError(f"{file}: 4-bit weight {weight!r} {what} (config.json); only Linear weights are stored 4-bit")
    return parent, child, owner


def materialize_rest(model: nn.Module, stand_ins: list[nn.Parameter]) -> None:
    """The tensors the checkpoint does not hold, off the meta device (non-persistent buffers such as rotary tables:
    transformers' _init_weights computes them); ValueError naming a weight the checkpoint left without a value."""
    for module in model.modules():
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        for n in meta_buffers:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        if meta_buffers:
            model._init_weights(module)
    left_ids = {id(p) for p in stand_ins}
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta or id(t) in left_ids]
    if left:
        raise ValueError(f"the checkpoint holds no value for {left[:5]}; is it a complete save_pretrained folder?")


# ---- writing one ---------------------------------------------------------------------------------------------

def bnb_save_state(hf_model: nn.Module) -> tuple[dict[str, torch.Tensor], dict] | None:
    """The state dict and config.json `quantization_config` that transformers' save_pretrained writes for this
    model loaded with BitsAndBytesConfig(load_in_4bit=True): each QuantLinear's weight under bitsandbytes' keys
    (roundpipe.quant.to_state_dict: packed uint8 [n/2, 1], absmax, quant_map, nested_*, the quant-state JSON),
    every other tensor as the model holds it; None when the model holds no 4-bit layer.

    ValueError when the 4-bit layers cannot be written so: fused MoE experts (QuantExperts; bitsandbytes stores
    Linear weights only), or layers that differ in 4-bit type, double quantization or compute dtype (one
    BitsAndBytesConfig describes them all)."""
    quant = {n: m for n, m in hf_model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    if not quant:
        return None
    from transformers import BitsAndBytesConfig
    experts = [n for n, m in quant.items() if isinstance(m, QuantExperts)]
    if experts:
        raise ValueError(f"save_pretrained: {experts[0]} holds fused MoE expert tensors 4-bit (QuantExperts), which "
                         "bitsandbytes' checkpoint format has no form for (it stores Linear weights only), so no folder "
                         "transformers or rp.hf.from_pretrained could load would come of it; save with save_checkpoint, "
                         "or train a PEFT adapter over the base (save_pretrained then writes the adapter)")
    kinds = {}
    for n, m in quant.items():
        kinds.setdefault((m.quant_type, m.nested_absmax is not None, m.compute_dtype), n)
    if len(kinds) > 1:
        (a, first), (b, second) = list(kinds.items())[:2]
        raise ValueError(f"save_pretrained: {first} is 4-bit (quant_type, double_quant, compute_dtype) = {a} but "
                         f"{second} is {b}; a bitsandbytes checkpoint's quantization_config describes every 4-bit "
                         "layer with one of each, so this model has no bitsandbytes form; save with save_checkpoint")
    (quant_type, double_quant, compute_dtype), = kinds
    state = hf_model.state_dict()
    for name, m in quant.items():
        prefix = f"{name}." if name else ""
        for buffer in m._buffers:
            state.pop(prefix + buffer, None)
        state.update(to_state_dict(m.quant_state, prefix + "weight"))
    # Linears that stay as they are (the LM head, trainable ones): bitsandbytes must not quantize them at load
    skip = [n for n, m in hf_model.named_modules() if type(m) is nn.Linear]
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype,
                                llm_int8_skip_modules=skip).to_dict()
    if compute_dtype is None:   # QuantLinear computes in its input's dtype; transformers reads null as float32
        config["bnb_4bit_compute_dtype"] = None
    return state, config
