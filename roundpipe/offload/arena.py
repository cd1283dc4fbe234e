"""Pinned host memory for offloaded training state, without power-of-two waste.

`HostArena` hands out CPU tensors carved from large page-locked chunks
(csrc/host_arena.h has the design): a request costs its size rounded to
`alignment` bytes, where `tensor.pin_memory()` (torch's caching host allocator)
costs the next power of two.  For the tensors of a model that is the
difference between ~1.0x and up to ~2x host RAM (see roundpipe.offload.footprint).

    arena = HostArena(ArenaConfig(limit_bytes=64 << 30))
    w = arena.empty((4096, 4096), torch.bfloat16)       # pinned when CUDA is present
    w_gpu = w.to("cuda", non_blocking=True)
    arena.record_stream(w)      # w's block is reused only after that copy completed
    del w                       # block returns to the arena (deferred by its fences)

A tensor from the arena keeps its block alive; when the last tensor viewing it is
released, the block goes back, and becomes reusable once every fence recorded
against it (`record`, `record_stream`, or the fences the copy engine returns)
has completed.  Without CUDA the arena serves ordinary page-aligned memory with
the same bookkeeping, so everything above runs (and is tested) on a CPU.

Plain memory is resident only where it was touched, page-locked memory as soon as it
is reserved; `PLAIN_CHUNK_BYTES` and `fix_mmap_threshold` (below) keep a CPU process's
peak RSS at what is reserved and accounted.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from roundpipe import _native
from roundpipe.core.checks import is_int
from roundpipe.offload.fences import check_fence, stream_fence


def _c():
    return _native.require()


@dataclass(frozen=True)
class ArenaConfig:
    """How the arena reserves memory.

    chunk_bytes: size of the shared chunks small requests are carved from; a
        request above chunk_bytes/2 gets a chunk of its own, exactly sized.
    alignment: block alignment in bytes (power of two, 8..4096); 256 suits
        cudaMemcpy and AVX-512 kernels alike.
    limit_bytes: most bytes the arena may reserve (0: no limit); exceeding it
        raises ArenaExhaustedError naming the request and the limit.
    backend: 'cuda' page-locks through the CUDA runtime/driver (error if absent),
        'host' uses ordinary memory, 'auto' picks 'cuda' when a GPU is usable.
    home_device: the GPU whose context page-locks (and frees) the chunks, whichever
        thread grows the arena; None: the growing thread's current context, which on
        a thread with none is GPU 0's, created for it (0.3-0.5 GB of GPU 0 per process).
        RoundPipe passes its first CUDA worker.
    """

    chunk_bytes: int = 64 << 20
    alignment: int = 256
    limit_bytes: int = 0
    backend: Literal["auto", "cuda", "host"] = "auto"
    home_device: int | None = None

    def __post_init__(self):
        for name in ("chunk_bytes", "alignment", "limit_bytes"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be >= 4096")
        a = self.alignment
        if a < 8 or a > 4096 or a & (a - 1):
            raise ValueError(f"alignment={a} must be a power of two between 8 and 4096")
        if self.limit_bytes < 0:
            raise ValueError(f"limit_bytes={self.limit_bytes} must be >= 0 (0 means no limit)")
        if self.backend not in ("auto", "cuda", "host"):
            raise ValueError(f"backend={self.backend!r} must be 'auto', 'cuda' or 'host'")
        d = self.home_device
        if d is not None and (not is_int(d)):
            raise TypeError(f"home_device must be None or a CUDA device index (int), got {type(d).__name__}")
        if d is not None and d < 0:
            raise ValueError(f"home_device={d} must be None or a CUDA device index >= 0")


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of the arena's accounting (bytes unless noted)."""

    reserved_bytes: int          # all chunks
    in_use_bytes: int            # live and pending blocks, after alignment
    requested_bytes: int         # what live blocks were asked for
    pending_bytes: int           # freed, waiting for their fences
    free_bytes: int
    largest_free_block: int
    peak_in_use_bytes: int
    peak_reserved_bytes: int
    limit_bytes: int
    num_chunks: int
    num_blocks: int              # live
    num_pending: int
    num_free_segments: int
    num_allocations: int         # over the arena's lifetime
    fragmentation: float         # 1 - largest_free_block / free_bytes

    @property
    def overhead(self) -> float:
        """reserved / requested (1.0 is perfect; inf when nothing is requested)."""
        return self.reserved_bytes / self.requested_bytes if self.requested_bytes else float("inf")


