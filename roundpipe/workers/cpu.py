"""CPU worker: a thread computing on the host, modelled as a device of its own.

Its "device memory" is a set of host tensors that only this worker computes
on, filled and drained through a host-backend CopyEngine (memcpy threads) with
the same queues, LPT windows and fences as a GPU's copy streams.  Compute is
synchronous on the worker thread, so "compute waits for a copy" is a host wait
on the copy's fence and the compute issued so far needs no fence.  Copies run
concurrently with compute, so a missing wait reads a half-copied tensor, and
the tests' random delays turn that into a wrong number.

Copies of at most `inline_copy_bytes` run on the worker thread itself (after
waiting for their fences) unless the test delay hook is on: a thread handoff
costs ~70 us on a small machine, more than the compute of a small stage
(see roundpipe/workers/transfers.py).  Set it to 0 to send everything through
the copy threads.
"""
from __future__ import annotations

from typing import Sequence

import torch

from roundpipe.workers.base import Alloc, Worker


class CpuWorker(Worker):
    inline_copy_bytes: int = 64 << 10
    lands_inline = True

    def __init__(self, device: torch.device, name: str, compute_dtype: torch.dtype, alloc: Alloc | None = None):
        super().__init__(device, name, compute_dtype, alloc)
        self.copies.inline_bytes = self.inline_copy_bytes

    def _empty(self, shape: torch.Size, dtype: torch.dtype, queue: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def _compute_fence(self) -> None:
        return None

    def _compute_waits(self, fences: Sequence) -> None:
        for f in fences:
            if f is not None:
                f.wait()

    def scalar(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().clone()
