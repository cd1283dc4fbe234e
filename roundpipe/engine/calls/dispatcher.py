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

Failures (docs/semantics.md).  A worker's error fails the call and aborts its board;
the caller re-raises it once every worker stopped.  An error that `out_of_device_memory`
recognises gets a note naming the worker, the stage, the microbatch, the plan's predicted
peak and the cap, and the locals of the frames it passed through are cleared, so
everything the failed stage held on the worker (weights, inputs, the autograd graph)
dies before the caller sees it, not when the caller drops the exception; the model then
keeps no resident weights, graphs or device-stepped layers (engine/model.py).  Not only
torch.OutOfMemoryError (the caching allocator's): cuBLAS, cuDNN and CUDA runtime calls
that cannot allocate (a handle, a workspace, an event) raise a plain RuntimeError, which
used to keep all of that alive and on, so a retry failed the same way (issue 51, item 5).
The error keeps its type (an exception in a worker reaches the caller as that exception).
A sticky CUDA error (`sticky_device_error`: an illegal address, a launch failure, a
device-side assert) is no out-of-memory: the
CUDA context is broken, every later CUDA call of the process fails, so its note says to
restart the process, never to retry.  Under data parallelism (`ranks`) an out-of-memory
error of a training call is this rank's alone: the other ranks went on, and a retry on
this rank alone would pair its collectives with the wrong calls of theirs; the note says
so, and the model makes the rank refuse every later collective (DataParallel.refuse),
so that it fails instead of desynchronising the group.  Making the failure collective
(every rank dropping the call) would need an agreement at every call's end, where the
continuous pipeline has none: not done.

The `Watchdog` turns a stall (no worker of a live call made progress for `stall_timeout`
seconds) into `RoundPipeStalled` in the waiting caller, with every engine thread's stack;
a stuck thread cannot be stopped, so its calls are given up (ended without effect) and
the model takes no more calls.
"""
from __future__ import annotations

import re
import threading
import time
import traceback
from typing import Callable

import torch

from roundpipe.core.errors import Aborted, RoundPipeStalled
from roundpipe.core.executor import engine_stacks, innermost, waits_of
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


def saved_points(plan: Plan, training: bool, layer_grain: bool = False) -> frozenset[int]:
    """Layer indices whose input is kept for a consumer: a stage's input, and at layer grain every layer's of
    a (non-fused) backward stage, which recomputes each layer from its own input."""
    starts = {r.start for r in plan.forward} | {plan.fused.start}
    if training:
        starts |= {r.start for r in plan.backward}
        if layer_grain:
            starts |= {l for r in plan.backward[1:] for l in r}
    return frozenset(starts)


class Schedule:
    """The per-worker slot lists of one call.

    `kept` (set by `keep_activations`, chosen by device_memory.PeakPredictions): the backward stages, by
    index in plan.backward, that do not recompute.  The forward stage holding such a stage's layers runs
    them with autograd and keeps the graph on its worker, where the backward stage runs next (slots a
    multiple of N apart); the backward stage then runs the backward alone on that graph and the forward's
    bound weights, with no upload and no recompute (`keepable` lists the stages that can)."""

    def __init__(self, plan: Plan, training: bool, num_mb: int, round_size: int, workers: list[Worker], g0: int,
                 layer_grain: bool = False):
        self.plan, self.training, self.workers = plan, training, workers
        self.num_mb, self.round_size, self.g0 = num_mb, round_size, g0
        self.layer_grain = layer_grain and training   # backward stages recompute a layer at a time
        self.points = saved_points(plan, training, layer_grain)
        self.num_layers = plan.num_layers
        self._build(frozenset())
        self.fits_checked = False   # set by RoundPipe once its stages were checked against the device caps
        self.predicted: dict[str, int] = {}   # worker name -> predicted peak device bytes (device_memory.PeakPredictions)
        self.resident = 0   # first layers whose weights workers keep between stages (calls/resident.py; PeakPredictions)

    def keepable(self, quantized: Callable[[int], bool] = lambda l: False) -> list[int]:
        """The backward stages (index in plan.backward) that could keep their forward's graph instead of
        recomputing, nearest the fused tail first: training calls; a non-fused stage not at layer 0 whose
        layers lie in one forward stage running on the same worker (its slot a multiple of N before); no
        4-bit layer (`quantized`: its dequantized weights would outlive the forward's DequantKeep)."""
        if not self.training:
            return []
        n, k, out = len(self.workers), len(self.plan.forward), []
        for j, r in enumerate(self.plan.backward[1:], start=1):
            a = next((i for i, f in enumerate(self.plan.forward) if f.start <= r.start and r.stop <= f.stop), None)
            if a is not None and r.start > 0 and (k + j - a) % n == 0 and not any(quantized(l) for l in r):
                out.append(j)
        return out

    def keep_activations(self, kept) -> None:
        """Rebuilds the slot lists with these backward stages kept from their forward (none: recompute all)."""
        kept = frozenset(kept)
        if kept != self.kept:
            self._build(kept)

    def _build(self, kept: frozenset[int]) -> None:
        plan, n, workers = self.plan, len(self.workers), self.workers
        self.kept = kept
        kept_ranges = [plan.backward[j] for j in sorted(kept)]
        kinds = slot_kinds(plan, self.training)
        num_mb, round_size = self.num_mb, self.round_size
        rounds = [list(range(r, min(num_mb, r + round_size))) for r in range(0, num_mb, round_size)]
        self.tasks: dict[str, list[StageTask]] = {w.name: [] for w in workers}
        self.by_name = {w.name: w for w in workers}
        self.uploads = [0] * plan.num_layers
        self.input_consumers = 0
        slot = self.g0
        for ri, mbs in enumerate(rounds):
            placed = []
            for kind, r in kinds:
                keeps = kind == "B" and r in kept_ranges
                placed.append((kind, r, workers[slot % n], slot, keeps))
                slot += 1
                if not keeps:   # a kept backward stage binds its forward's weights
                    for l in r:
                        self.uploads[l] += 1
            for kind, r, w, s, keeps in placed:
                task = StageTask(kind, r, ri, s - self.g0, mbs, last_round=ri == len(rounds) - 1,
                                 by_layer=kind == "B" and self.layer_grain and not keeps, kept=keeps)
                if kind == "F":
                    task.keep = tuple(k for k in kept_ranges if r.start <= k.start and k.stop <= r.stop)
                    for b in [b for b in self.points if r.start < b <= r.stop] + [r.stop]:
                        task.consumers[b] = self._readers(placed, b)
                elif r.start > 0:
                    task.consumers[r.start] = [Consumer(w2, True) for k2, r2, w2, _, _ in placed
                                               if k2 == "B" and r2.stop == r.start]
                self.tasks[w.name].append(task)
            if ri == 0:
                self.input_consumers = len(self._readers(placed, 0))
        self.next_g0 = slot

    def _readers(self, placed: list, b: int) -> list[Consumer]:
        """The stages that read the activation at boundary b: those starting there, and at layer grain the
        backward stage holding layer b (it recomputes layer b from it); a kept backward stage reads none."""
        return [Consumer(w, kind != "B") for kind, r, w, _, keeps in placed
                if not keeps and (r.start == b or (self.layer_grain and kind == "B" and b in r))]


_KIND_WORDS = {"F": "forward", "fused": "the fused tail: forward, loss and backward", "B": "recompute and backward"}
_SPAN_WORDS = {"f": "forward (or recompute)", "b": "backward", "l": "loss_fn"}


def stage_words(task: StageTask) -> str:
    r = task.layers
    return f"stage {task.label} ({_KIND_WORDS.get(task.kind, task.kind)} of layers {r.start}-{r.stop - 1})"


def _microbatch(w: Worker, task: StageTask) -> str:
    done = w.stage_mbs_done
    return f"at microbatch {task.mbs[done]}" if done < len(task.mbs) else "after its last microbatch (the stage's end)"


# A device out of memory that torch reports as a plain RuntimeError, by its message (torch 2.x):
#   "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"   (a cuBLAS/cuBLASLt handle or
#       workspace; cuSOLVER, cuSPARSE, cuRAND report *_STATUS_ALLOC_FAILED, cuFFT CUFFT_ALLOC_FAILED)
#   "cuDNN error: CUDNN_STATUS_ALLOC_FAILED" (cuDNN 8), "... CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED" (9)
#   "CUDA error: out of memory" (cudaErrorMemoryAllocation from a runtime call: cudaEventCreate, a library's
#       cudaMalloc, a kernel launch short of local memory; CUDA_ERROR_OUT_OF_MEMORY from the driver API)
# Not matched: CUDNN_STATUS_NOT_SUPPORTED (a shape or algorithm, not memory), "too many resources requested
# for launch" (registers or shared memory per block: the same launch fails again at any batch size), Triton's
# "out of resource: shared memory", the host's "DefaultCPUAllocator: can't allocate memory", "out of memory" in a
# message that names no CUDA (or HIP) error (a layer's own).
_OOM_MESSAGE = re.compile(r"\b(?:CUDA|HIP)\b[^\n]*\bout of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"
                          r"|\b(?:CUBLAS|CUBLASLT|CUSOLVER|CUSPARSE|CURAND)_STATUS_ALLOC_FAILED|\bCUFFT_ALLOC_FAILED"
                          r"|\bCUDNN_STATUS_(?:ALLOC_FAILED|INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)", re.IGNORECASE)
# CUDA errors after which the context is unusable ("sticky"): every later CUDA call of the process fails with
# the same error, so nothing in the process can recover the device; a kernel's fault may surface at any later call
_STICKY_MESSAGE = re.compile(r"an illegal memory access was encountered|unspecified launch failure"
                             r"|device-side assert triggered|misaligned address|an illegal instruction was encountered"
                             r"|invalid program counter|hardware stack error|the launch timed out and was terminated"
                             r"|uncorrectable ECC error encountered|cudaErrorIllegalAddress|cudaErrorLaunchFailure"
                             r"|CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_LAUNCH_FAILED")


def out_of_device_memory(e: BaseException | None) -> bool:
    """Whether e says a device ran out of memory: torch.OutOfMemoryError, or a RuntimeError whose message is
    one of a library's or the CUDA runtime's allocation failures (_OOM_MESSAGE).  Everything in the engine
    that reacts to an out-of-memory error asks this, so all of them get the same handling."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and not sticky_device_error(e) and bool(_OOM_MESSAGE.search(str(e)))


def sticky_device_error(e: BaseException | None) -> bool:
    """Whether e is a CUDA error that leaves the process's CUDA context unusable (_STICKY_MESSAGE)."""
    return isinstance(e, RuntimeError) and bool(_STICKY_MESSAGE.search(str(e)))


def _oom_note(w: Worker, task: StageTask | None, predicted: int | None, ranks: tuple[int, int] | None) -> str:
    """ranks: (rank, world) when the failed call was a training call of a data-parallel group of several."""
    where = (f"in {stage_words(task)}, {_microbatch(w, task)}" if task is not None
             else "after its stages (its copies and gradient landings)")
    pred = (f"the plan's predicted peak for this worker is {predicted:,} bytes" if predicted
            else "no predicted peak (a fixed plan and no device_memory cap)")
    cap = (f"its device_memory cap is {w.device_cap:,} bytes" if w.device_cap is not None
           else "it has no device_memory cap (the device's own limit)")
    head = f"[roundpipe] out of device memory on worker {w.name} {where}; {pred}, {cap}."
    smaller = "a smaller batch, more microbatches (num_microbatches=) or a plan with smaller stages"
    if ranks is not None:
        rank, world = ranks
        return (f"{head}  The call had no effect on this rank, rank {rank} of the {world} of its process group, "
                "and the other ranks went on unless they failed too: a retry on this rank alone would pair its "
                "collectives with different calls of theirs, so this rank refuses every collective call from now "
                "on.  Let the error end every rank and restart them all from the last checkpoint with " + smaller)
    return (f"{head}  The call had no effect and what the stage held on the worker was released: the model stays "
            "usable; retry with " + smaller)


def _sticky_note(w: Worker, task: StageTask | None) -> str:
    where = f"in {stage_words(task)}, {_microbatch(w, task)}" if task is not None else "after its stages"
    return (f"[roundpipe] CUDA error on worker {w.name} {where} that leaves the process's CUDA context unusable: "
            "every later CUDA call of this process fails the same way, and since kernels run asynchronously the "
            "faulty kernel may be an earlier one (CUDA_LAUNCH_BLOCKING=1 reports it where it is launched).  Do "
            "not retry: restart the process (every rank, with data parallelism) from the last checkpoint")


def _release_frames(e: BaseException) -> None:
    """Clears the locals of the finished frames an error (and the errors chained to it) passed through."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        todo += [x.__cause__, x.__context__]


class Watchdog:
    """Raises RoundPipeStalled in a waiting caller when the engine stalls (EngineConfig.stall_timeout).

    Progress is a worker's (Worker.progress_at): a stage began or ended, a compute span or a
    microbatch ended, a download landed.  On a GPU a compute span or microbatch counts once the
    device did it, not when it was issued (Worker.poll_progress, polled here before each judgement):
    a worker whose queued GPU work keeps completing is never stalled, however long its thread
    waits for that work; one whose queued work completes nothing for `timeout` is.  So the
    timeout must exceed the longest compute span's GPU time (a stage-microbatch's forward, loss
    or backward; a layer's at layer grain), not a whole stage's.  A caller's wait polls `check`: when none of the workers
    still busy with a live call progressed for `timeout` seconds (since the wait began at the
    earliest), every live call is aborted, the workers that are not stuck get a moment to stop,
    and the calls are given up: ended without effect as a failed call is (their `on_end` runs on
    the caller's thread), the workers still in them marked `stalled`.  Their threads cannot be
    killed; the model takes no more calls and `close()` does not wait for them."""

    GRACE_S = 2.0   # after the abort: the most the workers that are not stuck get to stop

    def __init__(self, workers: list[Worker], timeout: float | None):
        self.workers = {w.name: w for w in workers}
        self.timeout = timeout
        for w in workers:   # GPU workers queue fences of their compute for `check` to poll (none when off)
            w.track_progress = timeout is not None
        self.tripped: RoundPipeStalled | None = None
        self._live: list[CallRun] = []   # calls started and not ended
        self._lock = threading.Lock()

    def add(self, run: "CallRun") -> None:
        with self._lock:
            self._live.append(run)

    def remove(self, run: "CallRun") -> None:
        with self._lock:
            if run in self._live:
                self._live.remove(run)

    def check(self, run: "CallRun", since: float) -> None:
        """RoundPipeStalled if the engine already stalled, or stalls now (see the class docstring)."""
        if self.tripped is not None:
            raise self.tripped
        if self.timeout is None:
            return
        with self._lock:
            runs = list(self._live)
        busy = sorted({name for r in runs for name in r.busy_names()})
        if not busy:
            return
        for n in busy:
            self.workers[n].poll_progress()   # device work done since the last check counts now
        idle = time.monotonic() - max([since] + [self.workers[n].progress_at for n in busy])
        if idle >= self.timeout:
            self._trip(run, runs, busy, idle)

    def _trip(self, run: "CallRun", runs: list["CallRun"], busy: list[str], idle: float) -> None:
        exc = RoundPipeStalled(self.report(busy, idle))
        self.tripped = exc
        for r in runs:
            if r is not run:   # calls still draining: raised as notes on this one, or by a sync point
                r.fail(RoundPipeStalled(f"call aborted by an engine stall (stall_timeout={self.timeout} s) while it "
                                        "ran; its gradients were dropped"))
            r.ctx.board.abort()
        deadline = time.monotonic() + min(self.timeout, self.GRACE_S)
        for r in runs:
            r.wait_until(deadline)
        for r in runs:
            for name in r.give_up():
                self.workers[name].stalled = True
        raise exc

    def report(self, busy: list[str], idle: float) -> str:
        """The stalled workers (those not waiting for another stage first), the others, every engine thread's stack."""
        stuck, waiting = [], []
        for name in busy:
            w = self.workers[name]
            what = waits_of(w.thread_ident)
            task = w.stage
            where = f"worker {name} in {stage_words(task)}, {_microbatch(w, task)}" if task is not None else \
                f"worker {name} (between stages of its part of a call: copies and gradient landings)"
            if what is not None:
                waiting.append(f"{where}, waits for {what}")
                continue
            frame = innermost(w.thread_ident) or "an unknown place"
            if w.computing is not None:
                stuck.append(f"{where}, waits for its own {_SPAN_WORDS.get(w.computing[0], 'compute')} to return "
                             f"(a layer, loss_fn or collective that blocks: {frame})")
            else:
                stuck.append(f"{where}, waits at {frame}")
        first = stuck or waiting
        lines = [f"the engine made no progress for {idle:.1f} s (stall_timeout={self.timeout} s): "
                 + "; ".join(first)]
        if stuck and waiting:
            lines.append("waiting behind it: " + "; ".join(waiting))
        lines.append("The call was aborted, but a thread that does not return cannot be stopped: this RoundPipe takes "
                     "no more calls; close() it (it does not wait for the stuck worker) and build a new one.")
        own = {e.ident for w in self.workers.values() for e in w.executors() if e.alive}
        lines.append("Engine threads (the stalled model's workers first):\n" + engine_stacks(own))
        return "\n".join(lines)


# How often a waiting caller wakes: the watchdog judges progress at every wake-up, so with a stall_timeout
# every 20 ms; without one every change the wait tests (the end, an error, `poke`) wakes it, and the timeout
# only bounds what a missed wake-up would cost.  On a 2-core machine each wake-up is a thread switch taken
# from the workers' compute (six a step of the default `roundpipe train` at 20 ms, issue 54).
WATCHED_POLL_S, QUIET_POLL_S = 0.02, 0.25


class CallRun:
    """One call's work on the workers: which are still at it, the first error, the end.

    `on_end(run)` runs once, on the thread of the last worker to finish (or the caller's, when
    work was never handed out or the watchdog gave the call up); the call counts as finished
    only once it returned."""

    def __init__(self, ctx: CallContext, workers: list[str], on_end: Callable[["CallRun"], None],
                 watchdog: Watchdog | None = None):
        self.ctx = ctx
        self.cv = threading.Condition()
        self._busy = set(workers)   # workers whose part of the call has not ended
        self.ended = False
        self.error: BaseException | None = None
        self._on_end = on_end
        self._watchers: list["CallRun"] = []   # later calls waiting on this one's end or error
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.add(self)

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

    def busy_names(self) -> list[str]:
        with self.cv:
            return list(self._busy)

    def done(self, *workers: str) -> None:
        """These workers' parts ended (a part the watchdog gave up on may end later: ignored)."""
        with self.cv:
            if not self._busy:
                return
            self._busy.difference_update(workers)
            last = not self._busy
        if last:
            try:
                self._on_end(self)
            finally:
                with self.cv:
                    self.ended = True
                    self.cv.notify_all()
                if self.watchdog is not None:
                    self.watchdog.remove(self)
                self._wake_watchers()

    def give_up(self) -> list[str]:
        """Ends the call as if its workers still at it had stopped (the watchdog's last resort); returns them."""
        left = self.busy_names()
        if left:
            self.done(*left)
        return left

    def wait_until(self, deadline: float) -> None:
        """Until the end or the monotonic `deadline`, no watchdog."""
        with self.cv:
            while not self.ended and time.monotonic() < deadline:
                self.cv.wait(0.02)

    def poke(self) -> None:
        """Wakes a `wait(until)` to test its condition again."""
        with self.cv:
            self.cv.notify_all()

    def _poll_s(self) -> float:
        watched = self.watchdog is not None and self.watchdog.timeout is not None
        return WATCHED_POLL_S if watched else QUIET_POLL_S

    def wait(self, until: Callable[[], bool] | None = None) -> None:
        """Until the end, an error, or `until()`; RoundPipeStalled from the watchdog."""
        since = time.monotonic()
        poll = self._poll_s()
        while True:
            with self.cv:
                if self.ended or self.error is not None or (until is not None and until()):
                    return
                self.cv.wait(poll)
                if self.ended or self.error is not None or (until is not None and until()):
                    return
            if self.watchdog is not None:
                self.watchdog.check(self, since)

    def wait_end(self) -> None:
        """Until the end; RoundPipeStalled from the watchdog (a call it gave up on has ended)."""
        since = time.monotonic()
        while True:
            with self.cv:
                if self.ended:
                    return
                self.cv.wait(max(0.1, self._poll_s()))
                if self.ended:
                    return
            if self.watchdog is not None:
                self.watchdog.check(self, since)


class Dispatcher:
    """Owns the rotation g0 and runs each call's schedule on the workers."""

    def __init__(self, workers: list[Worker], stall_timeout: float | None = None, layer_grain: bool = False,
                 ranks: tuple[int, int] | None = None):
        self.workers = workers
        self.layer_grain = layer_grain   # RoundPipe(recompute="layer")
        self.ranks = ranks   # (rank, world) of a data-parallel group of several processes, else None
        self.g0 = 0
        self._schedules: dict[tuple, Schedule] = {}
        self.watchdog = Watchdog(workers, stall_timeout)

    def schedule(self, plan: Plan, training: bool, num_mb: int, round_size: int,
                 layer_grain: bool | None = None) -> Schedule:
        """The call's schedule; built once per (plan, mode, sizes, grain, g0) since a run only reads it.
        layer_grain: this call's recompute grain (None: the model's)."""
        layer_grain = self.layer_grain if layer_grain is None else layer_grain
        key = (tuple(plan.forward), tuple(plan.backward), training, num_mb, round_size, layer_grain, self.g0)
        sched = self._schedules.get(key)
        if sched is None:
            if len(self._schedules) >= 4 * len(self.workers):   # a new plan or batch shape: start over
                self._schedules.clear()
            sched = self._schedules[key] = Schedule(plan, training, num_mb, round_size, self.workers, self.g0,
                                                    layer_grain)
        return sched

    def start(self, ctx: CallContext, sched: Schedule, on_end: Callable[[CallRun], None]) -> CallRun:
        """Hands every worker its slots of the call, behind whatever earlier calls left it; the
        rotation moves on at once, so the next call's slots continue where these stop."""
        if self.watchdog.tripped is not None:
            raise RoundPipeStalled("this RoundPipe stalled earlier (a worker made no progress for stall_timeout "
                                   "seconds) and takes no more calls; close it and build a new one") \
                from self.watchdog.tripped
        run = CallRun(ctx, [w.name for w in self.workers], on_end, self.watchdog)
        ctx.on_losses = run.poke
        submitted = 0
        try:
            for w in self.workers:
                w.submit(self._work_fn(ctx, w, sched.tasks[w.name], run, sched.predicted.get(w.name), self.ranks))
                submitted += 1
        except BaseException:
            ctx.board.abort()   # Ctrl-C while handing out work: stop the workers that got it
            run.done(*[w.name for w in self.workers[submitted:]])
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
    def _work_fn(ctx: CallContext, w: Worker, tasks: list[StageTask], run: CallRun,
                 predicted: int | None, ranks: tuple[int, int] | None = None) -> Callable[[], None]:
        """Worker w's part of the call; `predicted`: its predicted peak device bytes, `ranks`: the data-parallel
        (rank, world) (both for an out-of-memory note)."""
        def work() -> None:
            pre = task = None
            try:
                for i, task in enumerate(tasks):
                    if ctx.board.aborted:
                        break
                    w.begin_stage(task)
                    pre = run_stage(ctx, w, task, pre, tasks[i + 1] if i + 1 < len(tasks) else None)
                    w.end_stage()
                task = None
                w.drain()
            except Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller by Dispatcher.wait
                if out_of_device_memory(e):
                    training = ctx.call is not None and ctx.call.training
                    e.add_note(_oom_note(w, task, predicted, ranks if training else None))
                    _release_frames(e)   # the failed stage's tensors die now, not with the exception
                elif sticky_device_error(e):
                    e.add_note(_sticky_note(w, task))
                run.fail(e)
                ctx.board.abort()
            finally:
                pre = task = None   # the prefetched weights die before the call counts as ended
                w.end_stage()
                if ctx.board.aborted:
                    ctx.kept.clear()   # graphs kept for backward stages that will not run die now
                    try:
                        w.abandon()
                    except BaseException:  # noqa: BLE001 - the first error is already recorded
                        pass
                run.done(w.name)
        return work