class HostArena:
    """Pinned (or plain, without CUDA) host memory served as CPU tensors; see the module docstring."""

    def __init__(self, config: ArenaConfig | None = None):
        if config is None:
            config = ArenaConfig()
        if not isinstance(config, ArenaConfig):
            raise TypeError(f"config must be an ArenaConfig, got {type(config).__name__}")
        self.config = config
        home = -1 if config.home_device is None else config.home_device
        self._arena = _c().HostArena(config.chunk_bytes, config.alignment, config.limit_bytes, config.backend,
                                     home_device=home)
        if self._arena.pinned and torch.cuda.is_available():
            # The blocks come from cudaHostAlloc through our own runtime handle, but torch answers
            # is_pinned() (and skips re-pinning in pin_memory(), DataLoader) only once it has
            # initialised CUDA itself: before, every arena tensor read as pageable.  Seen on an H200.
            torch.cuda.init()

    @property
    def pinned(self) -> bool:
        """Whether blocks are page-locked (CUDA was found)."""
        return self._arena.pinned

    @property
    def backend(self) -> str:
        """'cuda' (page-locked) or 'host'."""
        return self._arena.backend

    def empty(self, shape: int | Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor in an arena block (zero-size: an ordinary tensor)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not isinstance(shape, torch.Size):
            dims = (shape,) if isinstance(shape, int) else shape
            if not isinstance(dims, (tuple, list)) or not all(is_int(d)
                                                              for d in dims):
                raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
            shape = torch.Size(dims)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape={tuple(shape)} has a negative dimension")
        numel = math.prod(shape)  # Python ints: torch.Size.numel() wraps around at 2**64
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if numel * dtype.itemsize > sys.maxsize:
            raise ValueError(f"shape={tuple(shape)} of {dtype} is {numel * dtype.itemsize} bytes, more than any "
                             f"buffer can hold ({sys.maxsize})")
        block = self._arena.allocate(numel * dtype.itemsize)
        # frombuffer keeps `block` referenced for the tensor's lifetime; when the
        # storage dies the block object dies and returns its memory.
        t = torch.frombuffer(block, dtype=dtype, count=numel)
        if len(shape) == 1:
            return t
        return t.view(*shape) if shape else t.view(shape)   # view(*shape): ~2 us less than view(Size)

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """An arena tensor with t's shape and dtype."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        return self.empty(t.shape, t.dtype)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """An arena tensor holding a copy of t (from any device): the arena's pin_memory()."""
        out = self.empty_like(t)
        out.copy_(t)
        return out

    def owns(self, t: torch.Tensor) -> bool:
        """Whether t's data lies in a live block of this arena."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return False
        return self._arena.block_of(t.data_ptr())[1] > 0

    def record(self, t: torch.Tensor, fence) -> None:
        """Defers reuse of t's block, once freed, until `fence` has completed."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
        check_fence("fence", fence)
        if t.numel() == 0:
            return
        if not self.owns(t):
            raise ValueError(f"t (data_ptr=0x{t.data_ptr():x}, device {t.device}) is not a tensor of this arena")
        self._arena.record(t.data_ptr(), fence)

    def record_stream(self, t: torch.Tensor, stream: "torch.cuda.Stream | None" = None):
        """Records an event on `stream` (default: current) against t's block; returns that fence."""
        fence = stream_fence(stream)
        self.record(t, fence)
        return fence

    def collect(self) -> int:
        """Returns blocks whose fences completed to the free list; how many."""
        return self._arena.collect()

    def synchronize(self) -> None:
        """Waits for every freed block's fences, then collects them."""
        self._arena.synchronize()

    def reserve(self, nbytes: int) -> None:
        """Adds one chunk of nbytes (e.g. the whole model's size, to be carved exactly)."""
        if not is_int(nbytes):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r} must be a positive int")
        self._arena.reserve(nbytes)

    def release_unused(self) -> int:
        """Returns wholly free chunks to the system; the bytes released."""
        return self._arena.release_unused()

    def stats(self) -> ArenaStats:
        return ArenaStats(**self._arena.stats())

    def __repr__(self) -> str:
        s = self.stats()
        return (f"HostArena(backend={self.backend!r}, reserved={s.reserved_bytes}, in_use={s.in_use_bytes}, "
                f"blocks={s.num_blocks}, config={dataclasses.asdict(self.config)})")


