"""The device-memory ledger of one worker: bytes held per category, now and at peak.

Every device buffer the engine makes or keeps on a worker is registered here
with its category:

    weights       a stage's uploaded parameters and buffers (Worker._empty, param_up)
    activations   stage inputs uploaded (act_up), outputs kept on the device for a
                  consumer on the same device, activation gradients handed on
    gradients     parameter gradients of a backward stage (fp32 accumulators included)
                  until their download has read them
    optimizer     fp32 masters and optimizer state the device step keeps on the worker
                  (roundpipe/engine/step/device_step.py)
    workspace     what the layer compute itself makes (CPU workers): autograd's saved
                  tensors, the recompute's intermediate activations, attention scores,
                  temporaries; recorded by `WorkspaceTracker` below

A buffer leaves the ledger when its storage dies, not when a Python name for
it goes away: a weak reference with a callback sits on the tensor's
`untyped_storage()` object, which PyTorch keeps for as long as the storage
lives (views, the copy engine's in-flight references and autograd's saved
tensors all keep it).  So a buffer that outlives its stage shows up as live
bytes after the call, on a CPU worker exactly as on a GPU, which is what
tests/engine/test_memory.py checks.  A storage is counted once, under the category
it was first registered with, except that workspace is the fallback: a
storage the compute made and the engine then keeps (an output kept on the
device, a parameter gradient autograd wrote) moves to the engine's category.

Workspace.  On CUDA `torch.cuda.memory_allocated` counts it (RoundPipe.memory_stats),
so only CPU workers record it, and only with `records_workspace = True` (its per-op
cost, measured in roundpipe/workers/cpu.py, is too high to pay always): while a
stage-microbatch's layers, loss or backward run (Worker.compute_span), a
`WorkspaceTracker` (a `TorchDispatchMode`) on the worker thread
registers the storage of every op output that does not alias an input (the op's
schema says which) and is not already in the ledger (uploaded weights and
inputs).  `peak_total` then models the live bytes of the GPU caching allocator
(not its reserved bytes: no rounding, no fragmentation).  The mode is
thread-local, so another worker's ops are never seen, and a CPU backward runs on
the calling thread (the autograd engine's CPU queue is driven by its caller), so
backward is covered (tests/workers/test_ledger.py).  TorchDispatchMode is PyTorch's
documented interposition point for aten ops ("Extending PyTorch", modes); it
lives in an underscore module, and torch 2.13 has no public alternative (a
TorchFunctionMode does not see the ops of backward or of composite functions).
Blind spots: a storage an op grows in place (`resize_`) keeps the size it had
when registered; storages made outside a compute span or inside its `untracked()`
part (the engine's own copies: a non-contiguous output made contiguous for its
download, the fp32 gradient accumulators) are registered by the engine under
their categories or not at all.

The cap.  With `cap` set (a CPU worker under `device_memory=`: the ledger is its
device's memory) a new storage that would take the live total past it raises
`torch.OutOfMemoryError`, the type a GPU's caching allocator raises, before it is
counted: the allocation fails as it would on the device, mid-compute, and what the
compute held so far dies with the failed stage (roundpipe/engine/calls/dispatcher.py).
A CUDA worker's ledger has no cap: the allocator enforces the device's own limit.
`fail_next()` is the test seam that makes the next new storage fail the same way.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("weights", "activations", "gradients", "optimizer", "workspace")


class DeviceLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(storage object) -> (category, bytes, weak reference keeping the death callback)
        self._live: dict[int, tuple[str, int, weakref.ref]] = {}
        # Keys of dead storages.  The callbacks only append here: they run inside any thread's
        # garbage collection, possibly while that thread holds this or another ledger's lock,
        # so taking a lock in them could deadlock.  The next call under the lock applies them.
        # A key is settled before any new storage is registered, so a reused id is never confused.
        self._dead: list[int] = []
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.cap: int | None = None   # enforced: a storage past it raises torch.OutOfMemoryError (see above)
        self._fail: str | None = None  # fail_next(): why the next new storage fails

    def fail_next(self, why: str | None = "injected") -> None:
        """Test seam: the next new storage registered raises torch.OutOfMemoryError (None disarms).

        Workers arm it for one part of their work (`Worker.inject_oom`); nothing else calls it."""
        with self._lock:
            self._fail = why

    @property
    def armed(self) -> bool:
        """fail_next() was called and its failure has not happened yet."""
        return self._fail is not None

    def _settle(self) -> None:
        """Applies the releases the callbacks queued (under the lock)."""
        dead = self._dead
        while dead:
            category, nbytes, _ = self._live.pop(dead.pop())
            self.current[category] -= nbytes

    def _register(self, storage: Any, category: str) -> None:
        """Registers a storage under `category` (under the lock); workspace moves to another category."""
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None:
            if entry[0] != "workspace" or category == "workspace":
                return
            old, nbytes, ref = entry   # made by compute, now kept by the engine
            self.current[old] -= nbytes
        else:
            nbytes = storage.nbytes()
            if self.cap is not None or self._fail is not None:
                self._check_room(category, nbytes)
            # weakref.ref with a callback: ~0.25 us against weakref.finalize's ~3.4 us (2-core CI VM)
            ref = weakref.ref(storage, lambda _, k=key, dead=self._dead: dead.append(k))
        self._live[key] = (category, nbytes, ref)
        cur = self.current
        cur[category] += nbytes
        if cur[category] > self.peak[category]:
            self.peak[category] = cur[category]
        total = cur["weights"] + cur["activations"] + cur["gradients"] + cur["optimizer"] + cur["workspace"]
        if total > self.peak_total:
            self.peak_total = total

    def _check_room(self, category: str, nbytes: int) -> None:
        """torch.OutOfMemoryError if `nbytes` more would pass the cap, or when a failure was injected."""
        held = sum(self.current.values())
        if self._fail is not None:
            why, self._fail = self._fail, None
            raise torch.OutOfMemoryError(
                f"out of device memory ({why}): tried to allocate {nbytes:,} bytes of {category} with "
                f"{held:,} bytes held" + (f" of a {self.cap:,}-byte cap" if self.cap is not None else ""))
        if held + nbytes > self.cap:
            raise torch.OutOfMemoryError(
                f"out of device memory: tried to allocate {nbytes:,} bytes of {category} with {held:,} of the "
                f"worker's {self.cap:,}-byte cap held ({', '.join(f'{k} {v:,}' for k, v in self.current.items())})")

    def track(self, t: torch.Tensor, category: str) -> torch.Tensor:
        """Registers t's storage under `category` until it dies (once per storage); returns t."""
        storage = t.untyped_storage()
        with self._lock:
            self._settle()
            self._register(storage, category)
        return t

    def track_workspace(self, tensors: list[torch.Tensor]) -> None:
        """Registers the storages of tensors compute just made as workspace, unless already registered."""
        with self._lock:
            self._settle()
            for t in tensors:
                self._register(t.untyped_storage(), "workspace")

    def live_bytes(self) -> int:
        with self._lock:
            self._settle()
            return sum(self.current.values())

    def reset_peak(self) -> None:
        with self._lock:
            self._settle()
            self.peak = dict(self.current)
            self.peak_total = sum(self.current.values())

    def stats(self) -> dict:
        """{"current": {category: bytes}, "peak": {...}, "peak_total": bytes, "buffers": count}."""
        with self._lock:
            self._settle()
            return {"current": dict(self.current), "peak": dict(self.peak), "peak_total": self.peak_total,
                    "buffers": len(self._live)}


