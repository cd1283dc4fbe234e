"""Phase 2 of the state tier: the fp32 masters of the layers that do not fit, on disk beside their state.

When `host_memory` is too small even with every layer's optimizer state on disk, the
masters of the layers that do not fit go to disk too (roundpipe.offload.state_tier:
placement).  A layer's masters live in a region of their own ("layer<l>.master", the
parameters packed like the state's slices) and travel with its state through the same
ring slot: the slot is [state | masters], read ahead together, installed for the update
(`p.data` = a view of the slot, so the unchanged fused `step_layer` updates the master
in place and writes the upload copy from it: bitwise the arithmetic of training in RAM),
then written behind together.  Upload copies and gradients stay in host memory: the
workers never read a master, only its upload copy.

Between steps an offloaded master's `p.data` is a *placeholder*: a NaN of the master's
dtype expanded to its shape (4 bytes, stride 0), one per parameter.  Reading it gives
NaN, never plausible weights; writing it in place is torch's "more than one element of
the written-to tensor refers to a single memory location" error.  Read the masters with
`StateTier.master(p)` (after `synchronize()`) or `save_checkpoint` (streamed a layer at a
time); `close()` removes the files, so read them before.  A master
the user replaces (`p.data = t`, `load_state_dict`) wins: the next update of its layer
copies it into the slot first (the upload copy was already rewritten from it,
roundpipe.engine.model._refresh_edited), then the placeholder is put back.

A master that is its own upload copy (a bf16 master with bf16 compute, an fp32 master
with fp32 compute: host_state.py) is what the workers read, so it stays in RAM; only its
state goes to disk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from roundpipe.offload.nvme import file_bytes

SLICE_ALIGN = 64


@dataclass(frozen=True)
class MasterLayout:
    """The masters of one layer packed in a region: (host parameter index j, offset, nbytes) each."""

    layer: int
    params: tuple[tuple[int, int, int], ...]
    nbytes: int   # a multiple of 4096 (the region's size)


def movable(host: Any, layer: int, index: dict[int, int] | None = None) -> list[int]:
    """The parameters of the layer whose masters may go to disk: owned (not an alias), trained (in the optimizer's
    `index` when given) and not their own upload copies."""
    st = host.layers[layer]
    return [j for j in st.owned if st.params[j].requires_grad
            and (index is None or id(st.params[j]) in index)
            and st.upload[j].data_ptr() != st.params[j].data_ptr()]


def movable_bytes(host: Any) -> int:
    """Bytes of the masters that may go to disk, all layers."""
    return sum(host.layers[l].params[j].nbytes for l in range(len(host)) for j in movable(host, l))


def master_layout(host: Any, layer: int, index: dict[int, int]) -> MasterLayout:
    out, offset = [], 0
    for j in movable(host, layer, index):
        n = host.layers[layer].params[j].nbytes
        out.append((j, offset, n))
        offset += -(-n // SLICE_ALIGN) * SLICE_ALIGN
    return MasterLayout(layer, tuple(out), file_bytes(offset))


def view(buf: torch.Tensor, p: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The master of `p` inside a slot's master part `buf`."""
    return buf[offset:offset + nbytes].view(p.dtype).view(p.shape)


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """What `p.data` is while its master is on disk: NaN, 4 bytes, expanded to the master's shape."""
    return torch.full((), math.nan, dtype=p.dtype).expand(p.shape)


class LazyMaster:
    """A master on disk as `tensor_file.write` takes it: dtype and shape now, the bytes when written (`materialize`
    reads its layer's region once for all of that layer's masters, through one ring slot)."""

    def __init__(self, tier: Any, layer: int, j: int, p: torch.Tensor):
        self.tier, self.layer, self.j = tier, layer, j
        self.dtype, self.shape = p.dtype, p.shape

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        return self.tier.master_view(self.layer, self.j)
