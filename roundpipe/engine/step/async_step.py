"""The per-layer protocol between workers and the host optimizer (docs/async_step.md).

A call is one `forward_backward` (training) or forward-only `model(...)`.  A
step is one `RoundPipe.step`.  Two host copies bridge workers and optimizer:
the G-copy (landed gradients -> `p.grad`) and the P-copy (fp32 masters -> the
low-precision upload copy workers read; the fused optimizer writes it in the
same pass as the update).  W_s are the weights after step s.

Which weights a call reads.  When step s is issued it opens a stale window of
k training calls, k = the number of training calls since step s-1 (at least
1): those calls still read W_(s-1), so with a regular loop every call of a
gradient-accumulation group sees the same one-step-old weights.  The window
closes early at the next step, at every sync point (`synchronize`,
`state_dict`, `load_state_dict`, a synchronous step, a forward-only call,
`close`); a call started after it closed reads W_s.

Calls in flight.  A training call returns once its loss is known; its last
backward stages, gradient landings and its end run under the next call (the
continuous pipeline), so several calls can be active at once (`CallState`,
begun and not ended).  They end in the order they began: every worker runs its
share of call t before its share of t+1.

Gradients.  Workers land a call's gradients in per-layer landing buffers,
which sum every call since the last G-copy (a parameter that got no gradient
keeps none).  A G-copy moves the sums into `p.grad` (or the held gradient the
fused step reads), once the calls it covers ended and after every step issued
before it has read (and cleared) the gradients.  One is issued when a training
call returns and no step still has to read gradients (it then waits for its
calls only), else just before the next step or at `synchronize`.

The orderings, per layer l (every wait points to something issued earlier,
so no cycle can form):

    upload(call reading W_v, l)  waits until the P-copies of steps 1..v of l are done
    P-copy / update(step s, l)   waits until its window is closed and no active call
                                 that reads an older version still has an upload of l
                                 to issue, and for those uploads' copies to complete
    update(step s, l)            also waits for the G-copies issued before step s
    G-copy(e, l)                 waits until the calls begun before e ended and the
                                 steps issued before e consumed p.grad(l)
    grad landing(call, l)        waits until the calls begun before it ended, for the
                                 G-copies issued before it, and for the earlier rounds
                                 of the same call (a fixed sum order)

State of one step, as the host thread takes it through (table in docs/async_step.md):

    issued --(window closed & uploads of l issued & fences done)--> gate open(l)
    gate open(l) --(G-copies before it done for l)--> updated(l) --> consumed(l), pcopied(l)
    all layers pcopied --> retired (lr scheduler stepped if the update succeeded)

An error in the optimizer never stops the protocol: the remaining layers of
that step still go through their gates (upload copy rewritten from the
masters, gradients consumed), so the next calls run; the error is re-raised
on the caller's thread at its next engine call (roundpipe/core/executor.py).

Time, N workers busy with call t+1 while the host thread steps after call t:

    workers : | F..B of t | F..B of t+1 (reads W_(s-1)) | F..B of t+2 (reads W_s)
    host    : |           | G(t) update+P-copy of step s, l=L-1..0, each as soon
                            as t+1 issued its last upload of l (tail layers first)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from roundpipe.core.errors import Aborted
from roundpipe.testing import delay_point

Waitable = Callable[[], None] | None


@dataclass
class StepRecord:
    index: int          # s: this step produces W_s
    readers_left: int   # training calls still to start that read W_(s-1); 0 once the window closed
    gcopies: int        # G-copy epochs issued before this step (it consumes their gradients)
    whole: bool = False  # its update is one pass over every layer before the gates (a torch optimizer)


@dataclass
class CallState:
    """One active call: the weights version it reads and its per-layer progress."""

    index: int                                   # calls begun before it, plus one
    training: bool
    version: int                                 # it reads W_version
    uploads_left: list[int]                      # uploads of each layer still to issue
    upload_waits: list[list[Callable[[], None]]]  # per layer: waits for its issued uploads' copies
    landed: list[int]                            # gradient rounds of each layer landed
    gcopies_before: int                          # G-copy epochs issued before it began
    ended: bool = False
    # set with `ended`: the G-copy thread waits on it alone, not woken by every other layer's progress
    ended_event: threading.Event = field(default_factory=threading.Event)


class LayerSync:
    """Per-layer counters and one condition variable implementing the orderings above."""

    def __init__(self, num_layers: int, groups: list[tuple[int, ...]] | None = None):
        L = num_layers
        self.cv = threading.Condition()
        self.L = L
        # per layer: the layers sharing a parameter with it, itself included (HostState.groups); every
        # ordering of a layer below holds for its whole group, since its step writes their shared weight
        self.groups = groups or [(l,) for l in range(L)]
        self.iteration = 0                  # calls begun
        self.steps_issued = 0
        self.latest: StepRecord | None = None
        self.calls_since_step = 0           # training calls since the last step (predicts the next window)
        self.pcopied = [0] * L              # steps whose update + upload copy of l is done
        self.consumed = [0] * L             # steps that have read and cleared p.grad of l
        self.gcopies_issued = 0
        self.gcopied = [0] * L              # G-copy epochs done, per layer
        self.steps_done = 0                 # steps whose job finished (lr scheduler stepped or error raised)
        self.active: list[CallState] = []   # calls begun and not ended, oldest first

    def _wait(self, ready: Callable[[], bool], abort: Callable[[], bool] | None) -> None:
        while not ready():
            if abort is not None and abort():
                raise Aborted()
            self.cv.wait(0.05)

    # ---- calls (caller thread begins, the call's last worker ends)
    def begin_call(self, training: bool, uploads_per_layer: list[int]) -> CallState:
        """Starts a call; it reads the weights version it is given."""
        with self.cv:
            self.iteration += 1
            s = self.latest
            if training and s is not None and s.readers_left > 0:
                s.readers_left -= 1
                version = s.index - 1
            else:
                version = self.steps_issued
            if training:
                self.calls_since_step += 1
            call = CallState(self.iteration, training, version, list(uploads_per_layer),
                             [[] for _ in range(self.L)], [0] * self.L, self.gcopies_issued)
            self.active.append(call)
            return call

    def end_call(self, call: CallState) -> None:
        with self.cv:
            call.ended = True
            self.active.remove(call)
            self.cv.notify_all()
        call.ended_event.set()

    def flush(self) -> None:
        """A sync point: the stale window closes, later calls read every issued step's weights."""
        with self.cv:
            if self.latest is not None:
                self.latest.readers_left = 0
            self.cv.notify_all()

    def settled(self, layer: int) -> bool:
        """No issued step still has to update or copy this layer (the host thread leaves it alone)."""
        with self.cv:
            return all(self.pcopied[k] == self.steps_issued for k in self.groups[layer])

    # ---- uploads (worker threads)
    def upload_ready(self, call: CallState, layer: int) -> bool:
        with self.cv:
            return all(self.pcopied[k] >= call.version for k in self.groups[layer])

    def wait_upload(self, call: CallState, layer: int, abort: Callable[[], bool] | None = None) -> None:
        with self.cv:
            self._wait(lambda: all(self.pcopied[k] >= call.version for k in self.groups[layer]), abort)

    def uploaded(self, call: CallState, layer: int, done: Waitable) -> None:
        with self.cv:
            call.uploads_left[layer] -= 1
            if done is not None:
                call.upload_waits[layer].append(done)
            self.cv.notify_all()

    # ---- gradient landings (worker threads)
    def wait_grad_write(self, call: CallState, layer: int, round_index: int,
                        abort: Callable[[], bool] | None = None) -> None:
        """Waits for the calls begun earlier to end, the G-copies issued before this call, and
        this call's earlier rounds of the layer."""
        with self.cv:
            ready = lambda: (self.active[0] is call and self.gcopied[layer] >= call.gcopies_before
                             and call.landed[layer] == round_index)
            if not ready():
                self.cv.notify_all()   # landings written without a wake-up (grad_written) may be what others wait for
            self._wait(ready, abort)

    def notify(self) -> None:
        """Wakes every waiter (after changes made with notify=False)."""
        with self.cv:
            self.cv.notify_all()

    def grad_written(self, call: CallState, layer: int) -> None:
        """Counts a landing without waking anyone: the lander calls notify() once for its stage's layers
        (each wake-up is a thread switch taken from the compute on a small machine)."""
        with self.cv:
            call.landed[layer] += 1

    # ---- G-copies (caller issues, G-copy thread completes)
    def issue_gcopy(self) -> tuple[int, list[CallState]]:
        """Registers a G-copy epoch; returns the number of steps that must consume p.grad before it
        and the calls it waits for (the active training calls, whose gradients it moves)."""
        with self.cv:
            self.gcopies_issued += 1
            return self.steps_issued, [c for c in self.active if c.training]

    def wait_calls(self, calls: list[CallState]) -> None:
        for c in calls:
            c.ended_event.wait()

    def gcopy_free(self) -> bool:
        """Every issued step has consumed every layer's p.grad: a G-copy issued now waits for nothing."""
        with self.cv:
            return all(c >= self.steps_issued for c in self.consumed)

    def wait_gcopy_ready(self, after_steps: int, pending: set[int]) -> list[int]:
        """The layers of `pending` (at least one, tail first) whose p.grad every step issued before the
        G-copy has consumed."""
        with self.cv:
            while True:
                ready = [l for l in sorted(pending, reverse=True)
                         if all(self.consumed[k] >= after_steps for k in self.groups[l])]
                if ready:
                    return ready
                self.cv.wait(0.05)

    def wait_all_consumed(self, after_steps: int) -> None:
        """Until every step issued before a G-copy has consumed the p.grad of every layer."""
        with self.cv:
            while not all(c >= after_steps for c in self.consumed):
                self.cv.wait(0.05)

    def gcopy_done(self, layers: list[int]) -> None:
        """The G-copies of `layers` are done (one wake-up for all of them)."""
        with self.cv:
            for layer in layers:
                self.gcopied[layer] += 1
            self.cv.notify_all()

    # ---- steps (caller issues, host thread completes)
    def new_step(self, asynchronous: bool, whole: bool = False, window: int | None = None) -> StepRecord:
        """Registers a step after its G-copy; a synchronous step opens no stale window.  `window`
        overrides the number of calls that still read the old weights (a step restored from a
        checkpoint, roundpipe/engine/state/checkpoint.py)."""
        with self.cv:
            if self.latest is not None:
                self.latest.readers_left = 0
            k = (max(1, self.calls_since_step) if window is None else window) if asynchronous else 0
            self.calls_since_step = 0
            self.steps_issued += 1
            rec = self.latest = StepRecord(self.steps_issued, k, self.gcopies_issued, whole)
            self.cv.notify_all()
            return rec

    def _gate(self, rec: StepRecord, layer: int) -> bool:
        if rec.readers_left > 0:
            return False
        return all(c.uploads_left[k] == 0 for c in self.active if c.version < rec.index for k in self.groups[layer])

    def wait_gate(self, rec: StepRecord, pending: set[int]) -> tuple[int, list[Callable[[], None]]]:
        """Blocks until one layer of `pending` may be overwritten; returns it and the upload copies to wait for."""
        with self.cv:
            while True:
                for l in sorted(pending, reverse=True):
                    if self._gate(rec, l):
                        return l, [w for c in self.active if c.version < rec.index for k in self.groups[l]
                                   for w in c.upload_waits[k]]
                self.cv.wait(0.05)

    def open_gates(self, rec: StepRecord, candidates: set[int], with_grads: bool) -> list[tuple[int, list]]:
        """The layers of `candidates` (tail first) whose gate is open now and, with_grads, whose p.grad
        holds every gradient issued before the step; with the upload copies to wait for, as wait_gate."""
        with self.cv:
            return [(l, [w for c in self.active if c.version < rec.index for k in self.groups[l]
                         for w in c.upload_waits[k]])
                    for l in sorted(candidates, reverse=True)
                    if self._gate(rec, l) and not (with_grads and any(self.gcopied[k] < rec.gcopies
                                                                      for k in self.groups[l]))]

    def layers_done(self, layers: list[int], consumed: bool, pcopied: bool) -> None:
        """The step read and cleared the layers' p.grad (`consumed`) and/or wrote their upload copies
        (`pcopied`); one wake-up for all of them."""
        with self.cv:
            for layer in layers:
                self.consumed[layer] += consumed
                self.pcopied[layer] += pcopied
            self.cv.notify_all()

    def wait_grads(self, rec: StepRecord, layer: int) -> None:
        """Waits until p.grad of the layer holds every gradient issued before the step."""
        with self.cv:
            self._wait(lambda: all(self.gcopied[k] >= rec.gcopies for k in self.groups[layer]), None)

    def step_finished(self) -> None:
        with self.cv:
            self.steps_done += 1
            self.cv.notify_all()

    # ---- checkpoints (caller thread, no call active)
    def wait_settled(self) -> StepRecord | None:
        """Waits until every issued G-copy and step is done, except a step whose stale window is
        still open: it cannot update a layer before the calls that read the old weights have
        begun.  Returns that step (None if there is none); if it is a whole-model update, its
        one pass (which runs before the gates) is done too.  Nothing is issued or closed, so
        waiting here does not change what later calls compute."""
        with self.cv:
            def settled() -> bool:
                s = self.latest
                open_window = s is not None and s.readers_left > 0 and self.steps_done < s.index
                if self.steps_done < self.steps_issued - open_window:
                    return False
                if any(g < self.gcopies_issued for g in self.gcopied):
                    return False
                return not (open_window and s.whole and any(c < s.index for c in self.consumed))
            self._wait(settled, None)
            s = self.latest
            return s if s is not None and s.readers_left > 0 and self.steps_done < s.index else None


