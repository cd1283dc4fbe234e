"""The per-layer event protocol between workers and the host optimizer (DESIGN.md 3.2).

Iteration j is one `forward_backward` (or forward-only) call.  Two host copies
bridge workers and optimizer, and four per-layer orderings make the
asynchronous step exactly one step stale with no torn weights:

    P-copy(step s, layer l)   waits until the uploads of l by the iteration allowed
                              to read the old weights (the one after s was issued)
                              have finished, or until a sync point flushes
    upload(iteration j, l)    waits for the P-copies of every step that iteration j
                              must see (all steps issued before iteration j-1 ended)
    G-copy(iteration j, l)    runs after iteration j landed l's gradients, and after
                              the optimizer step of iteration j-1 (FIFO host thread)
    grad write(j+1, l)        waits until G-copy(j, l) has moved the gradients out

Time, N workers busy with iteration j+1 while the host thread steps iteration j:

    workers : | F..B of j | F..B of j+1 (uploads W_j) | F..B of j+2 (uploads W_j+1)
    host    : |           | G(j) step(j) P-copy l=L-1..0 -> each as soon as j+1's
                            last upload of l is done (tail layers first)

Everything is per layer with one condition variable, so layer 0 of j+2 can
start while the deep layers of step j+1 are still being copied.  The host
thread (a roundpipe.executor.SerialExecutor) runs G-copies, optimizer steps
and P-copies in FIFO order; its errors are re-raised in the caller at the next
call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from roundpipe.testing import delay_point

Waitable = Callable[[], None] | None


class Aborted(Exception):
    """Internal: a wait gave up because the call was aborted."""


@dataclass
class _StepRecord:
    stale_iter: int | None   # iteration that still reads the old weights; None once flushed
    pcopied: int = 0         # layers whose P-copy is done


class LayerSync:
    """Per-layer counters and one condition variable implementing the orderings above."""

    def __init__(self, num_layers: int):
        self.cv = threading.Condition()
        self.L = num_layers
        self.iteration = 0
        self.running = False
        self.uploads_left = [0] * num_layers
        self.upload_waits: list[list[Callable[[], None]]] = [[] for _ in range(num_layers)]
        self.pcopied = [0] * num_layers          # P-copies done per layer, over all steps
        self.steps: list[_StepRecord] = []       # steps whose P-copies are not all done
        self.retired = 0                         # steps with all P-copies done
        self.required = 0                        # P-copies per layer the running iteration must see
        self.landed = [0] * num_layers           # gradient downloads landed this iteration
        self.gcopy_pending = [False] * num_layers

    def _wait(self, ready: Callable[[], bool], abort: Callable[[], bool] | None) -> None:
        while not ready():
            if abort is not None and abort():
                raise Aborted()
            self.cv.wait(0.05)

    # ---- iteration boundaries (caller thread)
    def begin_iteration(self, uploads_per_layer: list[int]) -> None:
        with self.cv:
            assert not self.running
            self.iteration += 1
            self.running = True
            self.uploads_left = list(uploads_per_layer)
            self.upload_waits = [[] for _ in range(self.L)]
            self.landed = [0] * self.L
            self.required = self.retired + sum(1 for s in self.steps if s.stale_iter != self.iteration)

    def end_iteration(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify_all()

    # ---- uploads (worker threads)
    def wait_upload(self, layer: int, abort: Callable[[], bool] | None = None) -> None:
        with self.cv:
            self._wait(lambda: self.pcopied[layer] >= self.required, abort)

    def upload_ready(self, layer: int) -> bool:
        with self.cv:
            return self.pcopied[layer] >= self.required

    def uploaded(self, layer: int, done: Waitable) -> None:
        with self.cv:
            self.uploads_left[layer] -= 1
            if done is not None:
                self.upload_waits[layer].append(done)
            self.cv.notify_all()

    # ---- gradient downloads (worker threads)
    def wait_grad_write(self, layer: int, round_index: int, abort: Callable[[], bool] | None = None) -> None:
        """Waits for the G-copy of the previous iteration and for earlier rounds' writes of this one."""
        with self.cv:
            self._wait(lambda: not self.gcopy_pending[layer] and self.landed[layer] == round_index, abort)

    def grad_written(self, layer: int) -> None:
        with self.cv:
            self.landed[layer] += 1
            self.cv.notify_all()

    def mark_gcopy_pending(self, layers: list[int]) -> None:
        with self.cv:
            for l in layers:
                self.gcopy_pending[l] = True

    def gcopy_done(self, layer: int) -> None:
        with self.cv:
            self.gcopy_pending[layer] = False
            self.cv.notify_all()

    # ---- optimizer steps (caller thread issues, host thread completes)
    def new_step(self) -> _StepRecord:
        with self.cv:
            rec = _StepRecord(stale_iter=self.iteration + 1)
            self.steps.append(rec)
            return rec

    def flush(self) -> None:
        """A sync point: no later iteration may read the weights of pending steps' predecessors."""
        with self.cv:
            for s in self.steps:
                s.stale_iter = None
            self.cv.notify_all()

    def _pcopy_gate(self, rec: _StepRecord, layer: int) -> bool:
        j = rec.stale_iter
        return (j is None or self.iteration > j
                or (self.iteration == j and (not self.running or self.uploads_left[layer] == 0)))

    def wait_pcopy_gate(self, rec: _StepRecord, pending: set[int]) -> tuple[int, list[Callable[[], None]]]:
        """Blocks until one layer of `pending` may be P-copied; returns it and the upload waits to honour."""
        with self.cv:
            while True:
                for l in sorted(pending, reverse=True):
                    if self._pcopy_gate(rec, l):
                        return l, list(self.upload_waits[l]) if rec.stale_iter == self.iteration else []
                self.cv.wait(0.05)

    def pcopy_done(self, rec: _StepRecord, layer: int) -> None:
        with self.cv:
            self.pcopied[layer] += 1
            rec.pcopied += 1
            if rec.pcopied == self.L:
                self.steps.remove(rec)
                self.retired += 1
            self.cv.notify_all()


def run_step(sync: LayerSync, rec: _StepRecord, step_all: Callable[[], None] | None,
             per_layer: Callable[[int], None], clear_grads: Callable[[int], None]) -> None:
    """Host-thread job: one optimizer step, with each layer's upload copy written once its gate opens.

    Two shapes of optimizer fit this seam:
      torch optimizer / callable   step_all() updates every master, per_layer(l) is the P-copy
      fused per-layer step         step_all is None, per_layer(l) updates layer l's masters and
                                   writes its upload copy in one pass (so it, too, waits for the gate)
    Layers go in the order their gates open (tail first during the next iteration's backward).
    """
    pending = set(range(sync.L))
    try:
        delay_point("optimizer")
        if step_all is not None:
            step_all()
    finally:
        # Even after a failed step the upload copies must follow the masters and the records
        # must retire, or the next iteration would wait forever.
        while pending:
            layer, waits = sync.wait_pcopy_gate(rec, pending)
            for w in waits:
                w()
            try:
                per_layer(layer)
                clear_grads(layer)
            finally:
                pending.discard(layer)
                sync.pcopy_done(rec, layer)
