"""A worker's copies: the four queues of its CopyEngine and the LPT windows of bulk traffic.

Activation copies (a microbatch's stage input up, its output down) go out at
once.  A stage's parameter upload or gradient download is bulk: it is packed
into M windows by LPT (roundpipe.offload.pack_lpt) and window w is submitted
only when the next activation copy of the same direction is, behind that
copy's fence (docs/transfers.md):

    act_up    : | x(m1)        | x(m2)        | x(m3)        |
    param_up  :     | W1 chunk 0   | W1 chunk 1   | W1 chunk 2  ...  next stage's weights
    act_down  : | y(m0)        | y(m1)        | y(m2)        |
    grad_down :     | G0 chunk 0   | G0 chunk 1   | G0 chunk 2  ...  previous stage's grads

so bulk bytes never delay an activation.  Windows still unsent are submitted
by `flush` when the bulk is needed (weights about to be used, a P-copy
waiting for the upload, the end of the worker's part of a call); when the
worker is about to block, `before_wait` sends every held-back download (the
wait may be for one of their landings) and one upload window, so the queues
work during the wait without piling every upload byte in front of the
activation copy that ends it.

Without the native core the copies are done synchronously with torch (no
windows, no fences: every fence is None, meaning "done").  A host engine may
also do submissions of at most `inline_bytes` on the issuing thread, after
waiting for their fences: on the 2-core CI machine a round trip through a
memcpy thread measured 71 us for a 128-byte copy against 0.6 us inline, which
is what the engine overhead per stage-microbatch is made of.  Under the test hook
(roundpipe.testing.inject_delays) each copy is held back by a fence that a
helper thread sets after the hook returns, so a copy completes late while its
issuer goes on, and a missing wait gives a wrong number.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from roundpipe import _native, testing
from roundpipe.workers.strict import StrictQueues

QUEUES = ("act_up", "act_down", "param_up", "grad_down")
_BULK_OF = {"act_up": "param_up", "act_down": "grad_down"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


_ALL_SENT = threading.Event()   # shared by the bulks sent in full when made (most of a CPU worker's)
_ALL_SENT.set()


def _copy_inline(dsts: list, srcs: list) -> None:
    """The pairs copied on this thread: same-dtype contiguous host pairs in one native pass (each
    torch copy_ of a large tensor wakes the OpenMP team: ~28 us a tensor), the rest with copy_."""
    if len(dsts) == 1:   # an activation copy: the per-microbatch path
        dsts[0].copy_(srcs[0])
        return
    raw, rest = [], []
    for d, s in zip(dsts, srcs):
        plain = (d.dtype == s.dtype and d.numel() == s.numel() and d.device.type == s.device.type == "cpu"
                 and d.is_contiguous() and s.is_contiguous())
        (raw if plain else rest).append((d, s))
    if len(raw) > 1:
        _native.lib.copy_many([d.data_ptr() for d, _ in raw], [s.data_ptr() for _, s in raw], [s.nbytes for _, s in raw])
    else:
        rest += raw
    for d, s in rest:
        d.copy_(s)


class Bulk:
    """A stage's parameter upload or gradient download: windows, and the fences of those sent."""

    def __init__(self, queue: str, windows: list[tuple[list, list]], after: list):
        self.queue = queue
        self.unsent: deque = deque(windows)
        self.after = after           # fences every window waits for (e.g. the compute that made the grads)
        self.fences: list = []
        self.sent = threading.Event() if self.unsent else _ALL_SENT


