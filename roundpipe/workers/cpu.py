"""CPU worker: a thread computing on the host, behind the same interface as a GPU.

"Device" memory is host memory, so copies are plain tensor copies done on the
worker's own thread; they are still real copies (a worker never computes on
the host upload copy or on another worker's tensors), which keeps the
protocol identical to the CUDA worker and lets the tests catch a missing wait.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from roundpipe.microbatch import tree_map
from roundpipe.testing import delay_point
from roundpipe.workers.base import Handoff, Worker


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class CpuWorker(Worker):
    def upload_params(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
        delay_point("param_up")
        return [u.to(self.compute_dtype if u.is_floating_point() else u.dtype, copy=True) for u in host], None

    def upload_buffers(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        return [b.clone() for b in host]

    def send(self, value: Any, need_host: bool, keep_device: bool) -> Handoff:
        delay_point("act_down")
        return Handoff(host=tree_map(_detach, value), device=self.device)

    def receive(self, handoff: Handoff) -> Any:
        delay_point("act_up")
        return tree_map(_clone, handoff.host)

    def download_grads(self, grads: list[torch.Tensor | None], then: Callable[[list], None]) -> None:
        delay_point("grad_down")
        then([None if g is None else g.float() for g in grads])

    def download_buffers(self, device_bufs: list[torch.Tensor], then: Callable[[list], None]) -> None:
        then(device_bufs)

    def scalar(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().clone()
