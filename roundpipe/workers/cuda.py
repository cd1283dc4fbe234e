"""CUDA worker: one compute stream and four copy streams per worker (docs/transfers.md).

    param_up    host upload copies -> device weights (and buffers) of a stage
    act_up      stage inputs (pinned host) and labels -> device
    act_down    stage outputs and input gradients -> pinned host
    grad_down   fp32 parameter gradients and buffers -> pinned host

The four copy streams belong to the worker's CopyEngine (CUDA backend: one
cudaMemcpyAsync per piece, an event per submission), so up and down copies
keep both PCIe directions busy and bulk windows ride behind activation copies.
Ordering between streams is by events only (`make_stream_wait` for the
compute stream), never by a device-wide synchronisation; the worker thread
only *issues* work.  Host memory comes from the model's pinned HostArena.

Every device buffer is allocated from the compute stream's pool, so one pool
serves the worker and reserved memory follows the ledger (an upload waits for
the compute issued before its buffer was allocated, which may still read the
reused block); tensors used on a stream other than the one that allocated them
are marked with `record_stream`, so the caching allocator does not hand their
memory out again before that stream is done with them.

Progress for the stall watchdog is compute the GPU has done (Worker.poll_progress): with the
watchdog on, a fence recorded on the compute stream after each compute span and microbatch
counts when it completes, not when this thread issued the work (issue 51, item 6).

Stage timings (`RoundPipe.stage_timing`) are GPU execution times: a pair of
timing events around each stage-microbatch on the compute stream, read once
the end event has completed (polled after later microbatches and at drain),
so measuring never stalls the compute stream.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from roundpipe.workers.base import Alloc, Owns, Worker

HIGH_PRIORITY = -100   # below the device's range: mapped to its highest priority


class CudaWorker(Worker):
    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype, alloc: Alloc | None = None,
                 owns: Owns | None = None):
        with torch.cuda.device(device):
            # The critical path (compute and activation copies) at the device's highest stream
            # priority (torch maps -100 to it), bulk copies at the default: the kernels of those
            # streams go first.  Priorities do not reorder copies (docs/transfers.md): the windows do.
            self.s_compute = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
            self.s_act_up = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
            self.s_act_down = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
            self.s_param_up = torch.cuda.Stream(device)
            self.s_grad_down = torch.cuda.Stream(device)
        super().__init__(device, name, compute_dtype, alloc, owns)
        # Needs the native core and the CUDA runtime it loads; its RuntimeError says what is missing.
        self.copies.attach_streams(device, [self.s_act_up, self.s_act_down, self.s_param_up, self.s_grad_down])
        self._streams = {"act_up": self.s_act_up, "act_down": self.s_act_down,
                         "param_up": self.s_param_up, "grad_down": self.s_grad_down}
        self._timers: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float, float], None]]] = []
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    prefetches = True
    stages_pageable = True   # a copy from pageable memory would hold this thread (Worker.stages_pageable)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.s_compute):
            yield

    def _empty(self, shape: torch.Size, dtype: torch.dtype, queue: str) -> torch.Tensor:
        # From the compute stream's pool (issue 26 part 2, item 7): the caching allocator reuses a
        # block only on the stream that allocated it, so with uploads allocated on their copy
        # streams reserved memory was the sum of four per-stream peaks, and the cap and the ledger
        # held for live tensors only.  Such a block may still be read by kernels queued on the
        # compute stream before it was freed: the copy filling it waits for the compute issued so
        # far (`_alloc_fences`, recorded after the allocations), and record_stream keeps the block
        # from being handed out again before the copy stream is done writing it.
        with torch.cuda.stream(self.s_compute):
            t = torch.empty(shape, dtype=dtype, device=self.device)
        t.record_stream(self._streams[queue])
        return t

    def _alloc_fences(self) -> list:
        return [self._compute_fence()]

    def _from_gpu(self, t: torch.Tensor, ready: Any) -> torch.Tensor:
        if t.device != self.device:
            # A copy between devices reads t on this thread's current stream of t's device: t's
            # block (allocated on the caller's stream) may not be reused before that stream is done.
            t.record_stream(torch.cuda.current_stream(t.device))
            return super()._from_gpu(t, ready)
        # Same device: the compute stream waits for the caller's stream on the GPU, and the caching
        # allocator may not reuse t's block before this stream is done with it.  The consumer gets
        # a copy of its own, made on the compute stream (issue 26 part 2, item 1): an in-place first
        # layer would otherwise write the call's snapshot (a forward-only call: the caller's tensor).
        if ready is not None:
            self.s_compute.wait_event(ready)
        t.record_stream(self.s_compute)
        with torch.cuda.stream(self.s_compute):
            return self.ledger.track(t.clone(), "activations")

    def _compute_fence(self) -> Any:
        from roundpipe.offload import stream_fence
        return stream_fence(self.s_compute)

    def _compute_waits(self, fences: Sequence) -> None:
        from roundpipe.offload import make_stream_wait
        for f in fences:
            if f is not None:
                make_stream_wait(f, self.s_compute)

    def _read_by_copy(self, tensors: Sequence[torch.Tensor], queue: str) -> None:
        for t in tensors:
            t.record_stream(self._streams[queue])

    def _used_by_compute(self, tensors: Sequence[torch.Tensor]) -> None:
        # Uploads were allocated on a copy stream, a same-device handoff on another worker's
        # compute stream: their blocks must wait for this compute stream too before reuse.
        for t in tensors:
            if t.device.type == "cuda":
                t.record_stream(self.s_compute)

    def scalar(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # Copied on the compute stream (current here) into pinned memory; the caller waits for the
        # fence recorded after it, not for the worker's later stages.
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(t.detach().float().reshape(()), non_blocking=True)
        return host, self._compute_fence()

    # ---- GPU timing
    def timer_start(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True, blocking=True)   # a blocking wait sleeps (item 5)
        ev.record(self.s_compute)
        return ev

    def timer_stop(self, start: torch.cuda.Event, report: Callable[[float, float], None]) -> None:
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        end.record(self.s_compute)
        self._timers.append((start, end, report))
        self._resolve_timers(block=False)

    def _resolve_timers(self, block: bool) -> None:
        """Reports every timed run whose end event completed (all of them when block)."""
        while self._timers:
            start, end, report = self._timers[0]
            if not block and not end.query():
                return
            end.synchronize()
            if self._anchor is None:
                # Host time of one completed event: GPU times are reported on the perf_counter clock.
                self._anchor = (end, time.perf_counter())
            anchor, at = self._anchor
            self._timers.pop(0)
            report(at + anchor.elapsed_time(start) / 1e3, at + anchor.elapsed_time(end) / 1e3)

    def _sync_streams(self) -> None:
        # Through blocking-sync events, not Stream.synchronize: under the default device flags that
        # spins a core for the whole wait (every call's end), beside the OpenMP optimizer step
        # that needs the cores (issue 26 part 2, item 5; the pooled fences are created the same way).
        # The copy streams hold every copy only once the held-back windows were sent (`_idle`).
        events = []
        for s in (self.s_compute, self.s_param_up, self.s_act_up, self.s_act_down, self.s_grad_down):
            ev = torch.cuda.Event(blocking=True)
            ev.record(s)
            events.append(ev)
        for ev in events:
            ev.synchronize()

    def _idle(self) -> None:
        """Waits, sleeping, until the device has done everything issued: held-back copy windows are sent
        first, then every stream's blocking event is waited for.  Only then does the base class's
        `copies.synchronize()` run: the native engine's cudaStreamSynchronize on each copy stream spins a
        core for as long as the stream is busy (issue 51, item 7: it ran first, spinning through every
        call's tail of copies); on idle streams it returns at once, and still drops the references the
        engine holds to completed copies' buffers."""
        self.copies.flush()
        self._sync_streams()

    def drain(self) -> None:
        self._idle()
        self._resolve_timers(block=True)
        super().drain()

    def abandon(self) -> None:
        self._idle()
        self._timers.clear()
        super().abandon()