# op -> (indices of its returns that are new tensors (no alias annotation), whether it returns one value)
_FRESH: dict[Any, tuple[tuple[int, ...], bool]] = {}


def _fresh_returns(func: Any) -> tuple[tuple[int, ...], bool]:
    returns = func._schema.returns
    fresh = tuple(i for i, r in enumerate(returns) if r.alias_info is None and "Tensor" in str(r.type))
    return fresh, len(returns) == 1


class WorkspaceTracker(TorchDispatchMode):
    """While entered on a thread: the storage of every new tensor an op returns on `device_type` is workspace.

    One per compute span (a mode instance keeps per-entry state).  `paused` (set through the span's
    `untracked()`) lets the engine run its own steps inside a span (publishing an activation
    allocates host staging) unseen."""

    def __init__(self, ledger: DeviceLedger, device_type: str) -> None:
        super().__init__()
        self.ledger, self.device_type, self.paused = ledger, device_type, False

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        fresh = _FRESH.get(func)
        if fresh is None:
            fresh = _FRESH[func] = _fresh_returns(func)
        indices, single = fresh
        if not indices:
            return out
        values = (out,) if single else out
        made = []
        for i in indices:
            v = values[i]
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type and not t.is_sparse:
                    made.append(t)
        if made:
            self.ledger.track_workspace(made)
        return out
