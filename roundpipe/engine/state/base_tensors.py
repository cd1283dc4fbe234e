"""The base a checkpoint leaves out, and the fingerprints that stand for it.

A checkpoint holds the run's state, not the base the run was wrapped over: constant buffers (a 4-bit
base's packed bytes, host_state.py) and frozen weights mapped from their safetensors files
(rp.hf.from_pretrained(base_in_ram=False)) are left out.  The manifest's `constants` maps each one's
name to its layer and a hash of its dtype, shape and bytes, of all of them up to 64 KiB and of 64
evenly spaced 1 KiB slices above that (O(1) a tensor: a full pass over a 235B model's 123 GB of NF4
would add seconds to every save).  Loading into a model whose base differs (another model, another
quantization, the base in RAM instead of its files) is then a ValueError naming the layer and the
tensor; a few changed bytes between the samples go unseen.  Checkpoints written before the
fingerprints load without the check.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.engine.step.host_state import FILE_BACKED

if TYPE_CHECKING:
    RoundPipe = Any


def left_out(model: "RoundPipe") -> dict[int, int]:
    """id -> layer of the tensors a checkpoint leaves out, the base the run was wrapped over rather than its
    state: constant buffers (a 4-bit base's packed bytes) and frozen parameters mapped from their safetensors
    files (rp.hf.from_pretrained(base_in_ram=False): written into a checkpoint they would be read into RAM
    again on load, the RAM the option saves).  A fingerprint of each is saved and checked instead."""
    out = {}
    for l, st in enumerate(model.host.layers):
        out.update((id(b), l) for b in st.constants)
        out.update((id(p), l) for p in st.params if getattr(p, FILE_BACKED, False) is True and not p.requires_grad)
    return out


def fingerprint(t: torch.Tensor) -> str:
    """A hash of a host tensor's dtype, shape and bytes (all up to 64 KiB, else 64 spaced 1 KiB slices)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.blake2b(f"{t.dtype} {list(t.shape)}".encode(), digest_size=16)
    n, piece, pieces = raw.size, 1024, 64
    if n <= piece * pieces:
        h.update(raw.tobytes())
    else:
        for i in range(pieces):
            start = i * (n - piece) // (pieces - 1)
            h.update(raw[start:start + piece].tobytes())
    return h.hexdigest()


def constants(model: "RoundPipe") -> dict[str, dict]:
    """name -> {"layer", "fingerprint"} of every base tensor a checkpoint leaves out (`_left_out`)."""
    layer_of = left_out(model)
    return {name: {"layer": layer_of[id(t)], "fingerprint": fingerprint(t)}
            for name, t in model.named_state().items() if id(t) in layer_of}


def check_constants(model: "RoundPipe", saved: dict | None, mpath: str) -> None:
    """The model's base tensors (constant buffers, file-mapped frozen weights) are those the checkpoint was
    saved over (None: not recorded)."""
    if saved is None:
        return
    mine = constants(model)
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            raise ValueError(f"load_checkpoint: {mpath} was saved over a base tensor {name!r} (layer "
                             f"{saved[name]['layer']}: a 4-bit base's packed bytes or a weight left in its file) "
                             "that this model does not have; wrap the same base the same way the checkpoint was "
                             "saved with (quantize=, base_in_ram=False: checkpoints leave that base out)")
        if name not in saved:
            raise ValueError(f"load_checkpoint: layer {mine[name]['layer']} of this model has a base tensor "
                             f"{name!r} (a 4-bit base's packed bytes or a weight left in its file) that {mpath} was "
                             "not saved over (a base quantized or left in its files here but not there?  a "
                             "checkpoint written with the base in RAM loads into a model made the same way)")
        if saved[name]["fingerprint"] != mine[name]["fingerprint"]:
            raise ValueError(f"load_checkpoint: layer {mine[name]['layer']}: the base tensor {name!r} differs "
                             f"from the one {mpath} was saved over (dtype, shape or bytes); load it into a "
                             "model made over the same base (checkpoints leave that base out)")
