"""CPU worker: a thread computing on the host, modelled as a device of its own.

Its "device memory" is a set of host tensors that only this worker computes
on, filled and drained through a host-backend CopyEngine (memcpy threads) with
the same queues, LPT windows and fences as a GPU's copy streams.  Compute is
synchronous on the worker thread, so "compute waits for a copy" is a host wait
on the copy's fence and the compute issued so far needs no fence.  Copies run
concurrently with compute, so a missing wait reads a half-copied tensor, and
the tests' random delays turn that into a wrong number.

Copies of at most `inline_copy_bytes` run on the worker thread itself (after
waiting for their fences) unless the test delay hook is on: a thread handoff
costs ~70 us on a small machine, more than the compute of a small stage
(see roundpipe/workers/transfers.py).  Set it to 0 to send everything through
the copy threads.

CPU workers take turns: each issues a whole stage-microbatch holding a
process-wide `Turn` and gives it back while it waits for another worker's
output.  They share one interpreter lock, so running them at once gains
nothing, while two threads alternating on every (GIL-releasing) torch call
doubled the engine's CPU time per stage-microbatch (246 against 138 us user
time, 16 trivial layers, 2 workers against 1, on the 2-core CI VM).  Layer
compute that took over `base.LONG_COMPUTE_S` last time runs outside the turn:
real work (matmuls that release the interpreter lock) still overlaps across
workers; holding the turn through it cost the tiny decoder a quarter of its
2-worker throughput.  Copies still run on the copy threads, outside any turn,
so a missing fence wait is caught as before.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch

from roundpipe.core.executor import waiting_for
from roundpipe.workers import strict
from roundpipe.workers.base import Alloc, Owns, Worker
from roundpipe.workers.ledger import WorkspaceTracker


class Turn:
    """A lock that its holder can give back around a wait and take again after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def _acquire(self) -> None:
        if not self._lock.acquire(blocking=False):   # contended: a stall report names the wait
            with waiting_for("the CPU workers' turn (another CPU worker holds it)"):
                self._lock.acquire()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()

    @contextlib.contextmanager
    def yielded(self) -> Iterator[None]:
        """Releases the turn for the body when this thread holds it; a no-op otherwise."""
        if self._owner != threading.get_ident():
            yield
            return
        self._owner = None
        self._lock.release()
        try:
            yield
        finally:
            self._acquire()
            self._owner = threading.get_ident()


class CpuWorker(Worker):
    inline_copy_bytes: int = 64 << 10
    lands_inline = True
    _turn = Turn()    # shared by every CPU worker of the process: they share the interpreter lock

    def turn(self) -> contextlib.AbstractContextManager:
        return self._turn.held()

    def yielded(self) -> contextlib.AbstractContextManager:
        return self._turn.yielded()

    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype, alloc: Alloc | None = None,
                 owns: Owns | None = None):
        super().__init__(device, name, compute_dtype, alloc, owns)
        self.copies.inline_bytes = self.inline_copy_bytes
        config = strict.current()
        self.strict = config is not None and self.copies.native
        if self.strict:   # the strict device model (strict.py): every copy late, on its queue's thread
            self.copies.inline_bytes = 0
            self.copies.strict = strict.StrictQueues(config, name, self._where, self.host_owns)
            self.stages_pageable = True   # as a CUDA worker does (Worker.upload_params)

    def _where(self) -> str:
        """The issuer of a copy, for the strict model's errors: worker, stage and microbatch."""
        task = self.stage
        if task is None:
            return f"worker {self.name} (between stages)"
        label, mbs, done = getattr(task, "label", task), getattr(task, "mbs", None), self.stage_mbs_done
        m = f", microbatch {mbs[done]}" if mbs is not None and done < len(mbs) else ""
        return f"worker {self.name}, stage {label}{m}"

    def executors(self) -> list:
        own = super().executors()
        return own + self.copies.strict.executors() if self.copies.strict is not None else own

    def close(self) -> None:
        super().close()
        if self.copies.strict is not None and not self.stalled:
            self.copies.strict.close()

    def _empty(self, shape: torch.Size, dtype: torch.dtype, queue: str) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if self.strict:   # fresh device memory holds garbage; the copy filling it is its queue's (CudaWorker._empty)
            strict.record(t, queue)
            strict.poison(t)
        return t

    def _read_by_copy(self, tensors, queue: str) -> None:
        if self.strict:   # where a CUDA worker calls record_stream (strict.py: StreamUseError)
            for t in tensors:
                strict.record(t, queue)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        h = super()._to_host(t)
        return strict.poison(h) if self.strict and t.device == self.device else h

    def set_cap(self, cap: int | None) -> None:
        """Its ledger is its device's memory: past the cap an allocation raises torch.OutOfMemoryError, as on a GPU."""
        super().set_cap(cap)
        self.ledger.cap = cap

    def _workspace_tracker(self) -> WorkspaceTracker | None:
        # Only when asked (Worker.records_workspace): the dispatch mode costs ~4-5 us per op, a
        # Linear+ReLU layer of width 16 went from 6.3 to 17.7 us under a mode that does nothing and
        # to 22.3 us with the tracking; tests/engine/test_memory.py, test_model.py and test_call_sequences.py
        # took 22.2 s instead of 17.5 s and `roundpipe train --steps 20` ran at 13,100 instead of
        # 15,000 tokens/s (best of two each, 2-core CI VM).
        return WorkspaceTracker(self.ledger, "cpu") if self.records_workspace else None

    def _compute_fence(self) -> None:
        return None

    def _compute_waits(self, fences: Sequence) -> None:
        for f in fences:
            if f is not None:
                f.wait()

    def scalar(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return t.detach().float().clone(), None