# Chunks of an arena of plain memory (CPU workers).  A chunk is resident only where a block was ever
# placed, and the arena reserves one shared chunk more than it holds at its peak (the last gradient
# landing of the first call finds the reserve short by what staging holds at that moment): with 64 MiB
# chunks that chunk's 2-64 MiB paged in varied with depth and timing, so the raw peak RSS of AdamW8bit
# runs (Linear(1024) stacks, 24 -> 48 layers, 2 CPU workers) grew 12.7 bytes per added parameter
# against 10.0 reserved and accounted; with 4 MiB chunks 10.2 (fp32 masters) and 6.1 against 6.0 (bf16),
# measured 2026-11-28 on a 2-core EPYC with the mmap threshold below.  Page-locked chunks stay 64 MiB:
# page-locking one takes milliseconds, and they are resident as reserved.
PLAIN_CHUNK_BYTES = 4 << 20

M_MMAP_THRESHOLD = -3        # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold at `nbytes` for the whole process (mallopt(M_MMAP_THRESHOLD)), so that
    a freed buffer of that size or more goes back to the system at once; returns whether it was set
    (False: not Linux with glibc, or the user set MALLOC_MMAP_THRESHOLD_, which stands).

    glibc raises its threshold to the size of each large buffer freed (up to 32 MiB), and from then on
    serves such buffers from the threads' heaps and keeps them there when freed.  A CPU worker's
    "device" buffers (stage weights, fp32 gradient accumulators) are host memory freed after every stage
    run: the two workers' heaps kept 50-90 MiB of freed memory each, growing with depth, 1.5 bytes per
    added parameter of peak RSS above the accounted bytes in the runs of PLAIN_CHUNK_BYTES (AdamW8bit,
    fp32 masters), 0.1 with the threshold fixed at 1 MiB.  The cost: a buffer of 1 MiB or more is mapped
    and its pages faulted in at each allocation instead of being reused from the heap: `roundpipe train
    --devices cpu` (1 MiB-6 MiB activations, ~140 mappings a step) ran at 0.65-0.84x plain PyTorch with it
    and 0.86-0.97x without (2026-12-07, bench/cli.py), so only a RoundPipe whose CPU workers are capped
    (a GPU's memory modelled) sets it (roundpipe/engine/model.py).  Thresholds of 4 and 8 MiB left
    1.5-5 bytes per added parameter above the accounting in some of bench/memory.py --peak's rows."""
    if not is_int(nbytes) or not 0 < nbytes <= 32 << 20:
        raise ValueError(f"nbytes={nbytes!r} must be an int in (0, 32 MiB] (glibc's largest mmap threshold)")
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))


def __getattr__(name: str):
    if name == "ArenaExhaustedError":  # resolved lazily so importing needs no native core
        return _c().ArenaExhaustedError
    raise AttributeError(name)
