"""Where each byte of a layer's offloaded optimizer state lives: its region on disk and a ring slot.

A layer's state is packed the same way in its region (a preallocated file of the NVMeStore,
`layer<l>.optim`), in the state part of a ring slot (state_ring.py) and in a checkpoint's
optimizer_offload.bin: per optimizer parameter, its state tensors sorted by key, one after
another, each starting on a cache line (SLICE_ALIGN):

    offset 0                  parameter i's first state tensor    (Slice: key, dtype, shape, offset, nbytes)
    next multiple of 64       parameter i's second one
    ...                       the next parameters' slices
    LayerLayout.nbytes        the end rounded up to 4096 (the region's size, nvme.file_bytes)

The masters that go to disk too are packed alike in a region of their own (masters.py).
The layout comes from the optimizer's own `state_layout` (meta tensors: nothing allocated), so
it is exact (AdamW 8 B/param, AdamW8bit 2 B/param + absmax).  The fused step runs on
`slice_view`s of a slot, so the bytes it updates in place are the bytes written back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roundpipe.offload.nvme import file_bytes

SLICE_ALIGN = 64   # bytes: each state tensor in a slot starts on a cache line


@dataclass(frozen=True)
class Slice:
    """One state tensor of a parameter inside its layer's region."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def describe(self) -> list:
        return [self.key, str(self.dtype).removeprefix("torch."), list(self.shape), self.offset]


@dataclass(frozen=True)
class LayerLayout:
    """The packed optimizer state of one layer: (optimizer parameter index, its slices) per parameter."""

    layer: int
    params: tuple[tuple[int, tuple[Slice, ...]], ...]
    nbytes: int   # a multiple of 4096 (the region's size)

    def describe(self) -> list:
        return [[i, [s.describe() for s in slices]] for i, slices in self.params]


def slice_view(buf: torch.Tensor, s: Slice) -> torch.Tensor:
    return buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)


def probe_layout(optimizer: Any, layer: int, params: list[torch.Tensor], index: dict[int, int]) -> LayerLayout:
    """The layer's state layout, from the optimizer's `state_layout` (meta tensors, nothing allocated)."""
    out, offset = [], 0
    for p in params:
        if id(p) not in index:
            continue
        bufs = optimizer.state_layout(p)
        slices = []
        for key in sorted(bufs):
            t = bufs[key]
            nbytes = t.numel() * t.element_size()
            slices.append(Slice(key, t.dtype, tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // SLICE_ALIGN) * SLICE_ALIGN
        out.append((index[id(p)], tuple(slices)))
    return LayerLayout(layer, tuple(out), file_bytes(offset))
