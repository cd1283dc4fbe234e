"""Staleness compensation for the asynchronous step (docs/staleness.md).

    model = rp.RoundPipe(layers, compensation=rp.StalenessCompensation(predict=1.0, warmup_steps=100))

With `step(asynchronous=True)` the calls after step s read W_(s-1) while step s
computes W_s, so the gradient step s+1 applies to W_s was taken at W_(s-1): a
delay of tau = 1 step.  Two remedies from the asynchronous-pipeline literature:

  prediction      the step writes the upload copy of the predicted next weights,
                  w_s + alpha (w_s - w_(s-1)), instead of w_s, so the calls that
                  feed step s+1 take their gradient near where it will be applied
                  (weight prediction; PipeMare's discrepancy correction
                  extrapolates weights from their recent updates the same way).
                  The fused optimizer computes it in the pass that already reads
                  the old weight and writes the upload copy: no extra memory
                  traffic.  The fp32 masters stay w_s; only what workers read
                  changes.  Synchronous steps upload w_s as they are.
  rescheduling    PipeMare's learning-rate rescheduling (T1): step k uses
                  alpha_k = alpha * tau^(-p_k), p_k = max(0, 1 - k/K), i.e. the rate
                  divided by the delay at first, annealed to the plain rate over K
                  steps.  At the engine's delay of one step tau^(-p_k) = 1: it
                  changes nothing unless `delay` is set above 1 on purpose.

Only the roundpipe.optim optimizers (one fused pass per layer) support
prediction; a torch optimizer with it is a ValueError at step().
"""
from __future__ import annotations

import dataclasses
import math

import torch

from roundpipe.core.checks import is_int, is_number


@dataclasses.dataclass(frozen=True)
class StalenessCompensation:
    """predict: alpha of the weight prediction (0: none).  warmup_steps: K of PipeMare's rescheduling
    (0: none).  delay: tau, in steps (the asynchronous step's is 1)."""

    predict: float = 1.0
    warmup_steps: int = 0
    delay: float = 1.0

    def __post_init__(self):
        for name in ("predict", "delay"):
            v = getattr(self, name)
            if not is_number(v) or not math.isfinite(v):
                raise ValueError(f"StalenessCompensation.{name}={v!r} must be a finite number")
        if self.predict < 0:
            raise ValueError(f"StalenessCompensation.predict={self.predict!r} must be >= 0")
        if self.delay < 1:
            raise ValueError(f"StalenessCompensation.delay={self.delay!r} must be >= 1 (steps)")
        k = self.warmup_steps
        if not is_int(k) or k < 0:
            raise ValueError(f"StalenessCompensation.warmup_steps={k!r} must be an int >= 0")

    def lr_factor(self, step: int) -> float:
        """tau^(-p_k) for step k (0-based), p_k = max(0, 1 - k/K)."""
        if self.warmup_steps == 0 or self.delay == 1:
            return 1.0
        p = max(0.0, 1.0 - step / self.warmup_steps)
        return float(self.delay) ** (-p)


def predicted(new: torch.Tensor, old: torch.Tensor, alpha: float) -> torch.Tensor:
    """The reference formula: new + alpha * (new - old), in fp32 (tests compare the fused pass with it)."""
    return new.float() + alpha * (new.float() - old.float())
