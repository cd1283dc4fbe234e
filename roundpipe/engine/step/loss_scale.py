"""Dynamic loss scaling for fp16 compute, inside the engine's step protocol.

    model = rp.RoundPipe(layers, compute_dtype=torch.float16)      # scaling on, LossScale() defaults
    model = rp.RoundPipe(layers, precision=rp.Precision(torch.float16, loss_scale=rp.LossScale(init_scale=2**12)))
    model.loss_scale                                               # the scale the next steps use

The tail stage multiplies each microbatch's loss by the scale, so the gradients
workers send home in fp16 do not underflow.  The step then checks every
gradient of every layer for inf/NaN before it updates any layer: an overflowed
step is skipped for every layer (masters and optimizer state untouched, lr
scheduler not stepped, its gradients dropped) and the scale is multiplied by
`backoff_factor`; after `growth_interval` good steps in a row it is multiplied by
`growth_factor`.  A good step reads the gradients times clip_coef / scale (the
fused optimizer folds both into its one pass; any other optimizer gets p.grad
unscaled first).

What p.grad reads.  The gradients follow PyTorch: `p.grad` after synchronize()
is the true gradient, unscaled as torch's GradScaler.unscale_ does it (times the
fp32 reciprocal of the scale, `inverse_scale`; inf/NaN stay inf/NaN), and the
step then reads those gradients as they are instead of unscaling them again
(HostState.materialize records per layer that they are unscaled).  Only the
gradients nobody looked at stay scaled until the step's one pass.

Which scale a call uses, so that every gradient one step reads carries the same
scale and runs are reproducible (no dependence on thread timing).  Steps are
numbered as issued; history[s] is the scale (and good-step count) after step s,
history[0] the initial one.  The calls issued between step s and step s+1 form
step s+1's gradient group and use history[s] after a synchronous step s and
history[s-1] after an asynchronous one: the calls of its stale window run while
step s itself is still pending, so they use the result of the step before, which
is known by the time any of their losses is computed (their uploads wait for step
s-1's update, which follows its check).  Step s+1 unscales by that same scale.
On an overflow the new scale is min(current, scale used * backoff), so one
overflow seen by two consecutive groups (the asynchronous delay) halves the scale
once.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable

import torch

from roundpipe.core.checks import is_int, is_number


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling options (the defaults of torch.amp.GradScaler)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self):
        for name, lo in (("init_scale", 0.0), ("growth_factor", 1.0)):
            v = getattr(self, name)
            if not is_number(v) or not math.isfinite(v) or v <= lo:
                raise ValueError(f"LossScale.{name}={v!r} must be a finite number > {lo:g}")
        b = self.backoff_factor
        if not is_number(b) or not 0 < b < 1:
            raise ValueError(f"LossScale.backoff_factor={b!r} must be a number in (0, 1)")
        g = self.growth_interval
        if not is_int(g) or g < 1:
            raise ValueError(f"LossScale.growth_interval={g!r} must be an int >= 1")
        if not isinstance(self.enabled, bool):
            raise TypeError(f"LossScale.enabled must be True or False, got {self.enabled!r}")


def inverse_scale(scale: float) -> float:
    """The factor that unscales a gradient, as torch.amp.GradScaler.unscale_ computes it: the
    reciprocal of the fp32 scale in float64, rounded to fp32 (exactly 1 / scale for a power of two)."""
    if not is_number(scale) or not 0 < scale < math.inf:
        raise ValueError(f"scale={scale!r} must be a finite number > 0 (a loss scale)")
    return float(torch.tensor(scale, dtype=torch.float32).double().reciprocal().float())


def resolve(option: LossScale | None, compute_dtype: torch.dtype) -> LossScale | None:
    """The model's loss scaling: on by default for float16, off otherwise unless asked for."""
    if option is not None and not isinstance(option, LossScale):
        raise TypeError(f"loss_scale must be a roundpipe.LossScale or None, got {type(option).__name__}")
    if option is None:
        return LossScale() if compute_dtype == torch.float16 else None
    return option if option.enabled else None


class LossScaler:
    """The scale history of one model (see the module docstring); thread-safe."""

    def __init__(self, config: LossScale):
        self.config = config
        self._cv = threading.Condition()
        self.history: dict[int, tuple[float, int]] = {0: (float(config.init_scale), 0)}   # step -> (scale, good)
        self.skipped: list[int] = []   # steps skipped for overflow (bounded: the last 1000)

    @staticmethod
    def group_index(steps_issued: int, latest_asynchronous: bool) -> int:
        """The history entry the calls issued now (and the step after them) use."""
        return steps_issued - 1 if latest_asynchronous and steps_issued > 0 else steps_issued

    def scale_of(self, index: int, abort: Callable[[], bool] | None = None) -> float:
        """history[index]'s scale, waiting until that step has checked its gradients."""
        with self._cv:
            while index not in self.history:
                if abort is not None and abort():
                    from roundpipe.core.errors import Aborted
                    raise Aborted()
                self._cv.wait(0.05)
            return self.history[index][0]

    def inverse(self, index: int) -> float | None:
        """inverse_scale of history[index]'s scale, or None while that step has not checked its
        gradients (no wait: a sync point has every issued step done)."""
        with self._cv:
            entry = self.history.get(index)
        return inverse_scale(entry[0]) if entry is not None else None

    def record(self, step: int, used: int, found_inf: bool) -> None:
        """Step `step` (whose gradients carry history[used]'s scale) found inf/NaN or not."""
        c = self.config
        with self._cv:
            scale, good = self.history[step - 1]
            if found_inf:
                scale, good = min(scale, self.history[used][0] * c.backoff_factor), 0
                self.skipped = (self.skipped + [step])[-1000:]
            else:
                good += 1
                if good >= c.growth_interval:
                    scale, good = scale * c.growth_factor, 0
            self.history[step] = (scale, good)
            for k in [k for k in self.history if k < step - 2]:
                del self.history[k]
            self._cv.notify_all()

    @property
    def scale(self) -> float:
        with self._cv:
            return self.history[max(self.history)][0]

    # ---- checkpoints: the entries relative to the latest issued step
    def state(self, steps_issued: int) -> dict:
        with self._cv:
            return {"history": {str(k - steps_issued): list(v) for k, v in self.history.items()
                                if k <= steps_issued}, "skipped": len(self.skipped)}

    def load(self, state: dict, steps_issued: int) -> None:
        with self._cv:
            self.history = {int(k) + steps_issued: (float(v[0]), int(v[1])) for k, v in state["history"].items()}
            self._cv.notify_all()
