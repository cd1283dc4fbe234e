"""`LayerCost`: what the planner knows about one layer, and the stage cost model.

Costs are per microbatch.  `bwd_s` is the time of a backward stage's work for the
layer, i.e. recompute (forward again) plus backward.  The fused tail stage runs
forward, loss and backward back to back with no recompute, so a fused layer costs
forward + backward-only = fwd_s + (bwd_s - fwd_s) = bwd_s as well: every backward
stage, fused or not, costs the sum of its layers' `bwd_s`.  The LM head is the last
layer of the sequence, so it always sits in the fused stage and is never recomputed.

Stage memory (what must fit in half the device budget, the other half holding the
prefetched next stage, docs/planner.md):

    forward stage : sum(param_bytes) + its activations at their worst moment
    backward stage: sum(param_bytes + grad_bytes) + its activations and workspace at their
                    worst moment (recompute, the loss for the fused stage, backward)
                    (grad_bytes: the fp32 accumulators of the trainable parameters,
                     GRAD_FACTOR * param_bytes when unknown)

The activation terms come from each layer's measured `LayerMemory` (roundpipe/planner/memory.py),
or from `act_bytes` alone before anything was measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from roundpipe.core.checks import is_number
from roundpipe.planner.memory import LayerMemory, backward_bytes, forward_bytes, layer_memory

# fp32 gradient accumulators next to bf16/fp16 weights: 4 bytes per 2-byte parameter.
GRAD_FACTOR = 2.0
# With full recomputation a backward stage costs forward + backward ~= 1 + 2 forwards.
BWD_PER_FWD = 3.0


@dataclass(frozen=True)
class LayerCost:
    """Per-microbatch cost of one layer: seconds and bytes."""

    fwd_s: float            # forward time
    bwd_s: float            # recompute + backward time (what a backward stage spends on it)
    param_bytes: int = 0    # low-precision weights uploaded for the layer
    act_bytes: int = 0      # activations kept for its backward, one microbatch
    # gradient bytes a backward stage holds for it (fp32 accumulators of its trainable parameters);
    # None: param_bytes * GRAD_FACTOR
    grad_bytes: int | None = None
    memory: LayerMemory | None = None   # measured by the dry run; None: LayerMemory.rough(act_bytes)

    def __post_init__(self):
        for name in ("fwd_s", "bwd_s", "param_bytes", "act_bytes", "grad_bytes"):
            v = getattr(self, name)
            if name == "grad_bytes" and v is None:
                continue
            if not is_number(v) or not v >= 0:
                raise ValueError(f"LayerCost.{name}={v!r} must be a number >= 0")

    @property
    def grads(self) -> float:
        return self.param_bytes * GRAD_FACTOR if self.grad_bytes is None else self.grad_bytes

    @classmethod
    def from_size(cls, params: int, tokens: int, *, flops_per_s: float = 100e12,
                  act_bytes_per_token: float = 0.0, param_bytes_each: int = 2) -> "LayerCost":
        """Size-based estimate before anything is measured: 2 FLOPs per parameter and token
        forward, BWD_PER_FWD times that for recompute + backward."""
        if not isinstance(params, int) or params < 0:
            raise ValueError(f"params={params!r} must be an int >= 0")
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens={tokens!r} must be an int >= 1 (tokens per microbatch)")
        if not flops_per_s > 0:
            raise ValueError(f"flops_per_s={flops_per_s!r} must be > 0")
        fwd = 2.0 * params * tokens / flops_per_s
        return cls(fwd, BWD_PER_FWD * fwd, params * param_bytes_each, int(act_bytes_per_token * tokens))


def estimate_costs(layers: Sequence[object], tokens: int, **kwargs) -> list[LayerCost]:
    """`LayerCost.from_size` for each layer: an int parameter count or a module with `.parameters()`."""
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, int):
            params = layer
        elif hasattr(layer, "parameters"):
            params = sum(p.numel() for p in layer.parameters())
        else:
            raise TypeError(f"layers[{i}] = {layer!r} must be a parameter count or a module with .parameters()")
        out.append(LayerCost.from_size(params, tokens, **kwargs))
    return out


def check_costs(costs: Sequence[LayerCost]) -> list[LayerCost]:
    costs = list(costs)
    if not costs:
        raise ValueError("costs is empty: the planner needs at least one layer")
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise TypeError(f"costs[{i}] = {c!r} must be a LayerCost")
    return costs


def forward_time(costs: Sequence[LayerCost], layers: range) -> float:
    return sum(costs[i].fwd_s for i in layers)


def backward_time(costs: Sequence[LayerCost], layers: range) -> float:
    return sum(costs[i].bwd_s for i in layers)


def forward_memory(costs: Sequence[LayerCost], layers: range) -> float:
    return sum(costs[i].param_bytes for i in layers) + forward_bytes(layer_memory(costs), layers)


def backward_memory(costs: Sequence[LayerCost], layers: range, fused: bool = False, layer_grain: bool = False) -> float:
    return sum(costs[i].param_bytes + costs[i].grads for i in layers) + backward_bytes(
        layer_memory(costs), layers, fused, layer_grain)
