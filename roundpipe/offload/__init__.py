"""Offload engine: pinned host memory and prioritised host<->device copies.

- `HostArena` / `ArenaConfig` (arena.py): page-locked host tensors carved from
  big chunks, exact-size (no power-of-two rounding), reuse ordered by fences.
- `CopyEngine` / `Queue` / `pack_lpt` (copy_engine.py): four copy queues per
  device with LPT windowing of bulk transfers behind activation copies.
- fences (fences.py): what both sides synchronise on.
- footprint.py: host bytes each allocator reserves for a model's tensors.
- `NVMeStore` / `NVMeConfig` (nvme.py): state in preallocated files on local
  disk, read ahead and written behind by the native I/O threads (O_DIRECT).

All of it runs on CPU-only machines (plain memory, memcpy workers); CUDA is
loaded at run time when present (`cuda_status()` says what was found).
"""
from __future__ import annotations

from roundpipe import _native
from roundpipe.offload.arena import ArenaConfig, ArenaStats, HostArena
from roundpipe.offload.copy_engine import CopyEngine, Queue, pack_lpt
from roundpipe.offload.fences import make_stream_wait, stream_fence, wait_all
from roundpipe.offload.nvme import NVMeConfig, NVMeStore, Region, check_free_space


def cuda_status() -> str:
    """Which CUDA library the offload engine uses, or why none ('native core unavailable' without _C)."""
    return _native.lib.cuda_status() if _native.available() else f"native core unavailable: {_native.unavailable_reason()}"


def __getattr__(name: str):
    # Native types resolved on use, so `import roundpipe.offload` works without _C.
    if name in ("ArenaExhaustedError", "Fence", "HostFence", "CudaEventFence", "IoFence", "StorageError"):
        return getattr(_native.require(), name)
    raise AttributeError(f"module 'roundpipe.offload' has no attribute {name!r}")


__all__ = ["ArenaConfig", "ArenaStats", "HostArena", "CopyEngine", "Queue", "pack_lpt", "stream_fence",
           "make_stream_wait", "wait_all", "cuda_status", "ArenaExhaustedError", "Fence", "HostFence",
           "CudaEventFence", "NVMeConfig", "NVMeStore", "Region", "check_free_space", "IoFence", "StorageError"]
