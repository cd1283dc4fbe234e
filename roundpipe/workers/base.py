"""The worker interface: one device, one thread, and the copies a stage needs.

A worker is stateless between stages.  The dispatcher hands it a list of
closures per call; it runs them in order on its own thread.  Everything that
moves data goes through the copy queues of roundpipe/workers/transfers.py, so
the stage code in roundpipe/engine/calls/stage.py is the same for a CPU and a CUDA worker:

    upload_params    host upload copies -> device weights, LPT windows  (param_up)
    upload_buffers   host buffers -> device                             (param_up)
    receive / use    Handoff -> tensors on this device                  (act_up)
    send             stage output -> Handoff (host copy and/or device)  (act_down)
    download_grads   fp32 gradients -> host, LPT windows, then a callback (grad_down)
    download_buffers device buffers -> host, then a callback            (grad_down)

A subclass supplies the device: where device tensors live (`_empty`), what
marks the compute issued so far (`_compute_fence`: None when compute is
synchronous, as on a CPU worker) and how compute waits for a copy
(`_compute_waits`).  Host buffers (download staging) come from the model's
HostState, i.e. from its pinned arena.  Callbacks of downloads run on a
completion thread once the copy's fences completed, so the issuing thread
never blocks on a download.

A `Handoff` carries an activation or gradient between two stage runs.  The
host copy lives in (pinned) host memory; when the consumer runs on the
producer's device the device tensors are handed over directly and the host
round trip is skipped.

Progress and faults.  A worker keeps what the stall watchdog of
roundpipe/engine/calls/dispatcher.py reads: the stage it runs, how many of its
microbatches finished and when it last made progress (a stage began or ended, a
compute span or a microbatch ended, a download landed).  Where compute is
asynchronous (a GPU: `_progress_fence` is not None) and the watchdog is on
(`track_progress`), a compute span or microbatch counts once the device has done
it, not when the thread issued it: the thread issues a stage-microbatch in
microseconds that the GPU may run for seconds, then waits for it without making
progress of its own, so a stall_timeout shorter than a stage's GPU time marked
healthy workers stalled (issue 51, item 6).  The fences of the work issued wait
in a queue that `poll_progress` (called by the watchdog) turns into progress as
they complete; a device whose queued work completes nothing is still a stall.

`inject_oom(kind)` is a test seam: the next allocation of that part of the work
fails with torch.OutOfMemoryError, as a full device would make it
(tests/engine/test_device_oom.py).
"""
from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from roundpipe import testing
from roundpipe.core.executor import SerialExecutor
from roundpipe.core.tree import tensors, tree_leaves, tree_unflatten
from roundpipe.workers.ledger import DeviceLedger, WorkspaceTracker
from roundpipe.workers.rng import WorkerRng
from roundpipe.workers.transfers import Bulk, Transfers

Alloc = Callable[[torch.Size, torch.dtype], torch.Tensor]
Owns = Callable[[torch.Tensor], bool]

# inject_oom's kinds: the compute span parts by their key's first letter (Worker.compute_span), and the copies
OOM_KINDS = ("forward", "backward", "loss", "upload", "download")
_SPAN_KINDS = {"f": "forward", "b": "backward", "l": "loss"}

# Layers of a stage-microbatch that took longer than this last time are real compute: they
# run outside the worker's turn, beside another worker's (see roundpipe/workers/cpu.py).
# The bench's trivial layers take ~0.02-0.05 ms, the tiny decoder's ~ms.
LONG_COMPUTE_S = 0.5e-3