def run_gcopy(sync: LayerSync, issued: tuple[int, list[CallState]], gcopy: Callable[[int], None],
              reduce: Callable[[], None] | None = None) -> None:
    """G-copy thread job: once its calls ended, each layer's landed gradients into p.grad as soon
    as the steps issued before it consumed the layer's.  `reduce` (data parallelism) first
    replaces every layer's landed sums by their average over the ranks, once those steps are done
    with every layer's: it makes a new fp32 set (4 bytes per parameter), which beside the one an
    earlier asynchronous step still reads would hold two at once, more than the arena reserves
    (HostState.reserve_gradients; measured with rp AdamW on 2 ranks: 12.3 bytes per parameter of
    arena instead of 10.0, bench/ddp.py --memory).  If that or a layer's copy fails, nothing more
    is moved, every layer is still counted (so no step waits forever) and the error is raised
    (tests/engine/test_async_step.py)."""
    after_steps, calls = issued
    sync.wait_calls(calls)
    error: BaseException | None = None
    if reduce is not None:
        sync.wait_all_consumed(after_steps)
        try:
            reduce()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the protocol went on
            error = e
    pending = set(range(sync.L))
    while pending:
        ready = sync.wait_gcopy_ready(after_steps, pending)
        try:
            for layer in ready:
                if error is None:
                    try:
                        gcopy(layer)
                    except BaseException as e:  # noqa: BLE001 - every layer is still counted, then re-raised
                        error = e
        finally:
            pending.difference_update(ready)
            sync.gcopy_done(ready)
    if error is not None:
        raise error