class Transfers:
    """The copy queues of one worker (see the module docstring)."""

    def __init__(self, device: torch.device, inline_bytes: int = 0):
        self.native = _native.available()
        self.inline_bytes = inline_bytes
        if self.native:
            from roundpipe.offload import CopyEngine, pack_lpt
            self._pack = pack_lpt
            self.engine = CopyEngine(device) if device.type == "cpu" else None  # CUDA: attach_streams()
        self._lock = threading.Lock()
        self._waiting: dict[str, deque[Bulk]] = {"param_up": deque(), "grad_down": deque()}
        self._released_down = 0   # download windows activation copies released since the last pace()
        self._stage = 0            # stage ends seen (flush_downloads)
        self._downs: deque[tuple[int, Bulk]] = deque()   # downloads not known complete, with their stage
        self._act_downs: deque = deque()   # activation download fences not known complete, oldest first
        self._clocks: dict[str, _CopyClock] = {}
        self.strict: StrictQueues | None = None   # the strict device model's queues (a CPU worker: strict.py)
        self.on_copy: Callable[[str, int, float, float], None] | None = None   # see record_copies
        self.on_microbatch: Callable[[], None] | None = None   # after each microbatch_done (the worker's progress)

    def record_copies(self, on_copy: Callable[[str, int, float, float], None] | None) -> None:
        """Reports every copy from now on as on_copy(queue, bytes, issued, completed) (None: stop).

        Completion times come from one thread per queue waiting for the copies' fences in
        order (a queue completes in submission order); they exist only while recording."""
        with self._lock:
            self.on_copy = on_copy
            if on_copy is None:
                for clock in self._clocks.values():
                    clock.stop()
                self._clocks.clear()

    def attach_streams(self, device: torch.device, streams: Sequence["torch.cuda.Stream"]) -> None:
        """CUDA: the engine issues on the worker's own four copy streams (act_up, act_down, param_up, grad_down)."""
        from roundpipe.offload import CopyEngine
        self.engine = CopyEngine(device, streams=list(streams))

    # ---- submission
    def _submit(self, queue: str, dsts: list, srcs: list, after: list, urgent: bool = False) -> Any:
        issued = time.perf_counter()
        fence = self._issue(queue, dsts, srcs, after, urgent)
        if self.on_copy is not None:
            nbytes = sum(s.nbytes for s in srcs)
            if fence is None:   # done on this thread
                self.on_copy(queue, nbytes, issued, time.perf_counter())
            else:
                clock = self._clocks.get(queue)
                if clock is None:
                    clock = self._clocks[queue] = _CopyClock(queue, self.on_copy)
                clock.add(fence, nbytes, issued)
        return fence

    def _issue(self, queue: str, dsts: list, srcs: list, after: list, urgent: bool = False) -> Any:
        if not self.native:
            testing.delay_point(queue)
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return None
        after = [f for f in after if f is not None]
        if self.strict is not None:
            return self.strict.submit(queue, dsts, srcs, after)
        if self._inline(srcs, urgent):
            for f in after:
                f.wait()
            _copy_inline(dsts, srcs)
            return None
        if testing.delays_active():
            held = _native.lib.HostFence()

            def release() -> None:
                try:
                    testing.delay_point(queue)
                finally:
                    held.set()
            threading.Thread(target=release, daemon=True).start()
            after.append(held)
        return self.engine.copy_many(queue, dsts, srcs, after=after or None)

    def _inline(self, srcs: list, urgent: bool = False) -> bool:
        """Whether a copy runs on the issuing thread: a host engine's small copies, and its urgent ones
        (the issuer waits for them next, so a copy thread would only add two hand-offs, and the
        issuer's torch threads copy faster than one memcpy thread)."""
        left = self.inline_bytes
        if left <= 0 or testing.delays_active():
            return False
        if urgent:
            return True
        for s in srcs:
            left -= s.nbytes
            if left < 0:
                return False
        return True

    def done_on_issue(self, srcs: list) -> bool:
        """Whether an activation copy of srcs would be complete when `activation` returns (copied on the
        issuing thread: no native core, or a host engine's small copy)."""
        return not self.native or self._inline(srcs)

    def activation(self, queue: str, dsts: list, srcs: list, after: Sequence = ()) -> Any:
        """An activation copy now; the oldest held-back bulk window of its direction goes right behind it."""
        with self._lock:
            fence = self._submit(queue, dsts, srcs, list(after))
            if queue == "act_down" and fence is not None:   # None: copied inline, already done
                self._act_downs.append(fence)
            waiting = self._waiting[_BULK_OF[queue]]
            if waiting:
                self._send_one(waiting, [fence])
                if queue == "act_down":
                    self._released_down += 1
            return fence

    def bulk(self, queue: str, dsts: list, srcs: list, windows: int, after: Sequence = (),
             urgent: bool = False) -> Bulk:
        """A stage's bulk copy packed into `windows` windows, held back until activation copies release them.

        urgent: the issuer has nothing to overlap it with (it waits for the copy next), so it goes at once,
        on the issuing thread where the engine copies inline (`_inline`)."""
        after = list(after)
        # One window, urgent, or small enough to be copied inline: nothing to hold back, sent at once.
        now = not self.native or windows <= 1 or urgent or self._inline(srcs)
        if now or len(dsts) == 0:
            b = Bulk(queue, [], after)
            if dsts:
                with self._lock:
                    b.fences.append(self._submit(queue, dsts, srcs, after, urgent))
                    if queue == "grad_down":
                        self._downs.append((self._stage, b))
            return b
        dbytes, sbytes = [_bytes(d) for d in dsts], [_bytes(s) for s in srcs]
        plan = self._pack([d.numel() for d in dbytes], windows)
        wins = [([dbytes[i][o:o + n] for i, o, n in win], [sbytes[i][o:o + n] for i, o, n in win])
                for win in plan if win]
        b = Bulk(queue, wins, after)
        if b.unsent:
            with self._lock:
                self._waiting[queue].append(b)
                if queue == "grad_down":
                    self._downs.append((self._stage, b))
        return b

    def _send_locked(self, b: Bulk, extra: list) -> None:
        dsts, srcs = b.unsent.popleft()
        b.fences.append(self._submit(b.queue, dsts, srcs, b.after + extra))
        if not b.unsent:
            b.sent.set()

    def _send_one(self, waiting: deque, extra: list) -> None:
        b = waiting[0]
        self._send_locked(b, extra)
        if not b.unsent:
            waiting.popleft()

    def before_wait(self) -> None:
        """The issuer is about to block: every held-back download goes (what it waits for may be
        one of their landings, e.g. a layer's buffers from its previous round), and the next
        upload window (uploads are waited for only by their own issuer, who flushes them)."""
        if not (self._waiting["param_up"] or self._waiting["grad_down"]):
            return
        with self._lock:
            downs = self._waiting["grad_down"]
            while downs:
                self._send_one(downs, [])
            ups = self._waiting["param_up"]
            if ups:
                self._send_one(ups, [])

    def microbatch_done(self) -> None:
        """A microbatch's compute was issued: `pace` the previous stage's gradients, keep at most this
        microbatch's output downloading (`bound_activation_downloads`), and let go of completed
        copies (its input and landed downloads die now, not at the stage's end)."""
        self.pace()
        self.bound_activation_downloads()
        self.release_completed()
        if self.on_microbatch is not None:
            self.on_microbatch()

    def pace(self) -> None:
        """If no activation download released a held-back download window since the last pace,
        one goes now.  A stage whose outputs stay on the
        device (a same-device hand-off) downloads no activation, and the previous stage's
        gradients would wait for the end of the worker's part of the call (all of them on the
        device at once); paced, a stage's M windows leave during the next stage's M microbatches."""
        if not self._waiting["grad_down"]:
            self._released_down = 0
            return
        with self._lock:
            downs = self._waiting["grad_down"]
            if downs and self._released_down == 0:
                self._send_one(downs, [])
            self._released_down = 0

    def bound_activation_downloads(self, keep: int = 1) -> None:
        """Waits until at most `keep` activation downloads are in flight: each keeps its device source
        alive (the memory model counts one microbatch's output beside the running one), so a copy path
        slower than the compute throttles the compute instead of growing device memory (seen on CPU
        workers under load: six outputs of a forward stage alive at once, 1.1x the prediction)."""
        while len(self._act_downs) > keep:
            with self._lock:
                fence = self._act_downs.popleft()
            fence.wait()

    def flush_downloads(self) -> None:
        """A stage ended: every held-back download goes now, and those issued before it began (the
        previous stage's gradients, which had this whole stage to leave) are waited for, so a worker
        holds the gradients of at most one stage besides the running one's, as the memory model
        counts them (roundpipe/planner/memory.py): a slow copy path throttles compute, never memory.
        Before, two earlier stages' could be in flight at once (1.1x the prediction under delays)."""
        with self._lock:
            downs = self._waiting["grad_down"]
            while downs:
                self._send_one(downs, [])
            old = []
            while self._downs and self._downs[0][0] <= self._stage:
                old.append(self._downs.popleft()[1])
            self._stage += 1
        for b in old:
            for f in b.fences:
                if f is not None:
                    f.wait()

    def flush(self, only: Bulk | None = None) -> None:
        """Sends the held-back windows now: of `only`, or of every bulk (the worker is about to wait)."""
        if not (self._waiting["param_up"] or self._waiting["grad_down"]):
            return   # the common case, without taking the lock (a racing append is flushed by its own waiter)
        with self._lock:
            for waiting in self._waiting.values():
                for b in list(waiting):
                    if only is None or b is only:
                        while b.unsent:
                            self._send_locked(b, [])
                        waiting.remove(b)

    # ---- completion
    @staticmethod
    def wait_sent(b: Bulk) -> list:
        """The fences of a bulk once every window has been sent (by activation copies or a flush)."""
        b.sent.wait()
        return b.fences

    def wait(self, b: Bulk) -> None:
        """Host wait for a bulk copy to complete, sending its held-back windows first."""
        self.flush(b)
        for f in b.fences:
            if f is not None:
                f.wait()

    def release_completed(self) -> None:
        """Lets go of the buffers of completed copies (the end of a stage: its weights must die now)."""
        if self.native and self.engine is not None:
            self.engine.release_completed()

    def synchronize(self) -> None:
        self.flush()
        if self.strict is not None:
            self.strict.synchronize()
        if self.native and self.engine is not None:
            self.engine.synchronize()


class _CopyClock:
    """Completion times of one queue's copies while they are recorded: a thread waits for each
    fence in submission order and reports (queue, bytes, issued, completed)."""

    def __init__(self, queue: str, report: Callable[[str, int, float, float], None]):
        self.queue, self.report = queue, report
        self.cv = threading.Condition()
        self.pending: deque = deque()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"roundpipe-copy-clock-{queue}", daemon=True)
        self.thread.start()

    def add(self, fence: Any, nbytes: int, issued: float) -> None:
        with self.cv:
            self.pending.append((fence, nbytes, issued))
            self.cv.notify()

    def stop(self) -> None:
        """Reports what is pending (copies of ended calls have completed), then the thread ends."""
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join(10.0)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.pending and not self.stopped:
                    self.cv.wait()
                if not self.pending:
                    return
                fence, nbytes, issued = self.pending.popleft()
            try:
                fence.wait()
            except Exception:  # noqa: BLE001 - a failed copy is reported by its waiter, not the clock
                continue
            self.report(self.queue, nbytes, issued, time.perf_counter())
