"""The per-layer event protocol between workers and the host optimizer (DESIGN.md 3.2).

Iteration j is one `forward_backward` (or forward-only) call.  Two host copies
bridge workers and optimizer, and four per-layer orderings make the
asynchronous step exactly one step stale with no torn weights:

    P-copy(step s, layer l)   waits until the uploads of l by the iterations allowed
                              to read the old weights (the next k calls after s, k =
                              calls per step so far: 1 without gradient accumulation)
                              have finished, or until the next step() or a sync point
    upload(iteration j, l)    waits for the P-copies of every step whose stale window
                              ended before j
    G-copy(iteration j, l)    runs after iteration j landed l's gradients, and after
                              every step issued before it has read (and cleared) l's p.grad
    step(s) reads p.grad(l)   after every G-copy issued before s
    grad write(j+1, l)        waits until G-copy(j, l) has moved the gradients out

Time, N workers busy with iteration j+1 while the host thread steps iteration j:

    workers : | F..B of j | F..B of j+1 (uploads W_j) | F..B of j+2 (uploads W_j+1)
    host    : |           | G(j) step(j) P-copy l=L-1..0 -> each as soon as j+1's
                            last upload of l is done (tail layers first)

Everything is per layer with one condition variable, so layer 0 of j+2 can
start while the deep layers of step j+1 are still being copied.  Steps (with
their P-copies) run in order on one host thread and G-copies on another
(roundpipe.executor.SerialExecutor), so a G-copy never queues behind a P-copy
that waits for a later call; every dependency above points to something issued
earlier, hence no deadlock.  Host-thread errors are re-raised in the caller at
its next call.
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
    stale_until: int | None  # last iteration that still reads the old weights; None once flushed
    need_gcopies: list[int]  # per layer: G-copies issued before this step, which it must see
    after_steps: int         # steps issued before this one
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
        self.gcopies_issued = [0] * num_layers
        self.gcopies_done = [0] * num_layers
        self.consumed = [0] * num_layers         # steps that have read (and cleared) p.grad, per layer
        self.steps_issued = 0
        self.iter_at_last_step = 0

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
            self.required = self.retired + sum(1 for s in self.steps
                                               if s.stale_until is None or s.stale_until < self.iteration)

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

    def issue_gcopy(self, layers: list[int]) -> int:
        """Marks the layers' landed gradients as waiting for their G-copy; returns the steps it must follow."""
        with self.cv:
            for l in layers:
                self.gcopy_pending[l] = True
                self.gcopies_issued[l] += 1
            return self.steps_issued

    def wait_gcopy_ready(self, after_steps: int, pending: set[int]) -> int:
        """A layer of `pending` whose p.grad every step issued before the G-copy has consumed."""
        with self.cv:
            while True:
                for l in sorted(pending):
                    if self.consumed[l] >= after_steps:
                        return l
                self.cv.wait(0.05)

    def gcopy_done(self, layer: int) -> None:
        with self.cv:
            self.gcopy_pending[layer] = False
            self.gcopies_done[layer] += 1
            self.cv.notify_all()

    def wait_grads(self, rec: _StepRecord, layer: int) -> None:
        """Waits until p.grad of the layer holds every gradient issued before the step."""
        with self.cv:
            self._wait(lambda: self.gcopies_done[layer] >= rec.need_gcopies[layer], None)

    def grads_consumed(self, layer: int) -> None:
        with self.cv:
            self.consumed[layer] += 1
            self.cv.notify_all()

    # ---- optimizer steps (caller thread issues, host thread completes)
    def new_step(self) -> _StepRecord:
        """Registers a step; the next k calls still read the old weights, k = calls per step so far.

        k is the number of calls between the previous two steps (gradient accumulation), so with
        a regular loop every call of a group sees the same, one-step-old weights.  A step issued
        earlier than predicted ends the previous step's stale window at once.
        """
        with self.cv:
            k = max(1, self.iteration - self.iter_at_last_step)
            for s in self.steps:
                if s.stale_until is not None and s.stale_until > self.iteration:
                    s.stale_until = self.iteration
            rec = _StepRecord(self.iteration + k, list(self.gcopies_issued), self.steps_issued)
            self.steps_issued += 1
            self.steps.append(rec)
            self.iter_at_last_step = self.iteration
            self.cv.notify_all()
            return rec

    def flush(self) -> None:
        """A sync point: no later iteration may read the weights of pending steps' predecessors."""
        with self.cv:
            for s in self.steps:
                s.stale_until = None
            self.cv.notify_all()

    def _pcopy_gate(self, rec: _StepRecord, layer: int) -> bool:
        j = rec.stale_until
        return (j is None or self.iteration > j
                or (self.iteration == j and (not self.running or self.uploads_left[layer] == 0)))

    def wait_pcopy_gate(self, rec: _StepRecord, pending: set[int]) -> tuple[int, list[Callable[[], None]]]:
        """Blocks until one layer of `pending` may be P-copied; returns it and the upload waits to honour."""
        with self.cv:
            while True:
                for l in sorted(pending, reverse=True):
                    if self._pcopy_gate(rec, l):
                        return l, list(self.upload_waits[l]) if rec.stale_until == self.iteration else []
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
      torch optimizer / callable   step_all() reads every p.grad and updates every master (the
                                   gradients are cleared right after); per_layer(l) is the P-copy
      fused per-layer step         step_all is None, per_layer(l) reads layer l's gradients,
                                   updates its masters and writes its upload copy in one pass (so
                                   it, too, waits for the layer's gate)
    Layers go in the order their gates open (tail first during the next iteration's backward).
    After a layer's gradients are consumed, the G-copy of a later call may refill p.grad.
    """
    pending = set(range(sync.L))
    try:
        delay_point("optimizer")
        if step_all is not None:
            for l in range(sync.L):
                sync.wait_grads(rec, l)
            try:
                step_all()
            finally:
                for l in range(sync.L):
                    clear_grads(l)
                    sync.grads_consumed(l)
    finally:
        # Even after a failed step the upload copies must follow the masters and the records
        # must retire, or the next iteration would wait forever.
        while pending:
            layer, waits = sync.wait_pcopy_gate(rec, pending)
            for w in waits:
                w()
            try:
                if step_all is None:
                    sync.wait_grads(rec, layer)
                per_layer(layer)
            finally:
                if step_all is None:
                    clear_grads(layer)
                    sync.grads_consumed(layer)
                pending.discard(layer)
                sync.pcopy_done(rec, layer)


def run_gcopy(sync: LayerSync, after_steps: int, gcopy: Callable[[int], None]) -> None:
    """G-copy thread job: each layer's landed gradients into p.grad once earlier steps consumed it."""
    pending = set(range(sync.L))
    while pending:
        layer = sync.wait_gcopy_ready(after_steps, pending)
        try:
            gcopy(layer)
        finally:
            pending.discard(layer)
            sync.gcopy_done(layer)
