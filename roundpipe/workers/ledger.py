"""The device-memory ledger of one worker: bytes held per category, now and at peak.

Every device buffer the engine makes or keeps on a worker is registered here
with its category:

    weights       a stage's uploaded parameters and buffers (Worker._empty, param_up)
    activations   stage inputs uploaded (act_up), outputs kept on the device for a
                  consumer on the same device, activation gradients handed on
    gradients     parameter gradients of a backward stage (fp32 accumulators included)
                  until their download has read them

A buffer leaves the ledger when its storage dies, not when a Python name for
it goes away: the finalizer sits on the tensor's `untyped_storage()` object,
which PyTorch keeps for as long as the storage lives (views, the copy
engine's in-flight references and autograd's saved tensors all keep it).  So
a buffer that outlives its stage shows up as live bytes after the call, on a
CPU worker exactly as on a GPU, which is what tests/test_memory.py checks.
Compute workspace (autograd's saved tensors, temporaries) is not registered;
on CUDA `torch.cuda.memory_allocated` counts it (RoundPipe.memory_stats).
"""
from __future__ import annotations

import collections
import threading
import weakref

import torch

CATEGORIES = ("weights", "activations", "gradients")


class DeviceLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, int]] = {}   # id(storage object) -> (category, bytes)
        # Keys of dead storages.  Finalizers only append here: they run inside any thread's
        # garbage collection, possibly while that thread holds this or another ledger's lock,
        # so taking a lock in them could deadlock.  The next call under the lock applies them.
        self._dead: collections.deque[int] = collections.deque()
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0

    def _settle(self) -> None:
        """Applies the releases the finalizers queued (under the lock)."""
        while self._dead:
            category, nbytes = self._live.pop(self._dead.popleft())
            self.current[category] -= nbytes

    def track(self, t: torch.Tensor, category: str) -> torch.Tensor:
        """Registers t's storage under `category` until it dies (once per storage); returns t."""
        storage = t.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            self._settle()
            if key in self._live:
                return t
            self._live[key] = (category, nbytes)
            self.current[category] += nbytes
            self.peak[category] = max(self.peak[category], self.current[category])
            self.peak_total = max(self.peak_total, sum(self.current.values()))
        weakref.finalize(storage, self._dead.append, key)
        return t

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
