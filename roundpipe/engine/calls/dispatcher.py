"""Round-robin dispatch of stages over the worker pool (docs/architecture.md, "Computation dispatch").

The slot sequence of one round is F1..Fk, B1(fused)..Bm.  Slot i of the call
goes to worker (g0 + i) mod N and that worker runs every microbatch of the
round through the slot, in order.  g0 is carried across calls, so the
rotation continues where the previous call stopped.  A call with M
microbatches runs ceil(M / R) rounds of R (default N + 1, the smallest count
with no structural bubble); a later round's slots continue the numbering.

Example, N = 3 workers, slots F1 F2 B1* B2 B3, g0 = 0, R = 4 microbatches:

    worker 0 : F1 m0 m1 m2 m3 |            B2 m0 m1 m2 m3
    worker 1 :    F2 m0 m1 m2 m3 |            B3 m0 m1 m2 m3
    worker 2 :       B1* m0 m1 m2 m3                        (next call starts at g0 = 5 % 3)

Every dependency points to a lower slot (the previous stage's output of the
same microbatch, the previous round's buffers and gradient writes of the same
layer, the previous call's optimizer protocol), and each worker runs its slots
in increasing order, so the schedule cannot deadlock.  The fences between
stages are waits on the board (roundpipe/engine/calls/board.py) and on the per-layer
protocol (roundpipe/engine/step/async_step.py).

`default_plan` is the fixed rule used when planning is switched off
(`PlanningConfig(enabled=False)`); by default the plan comes from the
partitioner and follows the profiled costs (roundpipe/engine/autoplan.py).
"""
from __future__ import annotations

import threading
from typing import Callable

from roundpipe.core.errors import Aborted
from roundpipe.engine.calls.context import CallContext
from roundpipe.engine.calls.stage import Consumer, StageTask, run_stage
from roundpipe.planner.plan import Plan
from roundpipe.workers.base import Worker


