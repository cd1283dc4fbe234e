"""Fences: completion of asynchronous copies, whatever backend ran them.

A fence is what the copy engine returns for every submission and what the host
arena waits for before reusing a freed block.  The native types are used as is:

- `Fence`: `done()`, `wait()` (GIL released), `state` ('pending'/'done'/'failed'),
  `error`, `kind` ('host'/'cuda'), `cuda_event` (raw handle, 0 for host fences).
- `HostFence(set=False)`: completed by a host thread with `set()` or `fail(msg)`;
  the host copy backend returns these, and tests use them as fake events.
- `CudaEventFence`: a cudaEvent_t queried through the CUDA runtime roundpipe loads
  at run time; `make_stream_wait(stream)` makes a stream wait for it on the GPU.
  Recorded fences take their event from a per-device pool and give it back when they
  die (`CudaEventFence.pool_stats()`: created, reused), so a raw `cuda_event` handle
  is valid only while its fence lives.

The helpers below bridge to torch's stream objects.
"""
from __future__ import annotations

from typing import Iterable

import torch

from roundpipe import _native


def _c():
    return _native.require()


def check_fence(name: str, fence: object) -> None:
    if not isinstance(fence, _c().Fence):
        raise TypeError(f"{name} must be a roundpipe fence (from the copy engine, HostFence or "
                        f"stream_fence), got {type(fence).__name__}")


def stream_fence(stream: "torch.cuda.Stream | None" = None):
    """A fence that completes when the work queued on `stream` so far (default: current) is done."""
    if stream is None:
        stream = torch.cuda.current_stream()
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    return _c().CudaEventFence.record(stream.cuda_stream, stream.device.index)


def make_stream_wait(fence, stream: "torch.cuda.Stream | None" = None) -> None:
    """Makes `stream` (default: current) wait for `fence` on the GPU; host fences are waited for here."""
    check_fence("fence", fence)
    if fence.kind != "cuda":
        fence.wait()
        return
    if stream is None:
        stream = torch.cuda.current_stream()
    fence.make_stream_wait(stream.cuda_stream)


def wait_all(fences: Iterable) -> None:
    """Waits for every fence (GIL released during each wait); RuntimeError if one failed."""
    if not isinstance(fences, Iterable):
        raise TypeError(f"fences must be an iterable of fences, got {type(fences).__name__}")
    for i, f in enumerate(fences):
        check_fence(f"fences[{i}]", f)
        f.wait()
