"""The worker interface: one device, one thread, and the copies a stage needs.

A worker is stateless between stages.  The dispatcher hands it a list of
closures per call; it runs them in order on its own thread.  Everything that
moves data goes through the methods below, so the stage code in
roundpipe/stage.py is the same for a CPU and a CUDA worker:

    upload_params   host upload copies -> device weights        (parameter-up stream)
    upload_buffers  host buffers -> device                      (parameter-up stream)
    send            stage output -> Handoff (host copy and/or device tensors)
    receive         Handoff -> tensors on this device           (activation-up stream)
    download_grads  fp32 gradient accumulators -> host, then a callback on the host
    download_buffers device buffers -> host masters, then a callback

A `Handoff` carries an activation or gradient between two stage runs.  The
host copy lives in (pinned) host memory; when the consumer runs on the
producer's device the device tensors are handed over directly and the host
round trip is skipped.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from roundpipe.executor import SerialExecutor
from roundpipe.recompute import RngDomain


@dataclass
class Handoff:
    """An activation (or gradient) between a producer and its consumers."""

    host: Any = None             # nest of host tensors, or None when only the device copy exists
    host_ready: Any = None       # event the host copy waits for (CUDA), None when ready
    device: torch.device | None = None
    device_value: Any = None     # nest of device tensors for a consumer on the same device
    device_ready: Any = None     # producer-stream event guarding device_value (CUDA)


class Worker(ABC):
    """A device plus the thread that drives it."""

    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype):
        self.device = device
        self.name = name
        self.compute_dtype = compute_dtype
        self.rng = RngDomain.of(device)
        self._thread = SerialExecutor(f"roundpipe-{name}")

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs fn on this worker's thread after everything submitted before (fn handles its errors)."""
        self._thread.submit(fn)

    def close(self) -> None:
        self._thread.close()

    def executors(self) -> list[SerialExecutor]:
        """The threads this worker owns (stopped by the model's finalizer if it is never closed)."""
        return [self._thread]

    def compute(self) -> contextlib.AbstractContextManager:
        """Context in which stage compute is issued (the compute stream on CUDA)."""
        return contextlib.nullcontext()

    @property
    def pinned_host(self) -> bool:
        return False

    # True when uploads run asynchronously, so issuing the next stage's weights and the next
    # microbatch's input early overlaps compute.  CPU workers copy synchronously and gain nothing,
    # but tests switch it on to run the prefetch paths in CI.
    prefetches: bool = False

    @abstractmethod
    def upload_params(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        """Device copies of host tensors in compute dtype; also returns a wait for the copy's end."""

    @abstractmethod
    def upload_buffers(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of buffers, in their own dtype."""

    @abstractmethod
    def send(self, value: Any, need_host: bool, keep_device: bool) -> Handoff:
        """Publishes a stage output; need_host: a consumer is elsewhere or it is a stage input to keep."""

    @abstractmethod
    def receive(self, handoff: Handoff) -> Any:
        """The handoff's tensors on this device, private to the caller (safe to modify)."""

    @abstractmethod
    def download_grads(self, grads: list[torch.Tensor | None], then: Callable[[list], None]) -> None:
        """Moves fp32 gradients to the host and calls then(host_grads) on the host once they landed."""

    @abstractmethod
    def download_buffers(self, device_bufs: list[torch.Tensor], then: Callable[[list], None]) -> None:
        """Moves buffers to the host and calls then(host_bufs) once they landed."""

    @abstractmethod
    def scalar(self, t: torch.Tensor) -> torch.Tensor:
        """A 0-dim fp32 CPU copy of a device scalar (used for the loss)."""

    def drain(self) -> None:
        """Waits until every callback issued by download_* ran; re-raises their first error."""

    def abandon(self) -> None:
        """After an aborted call: drop pending callbacks' effects and wait for the device."""
        self.drain()
