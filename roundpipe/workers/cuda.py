"""CUDA worker: one compute stream and four copy streams per worker (DESIGN.md 3.1).

    param_up    host upload copies -> device weights (and buffers) of a stage
    act_up      stage inputs (pinned host) and labels -> device
    act_down    stage outputs and input gradients -> pinned host
    grad_down   fp32 parameter gradients and buffers -> pinned host, once per stage

Two directions of PCIe are busy at once because up and down copies sit on
different streams; ordering between streams is by CUDA events only, never by
a device-wide synchronisation.  The worker thread only *issues* work, so a
stage's compute queues up while the previous copies are still in flight.
Host-side effects that need a finished copy (landing gradients, writing
buffers back) run on a small completion thread that waits for the copy's
event, so the issuing thread never blocks on a download.

Tensors allocated on one stream and used on another are marked with
`record_stream`, so the caching allocator does not hand their memory out
again before the other stream is done with it.  Pinned host buffers come from
`HostState.alloc` (the seam the host arena replaces).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from roundpipe.executor import SerialExecutor
from roundpipe.host_state import HostState
from roundpipe.microbatch import tree_map
from roundpipe.testing import delay_point
from roundpipe.workers.base import Handoff, Worker


def _pinned_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return HostState.alloc(t.shape, dtype or t.dtype, True)


class CudaWorker(Worker):
    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype):
        with torch.cuda.device(device):
            self.s_compute = torch.cuda.Stream(device)
            self.s_param_up = torch.cuda.Stream(device)
            self.s_act_up = torch.cuda.Stream(device)
            self.s_act_down = torch.cuda.Stream(device)
            self.s_grad_down = torch.cuda.Stream(device)
        self._completer = SerialExecutor(f"roundpipe-{name}-completer")
        super().__init__(device, name, compute_dtype)

    @property
    def pinned_host(self) -> bool:
        return True

    prefetches = True

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.s_compute):
            yield

    def _event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _use_on_compute(self, x: Any) -> Any:
        def mark(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(self.s_compute)
            return t
        return tree_map(mark, x)

    def _up(self, stream: torch.cuda.Stream, host: Any, after: torch.cuda.Event | None) -> Any:
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dev = tree_map(lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, host)
            self.s_compute.wait_event(self._event(stream))
        return self._use_on_compute(dev)

    def upload_params(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        delay_point("param_up")
        with torch.cuda.stream(self.s_param_up):
            dev = [u.to(self.device, non_blocking=True) for u in host]
            done = self._event(self.s_param_up)
        self.s_compute.wait_event(done)
        self._use_on_compute(dev)
        return dev, done.synchronize

    def upload_buffers(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._up(self.s_param_up, host, None)

    def _down(self, stream: torch.cuda.Stream, x: Any, dtype: torch.dtype | None = None) -> tuple[Any, torch.cuda.Event]:
        stream.wait_event(self._event(self.s_compute))
        with torch.cuda.stream(stream):
            def copy(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                dst = _pinned_like(t, dtype)
                dst.copy_(t, non_blocking=True)
                t.record_stream(stream)
                return dst
            host = tree_map(copy, x)
            return host, self._event(stream)

    def send(self, value: Any, need_host: bool, keep_device: bool) -> Handoff:
        h = Handoff(device=self.device)
        if keep_device:
            h.device_value = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)
            h.device_ready = self._event(self.s_compute)
        if need_host:
            delay_point("act_down")
            h.host, h.host_ready = self._down(self.s_act_down, tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value))
        return h

    def receive(self, handoff: Handoff) -> Any:
        delay_point("act_up")
        if handoff.device_value is not None and handoff.device == self.device:
            if handoff.device_ready is not None:
                self.s_compute.wait_event(handoff.device_ready)
            return self._use_on_compute(handoff.device_value)
        return self._up(self.s_act_up, handoff.host, handoff.host_ready)

    def download_grads(self, grads: list[torch.Tensor | None], then: Callable[[list], None]) -> None:
        delay_point("grad_down")
        self._land(*self._down(self.s_grad_down, grads, torch.float32), then)

    def download_buffers(self, device_bufs: list[torch.Tensor], then: Callable[[list], None]) -> None:
        self._land(*self._down(self.s_grad_down, device_bufs), then)

    def _land(self, host: list, done: torch.cuda.Event, then: Callable[[list], None]) -> None:
        """Runs then(host) on the completion thread once the download's event has fired."""
        def job() -> None:
            done.synchronize()
            then(host)
        self._completer.submit(job)

    def scalar(self, t: torch.Tensor) -> torch.Tensor:
        # Stays on the device: the caller reads it after drain() synchronised the streams.
        return t.detach().float().reshape(())

    def _sync_streams(self) -> None:
        for s in (self.s_compute, self.s_param_up, self.s_act_up, self.s_act_down, self.s_grad_down):
            s.synchronize()

    def drain(self) -> None:
        self._sync_streams()
        self._completer.wait_idle(raise_errors=True)

    def abandon(self) -> None:
        self._sync_streams()
        self._completer.wait_idle()
        self._completer.discard_error()   # the call already failed with its first error

    def close(self) -> None:
        super().close()
        self._completer.close()

    def executors(self) -> list[SerialExecutor]:
        return super().executors() + [self._completer]