def _plain_alloc(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass
class Handoff:
    """An activation (or gradient) between a producer and its consumers."""

    host: Any = None             # nest of host tensors, or None when only the device copy exists
    host_ready: Any = None       # fence the host copy completes with, None when ready
    device: torch.device | None = None
    space: str | None = None     # the producer's memory space (Worker.space): who may take device_value
    device_value: Any = None     # nest of device tensors for a consumer in the same memory space
    device_ready: Any = None     # fence of the producer's compute guarding device_value
    gpu_ready: dict | None = None  # call inputs already on a GPU: device -> event recorded on the
    #                               caller's stream when the call began (the producer's work)


@dataclass
class Arrival:
    """Tensors on their way to this device: usable once the compute has waited for `fences`."""

    value: Any
    fences: list = field(default_factory=list)


@dataclass
class Upload:
    """A stage's weights on the device, per layer, and the bulk copy filling them."""

    params: list[list[torch.Tensor]]
    bulk: Bulk


def gpu_input_events(mb) -> dict | None:
    """For call inputs already on a GPU: an event on the caller's current stream of each such device,
    so that workers read them (a training call: its snapshots of them) only after the work the caller
    queued to produce them."""
    devices = {t.device for m in range(len(mb)) for t in tensors((mb.args[m], mb.kwargs[m], mb.labels[m]))
               if t.device.type == "cuda"}
    return {d: torch.cuda.current_stream(d).record_event() for d in devices} or None


def gpu_input_snapshots(workers: Sequence["Worker"]) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a training call stages an input already on a GPU (HostState.staged): a copy owned by the call.

    The copy is made on the caller's current stream of the tensor's device, so after the work that
    produced the tensor and before anything the caller queues next (`x.copy_(next_batch)`); the
    backward stage of the first layers recomputes from it after forward_backward returned.  It dies
    when its last consumer is done (the board drops the entry) and counts as activations in the
    ledger of the first worker on its device, if any."""
    ledgers: dict[torch.device, DeviceLedger] = {}
    for w in workers:
        ledgers.setdefault(w.device, w.ledger)

    def snapshot(t: torch.Tensor) -> torch.Tensor:
        own = t.detach().clone()
        ledger = ledgers.get(own.device)
        return own if ledger is None else ledger.track(own, "activations")
    return snapshot


class Worker(ABC):
    """A device plus the thread that drives it."""

    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype, alloc: Alloc | None = None,
                 owns: Owns | None = None):
        self.device = device
        self.name = name
        # Whose device buffers this worker may read in place: a GPU's, shared by the workers listed on
        # it (one GPU listed twice); a CPU worker models a GPU of its own, so only its own (before, all
        # CPU workers shared one space: a forward output kept on its producer for a consumer on
        # another CPU worker stayed until that consumer ran, outside the memory model).
        self.space = name if device.type == "cpu" else str(device)
        self.compute_dtype = compute_dtype
        self.rng = WorkerRng(device)   # its own generator: layers draw without a lock
        self.host_alloc = alloc or _plain_alloc
        self.host_owns = owns or (lambda t: alloc is None)   # without an allocator: plain memory is all there is
        self.copies = Transfers(device)
        self.copies.on_microbatch = self._microbatch_done
        self.ledger = DeviceLedger()   # device bytes this worker holds (roundpipe/workers/ledger.py)
        self.device_cap: int | None = None   # its device_memory cap (set_cap), named in out-of-memory errors
        self._thread = SerialExecutor(f"roundpipe-{name}")
        self._completer = SerialExecutor(f"roundpipe-{name}-completer", idle_release_s=0)
        self._landings = 0     # download callbacks queued on the completion thread
        self._landings_lock = threading.Lock()
        self._oom: str | None = None   # inject_oom's kind, until it fired
        # What the stall watchdog reads: plain attributes written by this worker's threads and read
        # racily by a waiting caller (a stale value can only delay a report by one poll).
        self.progress_at = time.monotonic()   # the last progress (module docstring)
        self.stage: Any = None        # the stage task it runs (the dispatcher's StageTask), None between stages
        self.stage_mbs_done = 0       # microbatches of that stage finished
        self.computing: Hashable | None = None   # the key of the compute span running, if any
        self.stalled = False          # given up by the watchdog: takes no more work, close() does not join it
        self._stager = None           # the host copy engine staging pageable uploads (`_stage_pageable`)
        # set by the watchdog when it is on: progress is device work done (module docstring), and the
        # fences of work issued queue here, appended by this worker's thread, polled by a waiting caller
        self.track_progress = False
        self._progress_fences: deque = deque()
        self._progress_lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs fn on this worker's thread after everything submitted before (fn handles its errors)."""
        if self.stalled:
            raise RuntimeError(f"worker {self.name} stalled (a stage that made no progress for stall_timeout "
                               "seconds) and takes no more work; close this RoundPipe and build a new one")
        self._thread.submit(fn)

    def close(self) -> None:
        if self.stalled:   # its thread may never return: stop it without waiting (it exits if it ever does)
            self._thread.stop()
            self._completer.stop()
            return
        self._thread.close()
        self._completer.close()
        self.copies.synchronize()

    @property
    def thread_ident(self) -> int | None:
        """The identifier of the thread running its stages (sys._current_frames' key)."""
        return self._thread.ident

    def set_cap(self, cap: int | None) -> None:
        """Its device_memory cap in bytes (None: none), named in out-of-memory errors; a CPU worker's ledger
        enforces it (roundpipe/workers/cpu.py), a GPU's allocator enforces the device's own limit."""
        self.device_cap = cap

    # ---- progress (the stall watchdog) and the out-of-memory test seam
    def begin_stage(self, task: Any) -> None:
        """The dispatcher starts a stage task here."""
        self.stage, self.stage_mbs_done, self.progress_at = task, 0, time.monotonic()

    def end_stage(self) -> None:
        self.stage, self.progress_at = None, time.monotonic()

    def _microbatch_done(self) -> None:
        self.stage_mbs_done += 1
        self._issued()

    def _issued(self) -> None:
        """Compute was issued up to here (a compute span or a microbatch ended): progress once it is done.
        Compute done when issued (a CPU worker's, or the watchdog off) counts now; a GPU's when the fence
        recorded behind it completes (`poll_progress`)."""
        fence = self._progress_fence() if self.track_progress else None
        if fence is None:
            self.progress_at = time.monotonic()
            return
        with self._progress_lock:
            self._progress_fences.append(fence)
        self.poll_progress()   # drops the completed ones: the queue holds only the work still in flight

    def _progress_fence(self) -> Any:
        """A fence for the compute issued so far, for progress (None: it is done already)."""
        return self._compute_fence()

    def poll_progress(self) -> None:
        """Device work issued earlier and completed since the last poll counts as progress now (the watchdog
        calls it before it judges a worker; a worker whose compute is done when issued has none queued)."""
        if not self._progress_fences:
            return
        with self._progress_lock:
            left = deque(f for f in self._progress_fences if f.state == "pending")
            done = len(left) < len(self._progress_fences)
            self._progress_fences = left
        if done:
            self.progress_at = time.monotonic()

    def inject_oom(self, kind: str | None) -> None:
        """Test seam: the next allocation of `kind` on this worker raises torch.OutOfMemoryError (None disarms).

        "forward", "backward", "loss": the first new storage of the next compute span of that part (a
        forward, a recompute and the fused tail's forward count as forward; the worker must record
        workspace, as a capped CPU worker does, else the span fails as it begins); "upload": the next
        device buffer an upload makes (weights or a stage input); "download": the next download of
        gradients or buffers, before its copies.  Fires once."""
        if kind is not None and kind not in OOM_KINDS:
            raise ValueError(f"inject_oom kind={kind!r} must be one of {OOM_KINDS} or None")
        self._oom = kind
        if kind is None:
            self.ledger.fail_next(None)

    def _injected(self, kind: str) -> bool:
        """inject_oom(kind) was called and fires now (once)."""
        if self._oom != kind:
            return False
        self._oom = None
        return True

    def executors(self) -> list[SerialExecutor]:
        """The threads this worker owns (stopped by the model's finalizer if it is never closed)."""
        return [self._thread, self._completer]

    def compute(self) -> contextlib.AbstractContextManager:
        """Context in which stage compute is issued (the compute stream on CUDA)."""
        return contextlib.nullcontext()

    def turn(self) -> contextlib.AbstractContextManager:
        """Held while one stage-microbatch is issued (CPU workers take turns, see roundpipe/workers/cpu.py)."""
        return contextlib.nullcontext()

    def yielded(self) -> contextlib.AbstractContextManager:
        """Around a wait for another worker's output: gives the turn back meanwhile, if held."""
        return contextlib.nullcontext()

    def compute_span(self, seconds: dict, key: Hashable,
                     report: Callable[[float, float], None] | None = None) -> contextlib.AbstractContextManager:
        """Around a stage's layer compute: outside the worker's turn when it took long last time.

        `seconds[key]` keeps how long the compute under `key` took.  Never measured counts as
        long, so a slow layer never holds the turn even once; forward and backward have their
        own keys, since a cheap forward says nothing about its backward.  `report(t0, t1)` gets
        the compute's execution time, waits for the turn excluded (`timer_stop`: on a GPU once
        its events completed), for the trace.  What the compute allocates is workspace in the
        ledger where the worker records it (`_workspace_tracker`); the span's `untracked()` is a
        context for the engine's own steps inside it (publishing an activation)."""
        return _ComputeSpan(self, seconds, key, report)

    def _workspace_tracker(self) -> WorkspaceTracker | None:
        """A dispatch mode recording a compute span's allocations as workspace (CPU workers, ledger.py),
        or None: on CUDA torch.cuda.memory_allocated already counts them."""
        return None

    # True to record the layer compute's allocations as workspace in the ledger (CPU workers only:
    # a CUDA worker's torch.cuda.memory_allocated counts them already).  Off by default for its
    # per-op cost (roundpipe/workers/cpu.py); on where a device-memory cap is to be checked.
    records_workspace: bool = False

    # True when issuing the next stage's weights and the next microbatch's input early
    # overlaps compute.  Copies are asynchronous on both kinds of worker, but on a CPU worker
    # they compete with compute for the same cores; tests switch it on to run those paths.
    prefetches: bool = False

    # True when an upload whose source is outside the pinned arena (a base mapped from its files:
    # roundpipe/hf/mapped.py) is staged through an arena block first (`upload_params`).  A CUDA copy from
    # pageable memory is staged by the driver and returns when it is done: issued in a window behind the
    # next microbatch's input upload, under the transfers' lock, it held the worker's thread before m's
    # compute was issued, so upload and compute ran one after the other (issue 51, item 3).  A CPU worker
    # copies any memory alike, except under the strict device model, which models that hazard.
    stages_pageable: bool = False

    # True when a download whose copies have already completed may run its callback on the
    # worker thread instead of the completion thread.  A CPU worker copying small tensors
    # inline saves a thread hop per stage: 0.4-3 ms per call of 42 stage runs on the 2-core
    # CI VM, depending on load.  A GPU worker never knows a copy is done when issuing it.
    lands_inline: bool = False

    # ---- the device
    @abstractmethod
    def _empty(self, shape: torch.Size, dtype: torch.dtype, queue: str) -> torch.Tensor:
        """Uninitialised device memory that an upload on `queue` will fill."""

    @abstractmethod
    def _compute_fence(self) -> Any:
        """A fence for the compute issued so far (None: compute is already done)."""

    @abstractmethod
    def _compute_waits(self, fences: Sequence) -> None:
        """Makes the compute issued from now on wait for the fences."""

    def _device_empty(self, shape: torch.Size, dtype: torch.dtype, queue: str) -> torch.Tensor:
        """`_empty`, registered in the ledger: uploads on param_up are weights, on act_up activations."""
        if self._oom is not None and self._injected("upload"):
            self.ledger.fail_next(f"injected into an upload on {queue}")
        return self.ledger.track(self._empty(shape, dtype, queue), "weights" if queue == "param_up" else "activations")

    def _alloc_fences(self) -> list:
        """Fences an upload into buffers `_empty` just made waits for (CUDA: the compute issued before
        the allocation, which may still read a reused block; CPU: none, compute is synchronous)."""
        return []

    def _read_by_copy(self, tensors: Sequence[torch.Tensor], queue: str) -> None:  # noqa: B027 - optional hook; a CPU worker needs nothing
        """Device tensors that a copy on `queue` reads (CUDA: keeps the allocator from reusing them early)."""

    def _used_by_compute(self, tensors: Sequence[torch.Tensor]) -> None:  # noqa: B027 - optional hook; a CPU worker needs nothing
        """Uploaded tensors that compute now uses (CUDA: they were allocated on a copy stream)."""

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer for t's download (a leaf already on the host is copied at once)."""
        h = self.host_alloc(t.shape, t.dtype)
        if t.device != self.device:
            h.copy_(t)
        return h

    # ---- timing of a stage-microbatch (the profiler's input)
    def timer_start(self) -> Any:
        return time.perf_counter()

    def timer_stop(self, start: Any, report: Callable[[float, float], None]) -> None:
        """Calls report(t0, t1) with the execution time, now or (GPU) once it is known."""
        report(start, time.perf_counter())

    # ---- parameters and buffers
    def upload_params(self, host: list[list[torch.Tensor]], windows: int, urgent: bool = False,
                      have: list[list[torch.Tensor | None]] | None = None) -> Upload:
        """Device copies of a stage's host upload copies (already in compute dtype), in LPT windows;
        urgent: the caller waits for them next (Transfers.bulk).  `have`: per tensor a device copy this
        worker already holds (resident weights, roundpipe/engine/calls/resident.py), bound as it is,
        or None to upload it."""
        dev = [[self._device_empty(u.shape, u.dtype, "param_up") if have is None or have[i][j] is None
                else have[i][j] for j, u in enumerate(layer)] for i, layer in enumerate(host)]
        flat_dev, flat_host = [], []
        for i, layer in enumerate(host):
            for j, u in enumerate(layer):
                if have is None or have[i][j] is None:
                    flat_dev.append(dev[i][j])
                    flat_host.append(u)
        after = self._alloc_fences()
        if self.stages_pageable:
            flat_host, staging = self._stage_pageable(flat_host)
            after += staging
        return Upload(dev, self.copies.bulk("param_up", flat_dev, flat_host, windows, after, urgent))

    def _stage_pageable(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Sources outside the pinned arena copied into arena blocks by a host copy engine's own thread (memcpy
        from the page cache), started now, when the stage's upload is issued; the upload's windows wait for it
        (`stages_pageable`).  Returns the sources to upload from and the staging's fence."""
        idx = [k for k, u in enumerate(host) if not self.host_owns(u)]
        if not idx or not self.copies.native:
            return host, []
        if self._stager is None:
            from roundpipe.offload import CopyEngine
            self._stager = CopyEngine("cpu")
        host = list(host)
        srcs = [host[k].contiguous() for k in idx]
        for k, s in zip(idx, srcs):
            host[k] = self.host_alloc(s.shape, s.dtype)
        fence = self._stager.copy_many("param_up", [host[k] for k in idx], srcs)
        return host, [fence]

    def params_ready(self, up: Upload) -> list[list[torch.Tensor]]:
        """The uploaded weights, once compute has waited for them."""
        self.copies.flush(up.bulk)
        self._compute_waits(up.bulk.fences)
        self._used_by_compute([t for layer in up.params for t in layer])
        return up.params

    def upload_done(self, up: Upload) -> Callable[[], None]:
        """A host wait for the end of the upload (the P-copy may overwrite the host copy after it).

        It holds the bulk copy's fences only, never the device weights: the protocol keeps it
        until the next call, and the weights must die with their stage."""
        bulk, copies = up.bulk, self.copies
        return lambda: copies.wait(bulk)

    def upload_buffers(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of buffers, in their own dtype, uploaded from staging blocks: HostState keeps
        buffers in its arena; one the user replaced since is staged here (a pageable source would
        make the CUDA copy synchronous)."""
        if not host:
            return []
        dev = [self._device_empty(b.shape, b.dtype, "param_up") for b in host]
        b = self.copies.bulk("param_up", dev, [self._staged(h) for h in host], 1, self._alloc_fences())
        self._compute_waits(b.fences)
        self._used_by_compute(dev)
        return dev

    # ---- activations
    def send(self, value: Any, need_host: bool, keep_device: bool, goes_on: bool = False) -> Handoff:
        """Publishes a stage output; need_host: a consumer is elsewhere or it is a stage input to keep.

        goes_on: the producer's next layer gets `value` too (a saved boundary inside a stage, every layer
        boundary at layer grain).  Its first op may write it in place (ReLU(inplace=True), `x += b`: a
        forward stage runs under no_grad, so autograd allows it), and the download is ordered after the
        compute issued so far only, so on a GPU that kernel races the PCIe copy and the host copy every
        backward stage recomputes from gets the new values (issue 51, item 1).  So what is sent is a
        device copy of its own, made on the compute stream (~2-3 TB/s on an H100 against PCIe's ~25 GB/s:
        cheaper than making the next layer wait for the download), unless the copy is done before this
        returns (a CPU worker's inline copy)."""
        # One pass over the flattened leaves (a plain tensor for most stages) instead of a walk per step.
        leaves = tree_leaves(value)
        if need_host:
            leaves = [t.detach().contiguous() if isinstance(t, torch.Tensor) else t for t in leaves]
        else:
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
        if goes_on and (keep_device or not self.copies.done_on_issue(
                [t for t in leaves if isinstance(t, torch.Tensor) and t.device == self.device])):
            with self.compute():   # in the ledger until its download (and any consumer) let go of it
                leaves = [self.ledger.track(t.clone(), "activations")
                          if isinstance(t, torch.Tensor) and t.device == self.device else t for t in leaves]
        h = Handoff(device=self.device, space=self.space)
        compute = self._compute_fence()   # after the contiguous copies, which run on the compute stream
        if keep_device:
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.device == self.device:
                    self.ledger.track(t, "activations")
            h.device_value, h.device_ready = tree_unflatten(value, leaves), compute
        if need_host:
            host = [self._to_host(t) if isinstance(t, torch.Tensor) else t for t in leaves]
            h.host = tree_unflatten(value, host)
            pairs = [(d, t) for d, t in zip(host, leaves)
                     if isinstance(t, torch.Tensor) and t.device == self.device]
            if pairs:
                dsts, srcs = [d for d, _ in pairs], [t for _, t in pairs]
                self._read_by_copy(srcs, "act_down")
                h.host_ready = self.copies.activation("act_down", dsts, srcs, [compute])
                if goes_on:   # a boundary inside the stage: its copy holds device bytes the memory model
                    self.copies.bound_activation_downloads()   # counts once, as at a microbatch's end
        return h

    def receive(self, handoff: Handoff, forward: bool = True) -> Arrival:
        """Starts moving the handoff's tensors here; `use` them once they are needed.

        forward=False: a backward stage's recompute input, always taken from the host copy (the
        stage input the design keeps in host memory), never from the producer's device tensors:
        the forward consumer may have written those in place, and the board would otherwise keep
        them on the device until the backward stage ran."""
        if forward and handoff.device_value is not None and handoff.space == self.space:
            return self._take_device_value(handoff)
        dsts, srcs, value = [], [], []
        for t in tree_leaves(handoff.host):
            if isinstance(t, torch.Tensor):
                if t.device.type != "cpu":           # an input already on a GPU
                    t = self._from_gpu(t, (handoff.gpu_ready or {}).get(t.device))
                else:
                    d = self._device_empty(t.shape, t.dtype, "act_up")
                    dsts.append(d)
                    srcs.append(self._staged(t))
                    t = d
            value.append(t)
        fence = (self.copies.activation("act_up", dsts, srcs, [handoff.host_ready, *self._alloc_fences()])
                 if dsts else None)
        return Arrival(tree_unflatten(handoff.host, value), [fence])

    def _take_device_value(self, handoff: Handoff) -> Arrival:
        """The producer's device tensors for their one forward consumer (issue 26 part 2, item 2).

        The board entry lets go of them (only the backward stage is left to read it, from the
        host copy).  While their download to that host copy is still pending, the consumer gets
        a device copy of its own instead: ReLU(inplace=True) or `x += ...` in its first layer
        would otherwise change what lands on the host for the recompute (the download is
        ordered after the producer's compute only).  A copy, not a wait for the download: a
        device-to-device copy runs at memory bandwidth (~2-3 TB/s on an H100), the download at
        PCIe's (~25 GB/s), so waiting would put ~100x more time in front of the consumer's
        compute; the copy costs one activation of device memory until the download completed."""
        value, fences = handoff.device_value, [handoff.device_ready]
        handoff.device_value = None
        ready = handoff.host_ready
        if ready is None or ready.state == "done":
            return Arrival(value, fences)
        self._compute_waits(fences)
        leaves = tree_leaves(value)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self._used_by_compute(tensors)   # the producer's tensors are read by this compute stream
        with self.compute():
            own = [self.ledger.track(t.clone(), "activations") if isinstance(t, torch.Tensor) else t
                   for t in leaves]
        return Arrival(tree_unflatten(value, own), [])

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """t itself when it is a contiguous staging block (pinned on CUDA), else a copy made into one
        here, on the worker's thread: an asynchronous copy never reads pageable memory, and no
        temporary is made under the copy queues' lock.  The model stages call inputs and labels
        on the caller's thread (roundpipe/engine/model.py), so this is the exception."""
        if t.is_contiguous() and self.host_owns(t):
            return t
        out = self.host_alloc(t.shape, t.dtype)
        out.copy_(t)
        return out

    def _from_gpu(self, t: torch.Tensor, ready: Any) -> torch.Tensor:
        """A call input that is already on a GPU, here, once the caller's stream has produced it.

        `ready` is the event recorded on the caller's current stream of t's device at the call's
        start (None if t is not a call input).  Here it is waited for on the host; a CUDA worker on
        t's own device makes its compute stream wait instead (roundpipe/workers/cuda.py).  Either
        way the consumer gets a copy of its own (`use` promises a private value): an in-place first
        layer never writes the call's snapshot, which a later backward stage recomputes from."""
        if ready is not None:
            ready.synchronize()
        return t.to(self.device)

    def use(self, arrival: Arrival) -> Any:
        """The arrived tensors, private to the caller (safe to modify), once compute waited for them."""
        self._compute_waits(arrival.fences)
        self._used_by_compute([t for t in tree_leaves(arrival.value) if isinstance(t, torch.Tensor)])
        return arrival.value

    # ---- gradients and buffers back to the host
    def _download(self, values: list, windows: int, then: Callable[[list], None], urgent: bool = False) -> None:
        if self._oom is not None and self._injected("download"):
            raise torch.OutOfMemoryError(f"out of device memory (injected into a download of {len(values)} tensors "
                                         f"on {self.name})")
        values = [None if t is None else t.contiguous() for t in values]
        compute = self._compute_fence()
        host = [None if t is None else self._to_host(t) for t in values]
        pairs = [(h, t) for h, t in zip(host, values) if t is not None and t.device == self.device]
        srcs = [t for _, t in pairs]
        self._read_by_copy(srcs, "grad_down")
        b = self.copies.bulk("grad_down", [h for h, _ in pairs], srcs, windows, [compute], urgent)
        # Inline only behind no queued landing: the completion thread keeps landings in issue
        # order, and a queued one may wait for windows this thread still holds back.
        if (self.lands_inline and not self._landings and b.sent.is_set()
                and all(f is None or f.state == "done" for f in b.fences)):
            then(host)   # already landed (copied inline): no thread hop
            return

        def land() -> None:
            try:
                for f in self.copies.wait_sent(b):
                    if f is not None:
                        f.wait()
                then(host)
            finally:
                self.progress_at = time.monotonic()
                with self._landings_lock:
                    self._landings -= 1
        with self._landings_lock:
            self._landings += 1
        self._completer.submit(land)

    def download_grads(self, grads: list[torch.Tensor | None], windows: int, then: Callable[[list], None],
                       urgent: bool = False) -> None:
        """Moves a stage's gradients to the host in LPT windows; then(host_grads) runs once they landed.
        urgent: nothing of this call is left to overlap it with (the worker's last stage)."""
        for g in grads:
            if g is not None and g.device == self.device:
                self.ledger.track(g, "gradients")
        self._download(grads, windows, then, urgent)

    def download_buffers(self, device_bufs: list[torch.Tensor], then: Callable[[list], None]) -> None:
        """Moves buffers to the host at once and calls then(host_bufs) once they landed."""
        self._download(device_bufs, 1, then)

    @abstractmethod
    def scalar(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A 0-dim fp32 host copy of a device scalar (the loss) and the fence it is readable after
        (None: readable now); the caller reads it while the worker goes on."""

    def before_wait(self) -> None:
        """The worker is about to wait: held-back downloads go (the wait may be for their landing)
        and the next upload window (one, not all: a window sent now is one more in front of the
        activation copy that ends the wait)."""
        self.copies.before_wait()

    def drain(self) -> None:
        """Waits until every copy and callback issued ran; re-raises the first callback error."""
        self.copies.synchronize()
        self._completer.wait_idle(raise_errors=True)

    def abandon(self) -> None:
        """After an aborted call: let copies and callbacks finish, dropping their errors, and let go of the
        completed copies' buffers (the failed stage's weights and inputs die now, not at the next stage)."""
        self.copies.synchronize()
        self._completer.wait_idle()
        self._completer.discard_error()   # the call already failed with its first error
        self.copies.release_completed()


class _ComputeSpan:
    __slots__ = ("w", "seconds", "key", "report", "yielded", "t0", "timer", "tracker", "armed")

    def __init__(self, w: Worker, seconds: dict, key: Hashable, report: Callable[[float, float], None] | None):
        self.w, self.seconds, self.key, self.report = w, seconds, key, report
        self.yielded = w.yielded() if seconds.get(key, LONG_COMPUTE_S + 1) > LONG_COMPUTE_S else None
        self.tracker = None

    def __enter__(self) -> "_ComputeSpan":
        w = self.w
        self.armed = False
        if w._oom is not None and w._injected(_SPAN_KINDS.get(self.key[0], "")):   # the test seam
            if not w.records_workspace:
                raise torch.OutOfMemoryError(f"out of device memory (injected into a {_SPAN_KINDS[self.key[0]]} "
                                             f"compute on {w.name})")
            w.ledger.fail_next(f"injected into a {_SPAN_KINDS[self.key[0]]} compute")
            self.armed = True
        if self.yielded is not None:
            self.yielded.__enter__()
        testing.delay_point("compute")
        self.timer = w.timer_start() if self.report is not None else None
        self.tracker = w._workspace_tracker()
        if self.tracker is not None:
            self.tracker.__enter__()
        w.computing = self.key
        self.t0 = time.perf_counter()
        return self

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """The engine's own work inside the span: its allocations are not the compute's workspace."""
        tracker = self.tracker
        if tracker is None or tracker.paused:
            yield
            return
        tracker.paused = True
        try:
            yield
        finally:
            tracker.paused = False

    def __exit__(self, *exc) -> None:
        self.seconds[self.key] = time.perf_counter() - self.t0
        w = self.w
        w.computing = None
        if exc[0] is None:
            w._issued()
        else:   # no device call after a failure: a sticky CUDA error would replace it with its own
            w.progress_at = time.monotonic()
        if self.armed and w.ledger.armed:   # the span made no new storage: the injection lapses with it
            w.ledger.fail_next(None)
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
            self.tracker = None
        if self.timer is not None and exc[0] is None:
            self.w.timer_stop(self.timer, self.report)
        if self.yielded is not None:
            self.yielded.__exit__(*exc)
