"""CPU worker: a thread computing on the host, modelled as a device of its own.

Its "device memory" is a set of host tensors that only this worker computes
on, filled and drained through a host-backend CopyEngine (memcpy threads) with
the same queues, LPT windows and fences as a GPU's copy streams.  Compute is
synchronous on the worker thread, so "compute waits for a copy" is a host wait
on the copy's fence and the compute issued so far needs no fence.  Copies run
concurrently with compute, so a missing wait reads a half-copied tensor, and
the tests' random delays turn that into a wrong number.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from roundpipe.workers.base import Worker


class CpuWorker(Worker):
    def _empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def _compute_fence(self) -> None:
        return None

    def _compute_waits(self, fences: Sequence) -> None:
        for f in fences:
            if f is not None:
                f.wait()

    def scalar(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().clone()