def default_plan(num_layers: int, num_workers: int) -> Plan:
    """About three forward layers per backward layer, one-backward-stage fused tail, <= ~16 backward stages."""
    per_stage = max(1, -(-num_layers // 16))
    return Plan.uniform(num_layers, backward_per_stage=per_stage, forward_ratio=3)


def slot_kinds(plan: Plan, training: bool) -> list[tuple[str, range]]:
    if training:
        return [("F", r) for r in plan.forward] + [("fused", plan.fused)] + [("B", r) for r in plan.backward[1:]]
    return [("F", r) for r in plan.forward] + [("F", plan.fused)]


def saved_points(plan: Plan, training: bool) -> frozenset[int]:
    """Layer indices whose input is a stage input (kept for a consumer, RNG reseeded there)."""
    starts = {r.start for r in plan.forward} | {plan.fused.start}
    if training:
        starts |= {r.start for r in plan.backward}
    return frozenset(starts)


class Schedule:
    """The per-worker slot lists of one call."""

    def __init__(self, plan: Plan, training: bool, num_mb: int, round_size: int, workers: list[Worker], g0: int):
        kinds = slot_kinds(plan, training)
        self.points = saved_points(plan, training)
        self.num_layers = plan.num_layers
        n = len(workers)
        rounds = [list(range(r, min(num_mb, r + round_size))) for r in range(0, num_mb, round_size)]
        self.tasks: dict[str, list[StageTask]] = {w.name: [] for w in workers}
        self.by_name = {w.name: w for w in workers}
        self.uploads = [0] * plan.num_layers
        self.input_consumers = 0
        slot = g0
        for ri, mbs in enumerate(rounds):
            placed = []
            for kind, r in kinds:
                placed.append((kind, r, workers[slot % n], slot))
                slot += 1
                for l in r:
                    self.uploads[l] += 1
            for kind, r, w, s in placed:
                task = StageTask(kind, r, ri, s - g0, mbs, last_round=ri == len(rounds) - 1)
                if kind == "F":
                    for b in [b for b in self.points if r.start < b <= r.stop] + [r.stop]:
                        task.consumers[b] = self._readers(placed, b)
                elif r.start > 0:
                    task.consumers[r.start] = [Consumer(w2, True) for k2, r2, w2, _ in placed
                                               if k2 == "B" and r2.stop == r.start]
                self.tasks[w.name].append(task)
            if ri == 0:
                self.input_consumers = len(self._readers(placed, 0))
        self.next_g0 = slot
        self.fits_checked = False   # set by RoundPipe once its stages were checked against the device caps
        self.predicted: dict[str, int] = {}   # worker name -> predicted peak device bytes (device_memory.PeakPredictions)

    @staticmethod
    def _readers(placed: list, b: int) -> list[Consumer]:
        return [Consumer(w, kind != "B") for kind, r, w, _ in placed if r.start == b]


class CallRun:
    """One call's work on the workers: how many are still at it, the first error, the end.

    `on_end(run)` runs once, on the thread of the last worker to finish (or the caller's, when
    work was never handed out); the call counts as finished only once it returned."""

    def __init__(self, ctx: CallContext, workers: int, on_end: Callable[["CallRun"], None]):
        self.ctx = ctx
        self.cv = threading.Condition()
        self.left = workers
        self.ended = False
        self.error: BaseException | None = None
        self._on_end = on_end
        self._watchers: list["CallRun"] = []   # later calls waiting on this one's end or error

    def watch(self, earlier: "CallRun") -> None:
        """Wakes this run's `wait` when `earlier` fails or ends (its `until` may test them)."""
        with earlier.cv:
            earlier._watchers.append(self)

    def _wake_watchers(self) -> None:
        with self.cv:
            watchers = list(self._watchers)
        for w in watchers:
            w.poke()

    @property
    def finished(self) -> bool:
        with self.cv:
            return self.ended

    @property
    def failed(self) -> bool:
        """Met an error (its other workers may still be stopping)."""
        with self.cv:
            return self.error is not None

    @property
    def ok(self) -> bool:
        """Finished without an error or an abort (read after the end)."""
        return self.error is None and not self.ctx.board.aborted

    def fail(self, e: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = e
            self.cv.notify_all()
        self._wake_watchers()

    def done(self, count: int = 1) -> None:
        with self.cv:
            self.left -= count
            last = self.left == 0
        if last:
            try:
                self._on_end(self)
            finally:
                with self.cv:
                    self.ended = True
                    self.cv.notify_all()
                self._wake_watchers()

    def poke(self) -> None:
        """Wakes a `wait(until)` to test its condition again."""
        with self.cv:
            self.cv.notify_all()

    def wait(self, until: Callable[[], bool] | None = None) -> None:
        """Until the end, an error, or `until()`."""
        with self.cv:
            while not self.ended and self.error is None and not (until is not None and until()):
                self.cv.wait(0.02)

    def wait_end(self) -> None:
        with self.cv:
            while not self.ended:
                self.cv.wait(0.1)


class Dispatcher:
    """Owns the rotation g0 and runs each call's schedule on the workers."""

    def __init__(self, workers: list[Worker]):
        self.workers = workers
        self.g0 = 0
        self._schedules: dict[tuple, Schedule] = {}

    def schedule(self, plan: Plan, training: bool, num_mb: int, round_size: int) -> Schedule:
        """The call's schedule; built once per (plan, mode, sizes, g0) since a run only reads it."""
        key = (tuple(plan.forward), tuple(plan.backward), training, num_mb, round_size, self.g0)
        sched = self._schedules.get(key)
        if sched is None:
            if len(self._schedules) >= 4 * len(self.workers):   # a new plan or batch shape: start over
                self._schedules.clear()
            sched = self._schedules[key] = Schedule(plan, training, num_mb, round_size, self.workers, self.g0)
        return sched

    def start(self, ctx: CallContext, sched: Schedule, on_end: Callable[[CallRun], None]) -> CallRun:
        """Hands every worker its slots of the call, behind whatever earlier calls left it; the
        rotation moves on at once, so the next call's slots continue where these stop."""
        run = CallRun(ctx, len(self.workers), on_end)
        ctx.on_losses = run.poke
        submitted = 0
        try:
            for w in self.workers:
                w.submit(self._work_fn(ctx, w, sched.tasks[w.name], run))
                submitted += 1
        except BaseException:
            ctx.board.abort()   # Ctrl-C while handing out work: stop the workers that got it
            run.done(len(self.workers) - submitted)
            run.wait_end()
            raise
        self.g0 = sched.next_g0 % len(self.workers)
        return run

    @staticmethod
    def wait(run: CallRun, until: Callable[[], bool] | None = None) -> None:
        """Waits for the call's end (or `until()`); on an error or Ctrl-C stops every worker's part of
        the call, waits for them and re-raises, leaving the host state as it was."""
        try:
            run.wait(until)
        except BaseException:
            run.ctx.board.abort()   # Ctrl-C: stop the workers, leave the host state as it was
            run.wait_end()
            raise
        if run.error is not None:
            run.ctx.board.abort()
            run.wait_end()
            raise run.error

    @staticmethod
    def _work_fn(ctx: CallContext, w: Worker, tasks: list[StageTask], run: CallRun) -> Callable[[], None]:
        def work() -> None:
            try:
                pre = None
                for i, task in enumerate(tasks):
                    if ctx.board.aborted:
                        break
                    pre = run_stage(ctx, w, task, pre, tasks[i + 1] if i + 1 < len(tasks) else None)
                w.drain()
            except Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller by Dispatcher.wait
                run.fail(e)
                ctx.board.abort()
            finally:
                if ctx.board.aborted:
                    try:
                        w.abandon()
                    except BaseException:  # noqa: BLE001 - the first error is already recorded
                        pass
                run.done()
        return work