class StepFns:
    """What one step does, as the protocol calls it (built by roundpipe/engine/step/optimizer_step.py).

      prepare()   runs once every layer's gradients are in p.grad, before any layer is
                  updated (a torch optimizer's whole step, the global gradient norm), or None
      whole       prepare() is the whole update and consumed every p.grad (torch optimizer)
      update(l)   updates layer l and writes its upload copy (fused per-layer path), or
                  only writes the upload copy (after a whole update)
      update_many(ls)  update() of several layers at once (one optimizer pass), or None
      pcopy(l)    rewrites layer l's upload copy from the masters (after an error)
      clear(l)    clears layer l's p.grad
      after()     runs once the update succeeded on every layer (the lr scheduler), or None
      in_place    the whole update writes masters that are their own upload copies
                  (HostState.in_place): it waits for every layer's gate first, so no worker
                  reads a weight it is writing (the overlap of a per-layer update is lost)
    """

    def __init__(self, prepare: Callable[[], None] | None, whole: bool, update: Callable[[int], None],
                 pcopy: Callable[[int], None], clear: Callable[[int], None], after: Callable[[], None] | None,
                 in_place: bool = False, update_many: Callable[[list[int]], None] | None = None):
        self.prepare, self.whole, self.update, self.pcopy, self.clear, self.after = \
            prepare, whole, update, pcopy, clear, after
        self.in_place = whole and in_place
        self.update_many = update_many

    @property
    def before_gates(self) -> bool:
        """Whether the whole update runs before the gates (a pending one is then a copy-only step)."""
        return self.whole and not self.in_place


