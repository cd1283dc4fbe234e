"""Layers whose compute is a sleep: the engine's schedule measured without the CPU's arithmetic.

`time.sleep` releases the GIL, so CPU workers sleeping in their layers really run side
by side, as GPUs would; a layer's forward takes `fwd_s`, its backward `bwd_s` (a
recompute sleeps `fwd_s` again).  The same times feed the simulator
(`roundpipe.sim.Costs.uniform(layers, fwd_s, bwd_s)`), so a measured engine trace and a
simulated one can be put side by side (bench/overlap.py).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from roundpipe.core.checks import is_number


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """y = tanh(x W + b) that also sleeps `fwd_s` in its forward and `bwd_s` in its backward."""

    def __init__(self, width: int = 8, fwd_s: float = 2e-3, bwd_s: float = 4e-3):
        super().__init__()
        for name, v in (("fwd_s", fwd_s), ("bwd_s", bwd_s)):
            if not is_number(v) or not v >= 0:
                raise ValueError(f"{name}={v!r} must be a number of seconds >= 0")
        self.fc = nn.Linear(width, width)
        self.fwd_s, self.bwd_s = float(fwd_s), float(bwd_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(torch.tanh(self.fc(x)), self.fwd_s, self.bwd_s)


def sleep_layers(n: int, width: int = 8, fwd_s: float = 2e-3, bwd_s: float = 4e-3, seed: int = 0) -> list[SleepLayer]:
    """n layers initialised from `seed` (the caller's RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [SleepLayer(width, fwd_s, bwd_s) for _ in range(n)]
