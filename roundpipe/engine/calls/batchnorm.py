"""Whole-batch BatchNorm statistics: `RoundPipe(..., batchnorm="whole-batch")`.

By default ("per-microbatch") a BatchNorm layer in training mode behaves as it does
in PyTorch for each microbatch: it normalises with the microbatch's statistics and
updates its running statistics once per microbatch, so after one batch of M
microbatches `num_batches_tracked` counted M and the running mean followed M
momentum steps.  With "whole-batch" (torchgpipe calls it deferred batch norm) each
microbatch is still normalised with its own statistics, but the running statistics
are updated once per `forward_backward`, from the statistics of the whole batch, so
`running_mean`, `running_var` and `num_batches_tracked` equal plain PyTorch's on the
full batch:

- the workers' copies of every BatchNorm (1d/2d/3d, track_running_stats=True) run
  `F.batch_norm` without running statistics in training mode and record, during a
  microbatch's first forward only (never its recompute), per-channel sums and sums of
  squares in fp64;
- when the call ends (all its stages done), the sums are combined and the masters'
  running statistics take one momentum step (or the cumulative average when
  momentum is None), exactly as `nn.BatchNorm` does for one batch;
- the stage-end landings of those buffers are skipped (the workers never change
  them), so a call running under the next one cannot overwrite the update; a
  forward-only call waits for the calls in flight, so eval sees the newest statistics.

The cost: two reductions per BatchNorm and microbatch, and C doubles per BatchNorm and
microbatch kept until the call ends.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("per-microbatch", "whole-batch")
_STATS_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
_local = threading.local()


def is_tracked_batchnorm(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats \
        and m.running_mean is not None


def tracked(layers: list[nn.Module]) -> dict[tuple[int, str], nn.Module]:
    """(layer, module name) -> each BatchNorm of the masters whose running statistics are tracked."""
    return {(l, name): m for l, layer in enumerate(layers) for name, m in layer.named_modules()
            if is_tracked_batchnorm(m)}


def stats_buffer_indices(layer: nn.Module, buffer_names: list[str]) -> frozenset[int]:
    """Positions in the layer's buffer list of its BatchNorms' running statistics."""
    prefixes = {name for name, m in layer.named_modules() if is_tracked_batchnorm(m)}
    return frozenset(i for i, b in enumerate(buffer_names)
                     if b.rpartition(".")[2] in _STATS_BUFFERS and b.rpartition(".")[0] in prefixes)


class BatchStats:
    """One call's per-microbatch sums of every whole-batch BatchNorm input."""

    def __init__(self):
        self.parts: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, int]]] = defaultdict(list)

    def add(self, key: tuple[int, str], x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        x = x.detach()
        self.parts[key].append((x.sum(dims, dtype=torch.float64), (x.double() ** 2).sum(dims), x.numel() // x.shape[1]))

    def apply(self, modules: dict[tuple[int, str], nn.Module]) -> None:
        """One running-statistics update per BatchNorm from the whole batch (the call's end)."""
        with torch.no_grad(), BUFFERS_LOCK:
            for key, parts in self.parts.items():
                m = modules[key]
                n = sum(c for _, _, c in parts)
                total = sum(s.cpu() for s, _, _ in parts)
                squares = sum(q.cpu() for _, q, _ in parts)
                mean = total / n
                var = (squares - n * mean * mean) / max(n - 1, 1)   # unbiased, as nn.BatchNorm keeps it
                m.num_batches_tracked.add_(1)
                factor = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)


# Held while a layer's written buffers on the host change (a call's end updating the masters' running
# statistics, `BatchStats.apply`; a stage's landing of the buffers it wrote, stage.py) and while a stage
# snapshots them for its upload.  Uploads straight from the masters were read by copies that nothing
# ordered after those writes: a backward stage's upload beside the forward stage's landing of the same
# round, a later call's stages beside a call's end.  A GPU could upload a half-written statistic (caught
# as CopyRaceError under the strict device model, roundpipe/workers/strict.py, in test_batchnorm.py).
BUFFERS_LOCK = threading.Lock()


def buffers_snapshot(buffers: list[torch.Tensor], written: list[int], alloc) -> list[torch.Tensor]:
    """Private copies of a layer's written buffers in host blocks from `alloc`, for an upload (BUFFERS_LOCK)."""
    with BUFFERS_LOCK:
        return [alloc(buffers[i].shape, buffers[i].dtype).copy_(buffers[i]) for i in written]


@contextlib.contextmanager
def recording(stats: BatchStats | None) -> Iterator[None]:
    """Within the block, whole-batch BatchNorms on this thread add their inputs to `stats`."""
    prev = getattr(_local, "stats", None)
    _local.stats = stats
    try:
        yield
    finally:
        _local.stats = prev


def patch_replica(module: nn.Module, layer: int) -> None:
    """Makes the BatchNorms of a worker's copy of `layer` normalise without touching running stats."""
    for name, m in module.named_modules():
        if is_tracked_batchnorm(m):
            m.forward = _forward(m, (layer, name))


def _forward(m: nn.modules.batchnorm._BatchNorm, key: tuple[int, str]):
    plain = m.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not m.training:
            return plain(x)
        m._check_input_dim(x)
        stats = getattr(_local, "stats", None)
        if stats is not None:
            stats.add(key, x)
        return F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
    return forward
