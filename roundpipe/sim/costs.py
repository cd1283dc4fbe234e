"""`Costs`: the inputs of a simulation, and their bridge to the planner.

Modelling rules (so results compare with published ones):
- every schedule uses full recomputation: a layer's backward work is its forward
  time (the recompute) plus its backward time, except in RoundPipe's fused stage,
  which runs forward, loss and backward back to back with no recompute;
- the LM head (+ loss) is never recomputed: its forward and backward run in the
  last stage of the static schedules and in RoundPipe's fused stage;
- `comm` is charged once per hop between two different workers (activation
  forward, gradient backward), as a delay that does not occupy either worker;
- the backward splits into B (input gradient, on the critical path) and W (weight
  gradient, needed only by the optimizer step), as in Zero Bubble (Qi et al., ICLR
  2024): W is `w_fraction` of every layer's and the head's backward-only time.
  Only the split schedules (zb-*, roundpipe-zb) run W apart; with the default 0
  they are their unsplit counterparts' schedules;
- `recompute=False` (the Zero Bubble paper's model: activations kept) drops the
  recompute from the weight-bound schedules' backward; RoundPipe always recomputes.

All times are seconds per microbatch.  `bwd` here is backward *only*; the
planner's `LayerCost.bwd_s` is recompute + backward = fwd + bwd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from roundpipe.core.checks import check_number, is_int, is_number
from roundpipe.planner.costs import LayerCost
from roundpipe.planner.plan import Plan


def _check_nonneg(name: str, v: object) -> float:
    return check_number(name, v, unit=" (seconds)")


@dataclass(frozen=True)
class Costs:
    """Per-layer forward and backward-only times, LM-head times and per-hop communication."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    head_fwd: float = 0.0
    head_bwd: float = 0.0
    comm: float = 0.0
    w_fraction: float = 0.0    # share of each backward that is the weight gradient W (0: not split)
    recompute: bool = True     # weight-bound schedules recompute the forward in the backward

    def __post_init__(self):
        fwd = tuple(_check_nonneg(f"fwd[{i}]", v) for i, v in enumerate(self.fwd))
        bwd = tuple(_check_nonneg(f"bwd[{i}]", v) for i, v in enumerate(self.bwd))
        if not fwd:
            raise ValueError("fwd is empty: the model needs at least one layer")
        if len(fwd) != len(bwd):
            raise ValueError(f"fwd has {len(fwd)} layers but bwd has {len(bwd)}; give one time per layer in each")
        object.__setattr__(self, "fwd", fwd)
        object.__setattr__(self, "bwd", bwd)
        for name in ("head_fwd", "head_bwd", "comm"):
            object.__setattr__(self, name, _check_nonneg(name, getattr(self, name)))
        w = self.w_fraction
        if not is_number(w) or not 0 <= w <= 1:
            raise ValueError(f"w_fraction={w!r} must be a number in [0, 1] (the weight-gradient share of a backward)")
        object.__setattr__(self, "w_fraction", float(w))
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute={self.recompute!r} must be a bool")

    @classmethod
    def uniform(cls, layers: int, fwd: float, bwd: float, head_fwd: float = 0.0, head_bwd: float = 0.0,
                comm: float = 0.0, w_fraction: float = 0.0, recompute: bool = True) -> "Costs":
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers={layers!r} must be an int >= 1")
        return cls((fwd,) * layers, (bwd,) * layers, head_fwd, head_bwd, comm, w_fraction, recompute)

    @property
    def num_layers(self) -> int:
        return len(self.fwd)

    def forward(self, layers: range) -> float:
        return sum(self.fwd[i] for i in layers)

    def backward(self, layers: range, recompute: bool = True) -> float:
        """Backward work of `layers`: recompute (forward again) + backward, or backward only."""
        return sum(self.bwd[i] + (self.fwd[i] if recompute else 0.0) for i in layers)

    def input_grad(self, layers: range, recompute: bool = True) -> float:
        """B of `layers`: recompute (if asked) + the input-gradient part of the backward."""
        return self.backward(layers, recompute) - self.weight_grad(layers)

    def weight_grad(self, layers: range) -> float:
        """W of `layers`: the weight-gradient part of the backward."""
        return self.w_fraction * sum(self.bwd[i] for i in layers)

    @property
    def head_weight_grad(self) -> float:
        """W of the LM head (its dW matmul; the loss backward and dX are B)."""
        return self.w_fraction * self.head_bwd

    @classmethod
    def from_planner(cls, costs: Sequence[LayerCost], comm: float = 0.0) -> "Costs":
        """The inverse of `planner_costs`: the last planner layer becomes the LM head."""
        costs = list(costs)
        if len(costs) < 2:
            raise ValueError(f"costs has {len(costs)} layers; need the layers plus the LM head as the last one")
        *layers, head = costs
        return cls(tuple(c.fwd_s for c in layers), tuple(max(0.0, c.bwd_s - c.fwd_s) for c in layers),
                   head.fwd_s, max(0.0, head.bwd_s - head.fwd_s), comm)

    def planner_costs(self) -> list[LayerCost]:
        """The layers plus the LM head as one last layer, in the planner's cost model."""
        layers = [LayerCost(f, f + b) for f, b in zip(self.fwd, self.bwd)]
        return layers + [LayerCost(self.head_fwd, self.head_fwd + self.head_bwd)]


def sizes_from_plan(plan: Plan, costs: Costs) -> tuple[list[int], list[int]]:
    """RoundPipe stage sizes (in layers, head excluded) of a plan over `planner_costs()`.

    The plan's last layer is the head, always in the fused stage, so the fused stage
    loses one layer and may end up with none (it then holds only the head and loss)."""
    plan.check(costs.num_layers + 1)
    forward = [len(r) for r in plan.forward]
    backward = [len(plan.backward[0]) - 1] + [len(r) for r in plan.backward[1:]]
    return forward, backward


def check_sizes(name: str, sizes: Sequence[int], total: int, allow_empty_first: bool = False) -> list[int]:
    """Validates a list of stage sizes that must sum to `total` layers."""
    sizes = list(sizes)
    for i, s in enumerate(sizes):
        if not is_int(s) or s < (0 if allow_empty_first and i == 0 else 1):
            raise ValueError(f"{name}[{i}]={s!r} must be an int >= {0 if allow_empty_first and i == 0 else 1}")
    if sum(sizes) != total:
        raise ValueError(f"{name}={sizes} covers {sum(sizes)} layers but the model has {total}")
    return sizes
