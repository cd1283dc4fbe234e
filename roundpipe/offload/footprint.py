"""Host bytes reserved for a model's tensors: the arena against power-of-two rounding.

torch's pinned allocator (CachingHostAllocator behind `pin_memory()` and
`torch.empty(..., pin_memory=True)`) rounds each request up to the next power
of two and caches blocks by that size, so a 24 MiB MLP weight holds 32 MiB and
a 593 MiB embedding 1 GiB.  `pow2_footprint` models that rounding;
`arena_footprint` measures a host-backend HostArena (same bookkeeping as the
pinned one, ordinary memory that is never touched, so only address space is
spent) holding the same tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

from roundpipe.offload.arena import ArenaConfig, HostArena


@dataclass(frozen=True)
class DecoderShape:
    """The tensor shapes of a decoder-only transformer (Llama/Qwen style, untied head)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        for field in ("hidden", "intermediate", "layers", "vocab", "heads", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")

    def parameter_numels(self) -> list[int]:
        """Element counts of every parameter tensor, in model order."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = [h, h * q, h * kv, h * kv, q * h, h, 3 * [h * self.intermediate]]
        flat_layer = [n for item in layer for n in (item if isinstance(item, list) else [item])]
        return [self.vocab * h] + flat_layer * self.layers + [h, self.vocab * h]

    def tensor_bytes(self, bytes_per_element: int = 2) -> list[int]:
        """Byte sizes of every parameter tensor at `bytes_per_element` (2: the bf16 upload copy)."""
        return [n * bytes_per_element for n in self.parameter_numels()]


# Published configurations (hidden, intermediate, layers, vocab, heads, kv heads, head dim).
QWEN3_1_7B = DecoderShape("qwen3-1.7b", 2048, 6144, 28, 151936, 16, 8, 128)
QWEN3_4B = DecoderShape("qwen3-4b", 2560, 9728, 36, 151936, 32, 8, 128)
LLAMA_3_1_8B = DecoderShape("llama-3.1-8b", 4096, 14336, 32, 128256, 32, 8, 128)
SHAPES = {s.name: s for s in (QWEN3_1_7B, QWEN3_4B, LLAMA_3_1_8B)}


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
    blocks = [arena._arena.allocate(s) for s in sizes if s > 0]
    reserved = arena.stats().reserved_bytes
    del blocks
    return reserved