def run_step(sync: LayerSync, rec: StepRecord, fns: StepFns) -> None:
    """Host-thread job: one step, each layer updated (or copied) once its gate opens.

    Layers go in the order their gates open (tail first during the next call's backward).
    After the first error no layer is updated any more, but every layer still passes its
    gate, gets its upload copy rewritten from its masters, has its gradients cleared and is
    counted, so the protocol goes on; the error is raised at the end.
    """
    try:
        _run_step(sync, rec, fns)
    finally:
        sync.step_finished()


def _run_step(sync: LayerSync, rec: StepRecord, fns: StepFns) -> None:
    error: BaseException | None = None
    cleared = False
    try:
        delay_point("optimizer")
        if fns.prepare is not None:
            for l in range(sync.L):
                sync.wait_grads(rec, l)
            gates = set(range(sync.L)) if fns.in_place else set()
            while gates:   # every gate first: the update writes the upload copies themselves
                layer, waits = sync.wait_gate(rec, gates)
                for w in waits:
                    w()
                gates.discard(layer)
            try:
                fns.prepare()
            finally:
                if fns.whole:   # p.grad was read; later G-copies may refill it
                    for l in range(sync.L):
                        fns.clear(l)
                    sync.layers_done(list(range(sync.L)), consumed=True, pcopied=False)
                    cleared = True
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the protocol went on
        error = e
    pending = set(range(sync.L))
    while pending:
        layer, waits = sync.wait_gate(rec, pending)
        batch, layers = [(layer, waits)], [layer]
        try:
            if not cleared:
                sync.wait_grads(rec, layer)
            if fns.update_many is not None and error is None:   # every other layer ready now: one optimizer pass
                batch += sync.open_gates(rec, pending - {layer}, with_grads=not cleared)
                layers = [l for l, _ in batch]
            for _, ws in batch:
                for w in ws:
                    w()
            if error is None:
                try:
                    fns.update(layer) if len(batch) == 1 else fns.update_many(layers)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    error = e
            if error is not None:
                for l in layers:
                    fns.pcopy(l)
        finally:
            for l in layers:
                if not cleared:
                    fns.clear(l)
                pending.discard(l)
            sync.layers_done(layers, consumed=not cleared, pcopied=True)
    if error is not None:
        raise error
    if fns.after is not None:
        fns.after()
