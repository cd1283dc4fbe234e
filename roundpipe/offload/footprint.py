"""Host bytes reserved for a model's tensors: the arena against power-of-two rounding.

torch's pinned allocator (CachingHostAllocator behind `pin_memory()` and
`torch.empty(..., pin_memory=True)`) rounds each request up to the next power
of two and caches blocks by that size, so a 24 MiB MLP weight holds 32 MiB and
a 593 MiB embedding 1 GiB.  `pow2_footprint` models that rounding;
`arena_footprint` measures a host-backend HostArena (same bookkeeping as the
pinned one, ordinary memory that is never touched, so only address space is
spent) holding the same tensors.  A model's tensors: `DecoderShape.tensor_bytes`
(roundpipe/shapes.py), a tied LM head counted once, as the host holds it once.
"""
from __future__ import annotations

import torch

from roundpipe.offload.arena import ArenaConfig, HostArena
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, QWEN3_4B

# The models `roundpipe bench offload` tabulates.
SHAPES = {s.key: s for s in (QWEN3_1_7B, QWEN3_4B, LLAMA_3_1_8B)}


def pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def pow2_footprint(sizes: list[int]) -> int:
    """Bytes a power-of-two rounding allocator (torch's pinned caching allocator) reserves."""
    return sum(pow2_ceil(s) for s in sizes if s > 0)


def arena_footprint(sizes: list[int], config: ArenaConfig | None = None) -> int:
    """Bytes a host-backend HostArena reserves to hold all `sizes` at once (allocated in order)."""
    base = config or ArenaConfig()
    arena = HostArena(ArenaConfig(chunk_bytes=base.chunk_bytes, alignment=base.alignment,
                                  limit_bytes=base.limit_bytes, backend="host"))
    blocks = [arena.empty(s, torch.uint8) for s in sizes if s > 0]   # untouched: address space only
    reserved = arena.stats().reserved_bytes
    del blocks
    return reserved
