"""Prioritised host<->device copies for one device: four queues, LPT windows, fences.

`CopyEngine(device)` wraps the native engine (csrc/copy_engine.h):

    queue       direction    what                      when
    act_up      host->dev    a microbatch's activation  one microbatch early
    act_down    dev->host    a microbatch's activation  one microbatch late
    param_up    host->dev    a stage's parameters       split over M windows
    grad_down   dev->host    a stage's gradients        split over M windows

`copy()` queues one tensor copy, `copy_many()` several under one fence, each
behind the fences it is given.  A stage's bulk traffic is packed into M windows
by `pack_lpt` and windowed behind activation copies by the one transfer path,
roundpipe/workers/transfers.py (docs/transfers.md).  Each returns fences (roundpipe.offload.fences) to wait on, to make a compute
stream wait on (`make_stream_wait`), or to record against arena blocks.

On a CUDA device the queues are four streams and copies are cudaMemcpyAsync;
pageable host memory works but is synchronous and slow, so host tensors should
come from a HostArena.  On "cpu" the host backend runs the same queues with
memcpy on worker threads (up and down directions in parallel, activation queue
first), which is how CI tests ordering, priority, packing and completion.

The engine keeps every tensor it was given referenced until the copy's fence
completes, so dropping a tensor right after submitting is safe, and an arena
block (or a CUDA caching-allocator block) under a copy cannot be reused before
the copy finished.  References are dropped lazily (every few submissions, or when
the in-flight list has doubled), so `record_into(arena, fence, tensors)` is there to make reuse
prompt, and for copies the engine did not issue use `HostArena.record_stream`.
"""
from __future__ import annotations

import enum
import threading
from typing import Iterable, Sequence

import torch

from roundpipe import _native
from roundpipe.core.checks import is_int
from roundpipe.offload.arena import HostArena
from roundpipe.offload.fences import check_fence


class Queue(str, enum.Enum):
    ACT_UP = "act_up"
    ACT_DOWN = "act_down"
    PARAM_UP = "param_up"
    GRAD_DOWN = "grad_down"

    @property
    def upload(self) -> bool:
        return self in (Queue.ACT_UP, Queue.PARAM_UP)


def _queue(value: "Queue | str") -> Queue:
    try:
        return Queue(value)
    except ValueError:
        raise ValueError(f"queue={value!r} is unknown; expected one of {[q.value for q in Queue]}") from None


def _check_tag(tag: object) -> None:
    if not is_int(tag):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not -(2**63) <= tag < 2**63:
        raise ValueError(f"tag={tag} must fit in 64 bits (signed)")


def _native_queue(q: Queue):
    return getattr(_native.require().CopyQueue, q.value)


def pack_lpt(sizes: Sequence[int], windows: int, align: int = 256) -> list[list[tuple[int, int, int]]]:
    """LPT packing of byte sizes into `windows` windows: per window, (tensor, offset, length) pieces.

    Tensors larger than ceil(total/windows) are first cut into near-equal pieces
    on `align`-byte boundaries; pieces go largest first to the least-loaded window.
    """
    sizes = list(sizes)
    for i, s in enumerate(sizes):
        if not is_int(s) or s < 0:
            raise ValueError(f"sizes[{i}]={s!r} must be a non-negative int")
    if not is_int(windows) or windows < 1:
        raise ValueError(f"windows={windows!r} must be an int >= 1")
    if not is_int(align) or align < 1:
        raise ValueError(f"align={align!r} must be an int >= 1")
    return _native.require().pack_lpt(sizes, windows, align)


# In-flight references are dropped once this many copies accumulated (and then whenever the
# list doubled): a stage's device weights must not outlive their copies by more than a few
# submissions, since a GPU holds only the running and the prefetched stage (tests/engine/test_memory.py).
_PRUNE_MIN = 8


