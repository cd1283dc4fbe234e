"""`Profiler`: per-layer costs measured on the real workers, smoothed.

The engine times whole stages, not layers: one call per stage and phase, e.g.
"backward stage over layers 20..23 took 41 ms for 4 microbatches".  The profiler
splits the per-microbatch time over the stage's layers in proportion to their
current costs (the size-based estimate at first), then folds the share into each
layer's value with an exponential moving average:

    first sample : value = sample               (replaces the size-based estimate)
    later samples: value = (1 - alpha) * value + alpha * sample

Layers never measured in a phase (the fused tail's forward, say) keep their
estimate scaled by the median measured/estimated ratio of that phase, so a
size-based estimate in the wrong units (a guessed FLOP rate) does not distort the
plan once anything at all has been measured.

Phases: "forward" (forward stage), "backward" (recompute + backward) and "fused"
(forward + loss + backward with no recompute; in the cost model this is the
layers' `bwd_s`, see roundpipe.planner.costs).
"""
from __future__ import annotations

import statistics
import threading
from dataclasses import replace
from typing import Literal, Sequence

from roundpipe.core.checks import is_int
from roundpipe.planner.costs import LayerCost, check_costs

Phase = Literal["forward", "backward", "fused"]
_FIELD = {"forward": "fwd_s", "backward": "bwd_s", "fused": "bwd_s"}


class Profiler:
    """Smoothed per-layer costs; thread-safe `record` so every worker can report."""

    def __init__(self, estimates: Sequence[LayerCost], alpha: float = 0.3):
        self.estimates = check_costs(estimates)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1] (weight of a new sample)")
        self.alpha = alpha
        n = len(self.estimates)
        self._value = {"fwd_s": [0.0] * n, "bwd_s": [0.0] * n}
        self._samples = {"fwd_s": [0] * n, "bwd_s": [0] * n}
        self._act: list[int | None] = [None] * n
        self._lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        return len(self.estimates)

    def _layers(self, layers: range | int) -> range:
        if is_int(layers):
            layers = range(layers, layers + 1)
        if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
            raise TypeError(f"layers={layers!r} must be a layer index or a non-empty range of consecutive layers")
        if layers.start < 0 or layers.stop > self.num_layers:
            raise ValueError(f"layers={layers!r} is outside [0, {self.num_layers})")
        return layers

    def record(self, layers: range | int, phase: Phase, seconds: float, microbatches: int = 1,
               act_bytes: int | None = None) -> None:
        """One measured stage: `seconds` of `phase` work over `layers` for `microbatches` microbatches.

        `act_bytes`, if given, is the stage's peak activation memory for one microbatch
        (split over its layers like the time)."""
        layers = self._layers(layers)
        if phase not in _FIELD:
            raise ValueError(f"phase={phase!r} must be one of {sorted(_FIELD)}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches={microbatches!r} must be an int >= 1")
        if not seconds >= 0:
            raise ValueError(f"seconds={seconds!r} must be >= 0")
        field = _FIELD[phase]
        per_mb = seconds / microbatches
        with self._lock:
            current = self._current(field)
            weights = [current[i] for i in layers]
            total = sum(weights)
            # All-zero estimates (e.g. parameter-free layers) share the time equally.
            shares = [w / total for w in weights] if total > 0 else [1 / len(layers)] * len(layers)
            for i, share in zip(layers, shares):
                sample = per_mb * share
                n = self._samples[field][i]
                v = self._value[field]
                v[i] = sample if n == 0 else (1 - self.alpha) * v[i] + self.alpha * sample
                self._samples[field][i] = n + 1
            if act_bytes is not None:
                if not isinstance(act_bytes, int) or act_bytes < 0:
                    raise ValueError(f"act_bytes={act_bytes!r} must be an int >= 0")
                acts = [self.estimates[i].act_bytes for i in layers]
                a_total = sum(acts)
                for i, a in zip(layers, acts):
                    self._act[i] = round(act_bytes * (a / a_total if a_total else 1 / len(layers)))

    def _current(self, field: str) -> list[float]:
        """Measured value where there is one, else the estimate times the phase's median ratio."""
        est = [getattr(c, field) for c in self.estimates]
        counts, values = self._samples[field], self._value[field]
        ratios = [values[i] / est[i] for i in range(len(est)) if counts[i] and est[i] > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        return [values[i] if counts[i] else est[i] * scale for i in range(len(est))]

    def costs(self) -> list[LayerCost]:
        """The current per-layer costs the planner should use."""
        with self._lock:
            fwd, bwd = self._current("fwd_s"), self._current("bwd_s")
            return [replace(c, fwd_s=f, bwd_s=b, act_bytes=c.act_bytes if a is None else a)
                    for c, f, b, a in zip(self.estimates, fwd, bwd, self._act)]

    def coverage(self) -> float:
        """Fraction of (layer, fwd/bwd) values that come from at least one measurement."""
        with self._lock:
            done = sum(1 for f in ("fwd_s", "bwd_s") for n in self._samples[f] if n)
        return done / (2 * self.num_layers)

    def table(self) -> str:
        """The costs as an aligned text table (ms, MiB; '*' marks measured values)."""
        costs = self.costs()
        with self._lock:
            mf, mb = list(self._samples["fwd_s"]), list(self._samples["bwd_s"])
        rows = [("layer", "fwd ms", "rec+bwd ms", "params MiB", "act MiB/mb")]
        for i, c in enumerate(costs):
            rows.append((str(i), f"{c.fwd_s * 1e3:.3f}" + ("*" if mf[i] else " "),
                         f"{c.bwd_s * 1e3:.3f}" + ("*" if mb[i] else " "),
                         f"{c.param_bytes / 2**20:.1f}", f"{c.act_bytes / 2**20:.1f}"))
        total = lambda name: sum(getattr(c, name) for c in costs)
        rows.append(("total", f"{total('fwd_s') * 1e3:.3f} ", f"{total('bwd_s') * 1e3:.3f} ",
                     f"{total('param_bytes') / 2**20:.1f}", f"{total('act_bytes') / 2**20:.1f}"))
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
