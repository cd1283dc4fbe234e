"""A frozen base left in its safetensors files: `rp.hf.from_pretrained(path, peft_config=..., base_in_ram=False)`.

With LoRA the base weights are only ever read: uploaded to a worker per stage, never updated, never given a
gradient.  So they need not be in host RAM at all.  Each file is mapped privately (copy-on-write,
`torch.UntypedStorage.from_file(path, shared=False)`: lazy, nothing is read when it is mapped) and every stored
tensor is a view into its file's map, which the model's frozen parameter holds as it is.  The engine takes such a
parameter as its own upload copy (roundpipe/engine/step/host_state.py, FILE_BACKED): no arena block, no copy; a
worker's upload reads it from the page cache, which the kernel fills from the file on first touch and may drop
again under memory pressure (clean file pages), so a base larger than host RAM trains.  The pages a stage read
show in the process's RSS as RssFile (reclaimable page cache), not as anonymous memory.

The price: uploads read pageable memory, not the pinned arena (a CUDA copy from pageable memory is staged by the
driver and synchronous with the host; `roundpipe bench offload` measures the page-cache path against the pinned
one), and a page not in the cache is a read from the disk inside the upload.

Mapped tensors are uploaded as stored, never converted: every floating tensor of the files must be in the load
dtype (dtype="auto": the files' own) and the engine's compute dtype must be that dtype (HFRoundPipe checks it
before anything is copied).  4-bit bases (quantize=, bitsandbytes folders) are not mapped: their packed bytes
are constant buffers, which the engine stages into its arena.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from roundpipe.engine.state.tensor_file import TensorFile
from roundpipe.engine.step.host_state import FILE_BACKED
from roundpipe.hf.quantize import check_layers, check_peft_init, make_stand_ins, materialize_rest


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a view into a private, lazy map of it (the header checked first:
    TensorFile); nothing of the data is read here."""
    with TensorFile(str(path)) as opened:
        entries = dict(opened.entries)
    size = os.path.getsize(path)
    whole = torch.empty(0, dtype=torch.uint8)
    if size:
        whole.set_(torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size))
    out = {}
    for name, (dtype, shape, offset, nbytes) in entries.items():
        item = torch.empty((), dtype=dtype).element_size()
        if offset % item:
            raise ValueError(f"{path}: tensor {name!r} ({dtype}) starts at byte {offset}, not a multiple of its "
                             f"{item}-byte elements, so it cannot be mapped; load the base into RAM "
                             "(base_in_ram=True)")
        out[name] = whole[offset:offset + nbytes].view(dtype).view(shape)
    return out


def load_mapped(path: str | os.PathLike, config, files: list[Path], dtype: torch.dtype | str,
                peft_config) -> nn.Module:
    """The causal LM of `path` with every stored tensor memory-mapped (`map_file`) and `peft_config`'s adapter
    around it (get_peft_model's, drawn as over the model loaded into RAM with the same seed): the base frozen and
    marked FILE_BACKED.  ValueError for a folder without safetensors, a floating tensor in another dtype than
    `dtype`, or a tensor the model does not have."""
    import peft
    from transformers import AutoModelForCausalLM

    check_peft_init(peft_config)   # the adapters are drawn before the stored weights are in place
    if not files:
        raise ValueError(f"{str(path)!r} has no *.safetensors files; base_in_ram=False maps safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        for key, t in map_file(f).items():
            if key in tensors:
                raise ValueError(f"{f}: tensor {key!r} is in {where[key]} too")
            tensors[key], where[key] = t, f
    check_layers(config, len(tensors), path)
    stored = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if dtype == "auto":
        dtype = next(iter(stored)) if len(stored) == 1 else torch.float32
    other = sorted(k for k, t in tensors.items() if t.is_floating_point() and t.dtype != dtype)
    if other:
        raise ValueError(f"base_in_ram=False maps the stored tensors as they are, but {where[other[0]]} holds "
                         f"{other[0]!r} in {tensors[other[0]].dtype}, not dtype={dtype} ({len(other)} such tensor(s)); "
                         f"pass dtype= the files' dtype, or load the base into RAM (base_in_ram=True)")
    config = copy.deepcopy(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    held = make_stand_ins(model, set(), dtype)   # PEFT draws its adapters on the CPU, over these
    top = peft.get_peft_model(model, peft_config)
    own = model.state_dict()
    renamed = {}
    for k, v in tensors.items():   # a PEFT adapter moved its Linear's tensors under .base_layer
        head, _, leaf = k.rpartition(".")
        name = k if k in own or f"{head}.base_layer.{leaf}" not in own else f"{head}.base_layer.{leaf}"
        if name not in own:
            raise ValueError(f"{where[k]}: tensor {k!r} is not in {type(model).__name__} (config.json)")
        if tuple(own[name].shape) != tuple(v.shape):
            raise ValueError(f"{where[k]}: tensor {k!r} has shape {list(v.shape)} but {type(model).__name__} "
                             f"(config.json) has {list(own[name].shape)}")
        renamed[name] = v
    model.load_state_dict(renamed, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    materialize_rest(model, held)
    mapped = {t.data_ptr() for t in tensors.values() if t.numel()}
    for p in model.parameters():
        if not p.requires_grad and p.data_ptr() in mapped:
            setattr(p, FILE_BACKED, True)
    return top