class CopyEngine:
    """Four copy queues for one device (CUDA streams, or host worker threads for 'cpu')."""

    def __init__(self, device: str | torch.device = "cpu", *, threads_per_copy: int = 1,
                 streams: "Sequence[torch.cuda.Stream] | None" = None):
        C = _native.require()
        self.device = torch.device(device)
        if not is_int(threads_per_copy) or threads_per_copy < 1:
            raise ValueError(f"threads_per_copy={threads_per_copy!r} must be an int >= 1")
        if self.device.type == "cpu":
            if streams is not None:
                raise ValueError("streams are only meaningful for a CUDA device; got streams for device cpu")
            self._engine = C.HostCopyEngine(threads_per_copy)
        elif self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            handles = []
            if streams is not None:
                streams = list(streams)
                if len(streams) != 4 or not all(isinstance(s, torch.cuda.Stream) for s in streams):
                    raise ValueError("streams must be 4 torch.cuda.Stream objects (act_up, act_down, param_up, "
                                     f"grad_down); got {streams!r}")
                handles = [s.cuda_stream for s in streams]
            self._streams = streams  # kept alive: the engine borrows their handles
            self._engine = C.CudaCopyEngine(index, handles)
        else:
            raise ValueError(f"device={str(device)!r} must be 'cpu' or a CUDA device")
        self._inflight: list[tuple[object, tuple]] = []
        self._inflight_lock = threading.Lock()
        self._prune_at = _PRUNE_MIN

    @property
    def backend(self) -> str:
        """'host' or 'cuda'."""
        return self._engine.backend

    # -- validation ---------------------------------------------------------------------------
    def _check_pair(self, q: Queue, i: int, dst: object, src: object) -> tuple[int, int, int]:
        for name, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
        nd, ns = dst.numel() * dst.element_size(), src.numel() * src.element_size()
        if nd != ns:
            raise ValueError(f"dst[{i}] has {nd} bytes but src[{i}] has {ns}; a copy moves bytes unchanged")
        host, dev = (src, dst) if q.upload else (dst, src)
        host_name, dev_name = ("src", "dst") if q.upload else ("dst", "src")
        if host.device.type != "cpu":
            raise ValueError(f"{host_name}[{i}] must be a CPU tensor for queue {q.value}, got device {host.device}")
        if dev.device != self.device and not (self.device.type == "cpu" and dev.device.type == "cpu"):
            raise ValueError(f"{dev_name}[{i}] must be on {self.device} for queue {q.value}, got {dev.device}")
        d0, s0 = dst.data_ptr(), src.data_ptr()
        if nd and dst.device == src.device and d0 < s0 + nd and s0 < d0 + nd:
            raise ValueError(f"dst[{i}] and src[{i}] overlap in memory; a copy needs separate buffers")
        return d0, s0, nd

    def _fences(self, name: str, after) -> list:
        if after is None:
            return []
        if isinstance(after, _native.require().Fence):
            after = [after]
        if not isinstance(after, Iterable):
            raise TypeError(f"{name} must be a fence or an iterable of fences, got {type(after).__name__}")
        out = list(after)
        for i, f in enumerate(out):
            check_fence(f"{name}[{i}]", f)
        return out

    def _keep(self, fences: list, refs: tuple) -> None:
        # Tensors stay referenced until their copies completed.  Pruning polls every
        # fence, so it runs only when the list doubled since the last prune (amortised O(1)).
        with self._inflight_lock:
            self._inflight.extend((f, refs) for f in fences)
            if len(self._inflight) >= self._prune_at:
                self._inflight = [(f, r) for f, r in self._inflight if f.state == "pending"]
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._inflight))

    # -- submission ---------------------------------------------------------------------------
    def copy(self, queue: "Queue | str", dst: torch.Tensor, src: torch.Tensor, *, after=None, tag: int = -1):
        """Queues dst <- src (same bytes) on `queue` behind the fences in `after`; returns a fence."""
        return self.copy_many(queue, [dst], [src], after=after, tag=tag)

    def copy_many(self, queue: "Queue | str", dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *,
                  after=None, tag: int = -1):
        """Queues dsts[i] <- srcs[i] for all i as one submission with one fence."""
        q = _queue(queue)
        _check_tag(tag)
        dsts, srcs = list(dsts), list(srcs)
        if len(dsts) != len(srcs):
            raise ValueError(f"dsts has {len(dsts)} tensors but srcs has {len(srcs)}; they must pair up")
        ops = [self._check_pair(q, i, d, s) for i, (d, s) in enumerate(zip(dsts, srcs))]
        fence = self._engine.submit(_native_queue(q), ops,
                                    self._fences("after", after), tag)
        self._keep([fence], (dsts, srcs))
        return fence

    def synchronize(self) -> None:
        """Blocks until everything submitted has completed."""
        self._engine.synchronize()
        self.release_completed()

    def release_completed(self) -> None:
        """Drops the references to tensors whose copies have completed (e.g. when a stage ends)."""
        with self._inflight_lock:
            self._inflight = [(f, r) for f, r in self._inflight if f.state == "pending"]
            self._prune_at = max(_PRUNE_MIN, 2 * len(self._inflight))

    def record_into(self, arena: HostArena, fence, tensors: Sequence[torch.Tensor]) -> None:
        """Records `fence` against every arena tensor in `tensors` (others are skipped)."""
        for t in tensors:
            if arena.owns(t):
                arena.record(t, fence)

    # -- backend specifics --------------------------------------------------------------------
    def stream(self, queue: "Queue | str") -> "torch.cuda.ExternalStream":
        """The CUDA stream behind a queue (CUDA backend only)."""
        if self.backend != "cuda":
            raise ValueError(f"stream() needs a CUDA engine; this one is {self.backend!r}")
        q = _queue(queue)
        handle = self._engine.stream(_native_queue(q))
        return torch.cuda.ExternalStream(handle, device=self.device)

    def _host(self, what: str):
        if self.backend != "host":
            raise ValueError(f"{what}() exists on the host backend only; this engine is {self.backend!r}")
        return self._engine

    def pause(self) -> None:
        """Host backend: stop starting new copies (queued work waits for resume())."""
        self._host("pause").pause()

    def resume(self) -> None:
        self._host("resume").resume()

    def history(self) -> list[tuple[str, int]]:
        """Host backend: (queue, tag) of started submissions, in start order."""
        return self._host("history").history()
