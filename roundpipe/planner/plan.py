"""`Plan`: which consecutive layers form each forward and each backward stage.

Forward and backward use different partitions (docs/planner.md).  Backward stages are
listed in execution order, so they run from the last layer towards layer 0; the
first one is the *fused* tail stage: forward, loss and backward of the last layers
run back to back with no recompute.  Forward stages cover exactly the layers
before the fused stage, in order.  Example for 12 layers:

    forward : [0-3] [4-7]            (2 stages, 4 layers each)
    backward: [8-11]* [6-7] [4-5] [2-3] [0-1]   (* = fused tail)

    Plan(forward=[range(0, 4), range(4, 8)],
         backward=[range(8, 12), range(6, 8), range(4, 6), range(2, 4), range(0, 2)])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def _as_range(stage: object, what: str) -> range:
    if isinstance(stage, range):
        if stage.step != 1:
            raise ValueError(f"{what} = {stage!r} must have step 1 (consecutive layers)")
        return stage
    if isinstance(stage, (list, tuple)) and stage and all(isinstance(i, int) for i in stage):
        r = range(stage[0], stage[-1] + 1)
        if list(stage) != list(r):
            raise ValueError(f"{what} = {list(stage)} must list consecutive layer indices")
        return r
    raise TypeError(f"{what} must be a range or a list of consecutive ints, got {stage!r}")


@dataclass(frozen=True)
class Plan:
    """Forward stages (in order) and backward stages (in execution order, fused tail first)."""

    forward: tuple[range, ...]
    backward: tuple[range, ...]

    def __init__(self, forward: Sequence[range], backward: Sequence[range]):
        fwd = tuple(_as_range(s, f"forward stage {i}") for i, s in enumerate(forward))
        bwd = tuple(_as_range(s, f"backward stage {i}") for i, s in enumerate(backward))
        object.__setattr__(self, "forward", fwd)
        object.__setattr__(self, "backward", bwd)
        if not bwd:
            raise ValueError("backward must hold at least one stage (the fused tail stage)")
        for what, stages in (("forward", fwd), ("backward", bwd)):
            for i, s in enumerate(stages):
                if len(s) == 0:
                    raise ValueError(f"{what} stage {i} ({s!r}) is empty")
                if s.start < 0:
                    raise ValueError(f"{what} stage {i} ({s!r}) starts at a negative layer index")
        # Backward stages run tail-first and must tile [0, L) with no gap or overlap.
        for i in range(1, len(bwd)):
            if bwd[i].stop != bwd[i - 1].start:
                kind = "overlaps" if bwd[i].stop > bwd[i - 1].start else "leaves a gap before"
                raise ValueError(f"backward stage {i} ({bwd[i]!r}) {kind} backward stage {i - 1} "
                                 f"({bwd[i - 1]!r}); backward stages must run from the last layer down to 0")
        if bwd[-1].start != 0:
            raise ValueError(f"backward stage {len(bwd) - 1} ({bwd[-1]!r}) must end at layer 0 "
                             f"(layers 0..{bwd[-1].start - 1} have no backward stage)")
        fused = bwd[0]
        expect = 0
        for i, s in enumerate(fwd):
            if s.start != expect:
                kind = "overlaps the previous stage" if s.start < expect else f"leaves a gap (layers {expect}..{s.start - 1})"
                raise ValueError(f"forward stage {i} ({s!r}) {kind}; forward stages must be consecutive from layer 0")
            expect = s.stop
        if expect != fused.start:
            raise ValueError(f"forward stages cover layers [0, {expect}) but the fused tail stage "
                             f"{fused!r} starts at {fused.start}; they must meet exactly")

    @property
    def num_layers(self) -> int:
        return self.backward[0].stop

    @property
    def fused(self) -> range:
        return self.backward[0]

    def check(self, num_layers: int) -> "Plan":
        """Raises ValueError unless this plan covers exactly layers [0, num_layers)."""
        if self.num_layers != num_layers:
            raise ValueError(f"plan covers {self.num_layers} layers (fused tail stage {self.fused!r}) "
                             f"but the model has {num_layers}")
        return self

    def stages(self) -> list[tuple[str, range]]:
        """The slot sequence of one iteration: ('F', r)..., then ('B', r)... (first B is fused)."""
        return [("F", r) for r in self.forward] + [("B", r) for r in self.backward]

    @classmethod
    def uniform(cls, num_layers: int, backward_per_stage: int = 1, forward_ratio: int = 3,
                fused_layers: int | None = None) -> "Plan":
        """Size-based default: backward stages of `backward_per_stage` layers, forward stages
        `forward_ratio` times larger, and a fused tail of `fused_layers` (default one backward stage)."""
        for name, v in (("num_layers", num_layers), ("backward_per_stage", backward_per_stage),
                        ("forward_ratio", forward_ratio)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        fused_layers = min(backward_per_stage, num_layers) if fused_layers is None else fused_layers
        if not isinstance(fused_layers, int) or not 1 <= fused_layers <= num_layers:
            raise ValueError(f"fused_layers={fused_layers!r} must be an int in [1, {num_layers}]")
        head = num_layers - fused_layers
        backward = [range(head, num_layers)]
        backward += [range(max(0, s - backward_per_stage), s) for s in range(head, 0, -backward_per_stage)]
        step = backward_per_stage * forward_ratio
        forward = [range(s, min(s + step, head)) for s in range(0, head, step)]
        return cls(forward=forward, backward=backward)

    def __repr__(self) -> str:
        fmt = lambda rs: "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in rs) + "]"
        return f"Plan(forward={fmt(self.forward)}, backward={fmt(self.backward)})"
