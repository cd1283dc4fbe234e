"""`AllReduce`: the gradient averaging of W data-parallel ranks, as the engine does it.

Each of W ranks runs the same RoundPipe pipeline on its own microbatches; after
the training calls of a step have ended, the G-copy thread all-reduces every
layer's fp32 gradient over torch.distributed (roundpipe/engine/data_parallel.py):
layers last to first (the LM head first), packed into buckets like DDP's (a
bucket takes layers until it holds at least `bucket_bytes`, so it may exceed the
cap by its last layer), one all_reduce per bucket, one bucket after another.

A bucket of B bytes costs a ring all-reduce (reduce-scatter then all-gather,
2(W-1) steps each moving B/W bytes per rank):

    t(B) = 2 (W-1)/W * B / bandwidth  +  2 (W-1) * latency

`bandwidth_gbps` is the per-rank link bandwidth (NCCL's "bus bandwidth"), in
GB/s = 1e9 bytes/s; `latency_us` the per-step latency.  With W = 1 nothing is
reduced.  Differences from the engine, all small: the engine buckets per
parameter tensor (a bucket may split a layer; here buckets hold whole layers),
and sends one extra float per tensor ("does this rank have a gradient").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from roundpipe.core.checks import check_number, is_int

BUCKET_BYTES = 25 << 20   # the engine's default (DDP's bucket_cap_mb=25)
MIB = 1 << 20


def ring_time(nbytes: float, ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Seconds of one ring all-reduce of `nbytes` over `ranks` ranks (0 for one rank)."""
    w = ranks
    return 2 * (w - 1) / w * nbytes / (bandwidth_gbps * 1e9) + 2 * (w - 1) * latency_us * 1e-6


@dataclass(frozen=True)
class AllReduce:
    """W ranks and their gradient all-reduce: bytes per layer, link bandwidth and latency, bucket cap."""

    ranks: int
    grad_bytes: tuple[float, ...]  # fp32 gradient bytes per layer, the LM head last (layers + 1 entries)
    bandwidth_gbps: float          # per-rank ring bandwidth, GB/s (1e9 bytes/s)
    latency_us: float = 0.0        # per ring step, microseconds
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self):
        if not is_int(self.ranks) or self.ranks < 1:
            raise ValueError(f"ranks={self.ranks!r} must be an int >= 1 (data-parallel processes)")
        grads = tuple(check_number(f"grad_bytes[{i}]", v) for i, v in enumerate(self.grad_bytes))
        if len(grads) < 2:
            raise ValueError(f"grad_bytes has {len(grads)} entries; give one per layer plus the LM head last")
        object.__setattr__(self, "grad_bytes", grads)
        object.__setattr__(self, "bandwidth_gbps", check_number("bandwidth_gbps", self.bandwidth_gbps, positive=True))
        object.__setattr__(self, "latency_us", check_number("latency_us", self.latency_us))
        if not is_int(self.bucket_bytes) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes!r} must be an int >= 1")

    @classmethod
    def uniform(cls, ranks: int, layers: int, grad_bytes: float, head_grad_bytes: float = 0.0,
                **kwargs) -> "AllReduce":
        """`grad_bytes` for each of `layers` layers, `head_grad_bytes` for the LM head."""
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers={layers!r} must be an int >= 1")
        return cls(ranks, (grad_bytes,) * layers + (head_grad_bytes,), **kwargs)

    @classmethod
    def from_params(cls, ranks: int, params: Sequence[int], **kwargs) -> "AllReduce":
        """Trainable parameter counts per layer (LM head last), 4 gradient bytes each (fp32)."""
        return cls(ranks, tuple(4 * p for p in params), **kwargs)

    @property
    def num_layers(self) -> int:
        """Layers without the LM head."""
        return len(self.grad_bytes) - 1

    def buckets(self) -> list[list[int]]:
        """Layer indices per bucket, in reduction order (LM head = index num_layers first).

        A layer without gradient bytes is in no bucket (the engine reduces trainable tensors only)."""
        if self.ranks == 1:
            return []
        out, cur, size = [], [], 0.0
        for layer in reversed(range(len(self.grad_bytes))):
            if self.grad_bytes[layer] == 0:
                continue
            cur.append(layer)
            size += self.grad_bytes[layer]
            if size >= self.bucket_bytes:
                out.append(cur)
                cur, size = [], 0.0
        return out + ([cur] if cur else [])

    def bucket_times(self) -> list[float]:
        """Seconds of each bucket's all-reduce, in reduction order."""
        return [ring_time(sum(self.grad_bytes[l] for l in b), self.ranks, self.bandwidth_gbps, self.latency_us)
                for b in self.buckets()]

    def time(self) -> float:
        """Seconds of one step's reduction: the buckets one after another on one thread."""
        return sum(self.bucket_times())
