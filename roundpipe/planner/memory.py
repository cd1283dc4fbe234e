"""The device-memory model: what a worker holds while it runs a stage, predicted per layer.

The planner's dry run (roundpipe/engine/memory_probe.py) runs each layer once on one
microbatch, forward without grad, forward with grad and backward, counting the bytes
of every storage the layer's ops make, and when they die.  That gives a `LayerMemory` per layer (bytes, one microbatch):

    in_bytes    the layer's input                 out_bytes   its output
    nograd      peak made by a forward without grad (a forward stage), output included
    saved       alive after a forward with grad: what its backward keeps, output included
    recompute   peak made during that forward with grad
    backward    peak made from the start of the forward with grad to the end of the
                backward, the gradient flowing in not counted (it is the layer above's)
    param_grads the .grad of its trainable parameters in low precision (0 in fp32), which
                stays until the stage's backward ends (then it is added to fp32 accumulators)
    loss        (the last layer, in a training call) peak made by the loss and its backward,
                with the labels

A stage of layers a..b on one worker then holds, at its worst moment (docs/architecture.md,
"What a worker holds"):

    forward    in_a + max_j (nograd_j + in_j for j > a)
    backward   in_a + max( max_j (sum_{i<j} saved_i + recompute_j),
                          max_j (sum_{i<j} saved_i + backward_j + out_j + param_grads of the layers above j) )
               + the fp32 gradient accumulators of a..b
    fused      as backward, with the loss's workspace at the top (measured; else twice the last output)
    backward, layer grain (RoundPipe(recompute="layer"): each layer recomputed and backpropagated on its
               own, from its input saved by the forward)
               max_j (in_j + max(recompute_j, backward_j + out_j + param_grads above j)), plus in_{j-1}
               while layer j runs (the next layer's input is uploaded ahead)

plus the stage's weights, and the next stage's weights where the worker prefetches them.
Layers run one microbatch at a time, so one microbatch's bytes count (and the next
microbatch's input where it is uploaded ahead).  Without a dry run (no sample yet) a
layer's figures come from its activation estimate alone (`LayerMemory.rough`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

LOSS_WORKSPACE = 2   # a loss's workspace, in outputs of the last layer: its difference and its gradient


@dataclass(frozen=True)
class LayerMemory:
    """Device bytes of one layer for one microbatch (the module docstring says what each is)."""

    in_bytes: int = 0
    out_bytes: int = 0
    nograd: int = 0
    saved: int = 0
    recompute: int = 0
    backward: int = 0
    param_grads: int = 0
    loss: int = 0           # the last layer only: its loss's workspace and labels (0: unknown)

    @classmethod
    def rough(cls, act_bytes: int) -> "LayerMemory":
        """From a saved-activation estimate alone: a forward stage holds its largest layer's, a
        backward stage the sum of its layers'."""
        return cls(0, 0, act_bytes, act_bytes, act_bytes, act_bytes, 0)


def layer_memory(costs: Sequence) -> list[LayerMemory]:
    """Each LayerCost's measured LayerMemory, or the rough one from its activation estimate."""
    return [c.memory if c.memory is not None else LayerMemory.rough(c.act_bytes) for c in costs]


class ForwardFootprint:
    """A forward stage's activation bytes at its worst moment, one microbatch, grown a layer at a time
    upwards (`add` the next layer up) (the partitioner packs forward stages from layer 0 up)."""

    def __init__(self, mem: Sequence[LayerMemory], first: int) -> None:
        self.mem, self.first = mem, first
        self.worst = mem[first].nograd

    def add(self, j: int) -> None:
        self.worst = max(self.worst, self.mem[j].nograd + self.mem[j].in_bytes)

    @property
    def bytes(self) -> int:
        return self.mem[self.first].in_bytes + self.worst


class BackwardFootprint:
    """A backward (or fused) stage's activation and workspace bytes at its worst moment, one
    microbatch, fp32 gradient accumulators not included; grown a layer at a time downwards (`add` the next layer down) (the
    partitioner packs backward stages from the fused boundary down)."""

    def __init__(self, mem: Sequence[LayerMemory], top: int, fused: bool = False, layer_grain: bool = False) -> None:
        self.mem = mem
        m = mem[top]
        self.bottom = top
        self.recompute = m.recompute            # max_j (saved below j + recompute_j)
        self.loss = m.saved + (m.loss or LOSS_WORKSPACE * m.out_bytes) if fused else 0
        self.backward = m.backward + m.out_bytes  # max_j (saved below j + backward_j + out_j + grads above j)
        self.grads_above = m.param_grads
        # layer grain (never the fused stage, which does not recompute): one layer's worst at a time
        self.layer_grain = layer_grain and not fused
        self.last = self._one(top, 0)   # the bottom layer's worst, alone
        self.worst = self.last          # the worst so far, with the input uploaded ahead of each layer

    def _one(self, j: int, grads_above: int) -> int:
        m = self.mem[j]
        return m.in_bytes + max(m.recompute, m.backward + m.out_bytes + grads_above)

    def add(self, j: int) -> None:
        m = self.mem[j]
        self.bottom = j
        self.recompute = max(self.recompute + m.saved, m.recompute)
        if self.loss:
            self.loss += m.saved
        self.backward = max(self.backward + m.saved, m.backward + m.out_bytes + self.grads_above)
        self.worst = max(self.worst, self.last + m.in_bytes)   # j's input arrives while j + 1 runs
        self.last = self._one(j, self.grads_above)
        self.worst = max(self.worst, self.last)
        self.grads_above += m.param_grads

    @property
    def bytes(self) -> int:
        if self.layer_grain:
            return self.worst
        return self.mem[self.bottom].in_bytes + max(self.recompute, self.loss, self.backward)


def beside_bytes(costs: Sequence, prefetch: bool) -> float:
    """The most a one-layer neighbouring stage holds beside a stage on its worker: its gradients, an output
    and an input (and where workers prefetch, the next stage's weights and the next microbatch's input)."""
    return max(c.grads + m.out_bytes + m.in_bytes + (c.param_bytes + m.in_bytes if prefetch else 0)
               for c, m in zip(costs, layer_memory(costs)))


def forward_bytes(mem: Sequence[LayerMemory], layers: range) -> int:
    fp = ForwardFootprint(mem, layers.start)
    for j in layers[1:]:
        fp.add(j)
    return fp.bytes


def backward_bytes(mem: Sequence[LayerMemory], layers: range, fused: bool = False, layer_grain: bool = False) -> int:
    fp = BackwardFootprint(mem, layers.stop - 1, fused, layer_grain)
    for j in reversed(layers[:-1]):
        fp.add(j)
    return fp.bytes


def stage_bytes(kind: str, layers: range, weights: Sequence[int], grads: Sequence[int],
                mem: Sequence[LayerMemory], microbatches: int = 2, layer_grain: bool = False) -> int:
    """Weights, gradient accumulators and activations of one stage at its worst moment, one microbatch
    (`layer_grain`: backward stages recompute a layer at a time).

    In low precision the fp32 accumulators are made after a microbatch's backward: a stage run of one
    microbatch holds them only at its end, when its activations are gone (one more microbatch and
    they sit beside its activations)."""
    own = sum(weights[l] for l in layers)
    if kind == "F":
        return own + forward_bytes(mem, layers)
    acts = backward_bytes(mem, layers, kind == "fused", layer_grain)
    accumulators = sum(grads[l] for l in layers)
    low_precision = sum(mem[l].param_grads for l in layers)
    if microbatches == 1 and low_precision:
        return own + max(acts, accumulators + low_precision)
    return own + accumulators + acts


def first_input(task, layer_grain: bool = False) -> int:
    """The layer whose input a stage task uploads first for a microbatch: its first layer's, or at layer
    grain a backward stage's last layer's (it recomputes from the top down)."""
    r = task.layers
    return r.stop - 1 if layer_grain and task.kind == "B" else r.start


def _output_bytes(task, mem: Sequence[LayerMemory]) -> int:
    """One microbatch's output of a stage task: the activation of a forward stage, the input
    gradient of a backward one (none for layer 0)."""
    r = task.layers
    if task.kind == "F":
        return mem[r.stop - 1].out_bytes
    return mem[r.start].in_bytes if r.start > 0 else 0


def kept_graph_bytes(mem: Sequence[LayerMemory], layers: range) -> int:
    """One microbatch's graph of layers run with autograd and kept for their backward (a kept backward
    stage, roundpipe/engine/calls/dispatcher.py `Schedule.kept`): its input leaf and what every layer saves."""
    return mem[layers.start].in_bytes + sum(mem[j].saved for j in layers)


def _stage_need(task, weights: Sequence[int], grads: Sequence[int], mem: Sequence[LayerMemory],
                layer_grain: bool) -> tuple[int, int]:
    """(a stage task's own need at its worst moment, what it adds to or takes from the worker's kept-graph
    bytes afterwards).  A forward stage with kept ranges (`keep`) also holds their graphs of every microbatch
    of the round and, from its run to their backward stage's end, their weights (its worst: all the graphs
    and what one layer's forward with grad makes beyond what it keeps); a kept backward stage (`kept`)
    needs only its fp32 accumulators and one layer's backward workspace beyond the layer's kept part, and
    frees the graphs and weights."""
    r, mbs = task.layers, len(task.mbs)
    if getattr(task, "kept", False):
        own = (sum(grads[l] for l in r) + sum(mem[l].param_grads for l in r)
               + max(mem[j].backward - mem[j].saved + mem[j].out_bytes for j in r))
        return own, -(mbs * kept_graph_bytes(mem, r) + sum(weights[l] for l in r))
    need = stage_bytes(task.kind, r, weights, grads, mem, mbs, layer_grain)
    keep = getattr(task, "keep", ())
    if not keep:
        return need, 0
    graphs = mbs * sum(kept_graph_bytes(mem, k) for k in keep)
    making = max(mem[j].recompute - mem[j].saved for k in keep for j in k)
    return need + graphs + max(making, 0), graphs + sum(weights[l] for k in keep for l in k)


def worker_peaks(tasks_by_worker: dict[str, list], weights: Sequence[int], grads: Sequence[int],
                 mem: Sequence[LayerMemory], prefetches: bool, layer_grain: bool = False,
                 resident: int = 0, held: Sequence[int] | None = None) -> dict[str, int]:
    """Predicted peak device bytes of each worker over its stage tasks (one call): the worst stage,
    with the previous microbatch's output, and the gradients and last output of the worker's
    previous stage beside it (they leave during this one, roundpipe/workers/transfers.py `pace`),
    and where the worker prefetches, the next stage's
    weights and the next microbatch's input.  `resident`: the first layers whose weights every worker
    keeps between stages (roundpipe/engine/calls/resident.py): beside each stage, the weights of those it
    neither runs nor prefetches.  All of them on every worker: the dispatch rotates from call to call
    (roundpipe/engine/calls/dispatcher.py), so in time each worker has run, and keeps, every such layer
    (the steady state; earlier calls hold less).  `held`: per layer, device bytes a resident layer holds
    beside its weights all the time (the device step's masters, optimizer state and gradient sums:
    roundpipe/engine/step/device_step.py), and after the call that step's update, one layer at a time:
    beside what the resident layers keep, a copy of what the update writes (the layer's masters and state)
    and the formula's temporaries, counted as 1.5x the layer's `held` (Adam: a 12-byte copy per parameter of
    the layer, temporaries of up to 12 bytes per element of its largest parameter with clipping, against the
    16-20 bytes held per parameter; every stage's working set is gone by then).  Kept graphs (a forward stage's
    `keep`, a backward stage's `kept`: `_stage_need`) sit beside every stage from their forward stage to
    their backward stage."""
    peaks = {}
    for name, tasks in tasks_by_worker.items():
        worst = holding = 0
        kept = range(resident)
        always = sum(held[l] for l in kept) if held is not None else 0
        for i, task in enumerate(tasks):
            need, change = _stage_need(task, weights, grads, mem, layer_grain)
            on_kept = getattr(task, "kept", False)   # it uploads neither its weights nor its input
            if kept:
                counted = set(task.layers)
                if prefetches and i + 1 < len(tasks):
                    counted.update(tasks[i + 1].layers)
                need += sum(weights[l] for l in kept if l not in counted)
            if i > 0:   # the previous stage's gradients and last output, until their downloads complete
                need += _output_bytes(tasks[i - 1], mem)
                if tasks[i - 1].kind != "F":
                    need += sum(grads[l] for l in tasks[i - 1].layers)
            if prefetches:
                need += 0 if on_kept else mem[first_input(task, layer_grain)].in_bytes
                if i + 1 < len(tasks) and not getattr(tasks[i + 1], "kept", False):
                    need += sum(weights[l] for l in tasks[i + 1].layers)
            worst = max(worst, need + always + holding)
            holding += change
        if always:   # the device step's update of its largest layer (above)
            worst = max(worst, sum(weights[l] for l in kept) + always + max(held[l] for l in kept) * 3 // 2)
        peaks[name] = worst
    return peaks


def resident_prefix(tasks_by_worker: dict[str, list], weights: Sequence[int], grads: Sequence[int],
                    mem: Sequence[LayerMemory], prefetches: bool, caps: dict[str, int | None],
                    layer_grain: bool = False, headroom: float = 0.15, held: Sequence[int] | None = None) -> int:
    """The most first layers whose weights every worker can keep between stages with its predicted peak
    (`worker_peaks(resident=)`) at most (1 - headroom) of its cap: a margin for what the model misses
    (measured peaks on CPU workers reach 1.1x the prediction, tests/engine/test_memory.py; with 5% a
    24-layer bf16 decoder ran out of its cap).  Kept weights only fill room the plan leaves: they must
    never make a call fail that would have trained without them.  0 when a worker has no cap."""
    limits = {name: caps.get(name) for name in tasks_by_worker}
    if not limits or any(c is None for c in limits.values()):
        return 0

    def fits(k: int) -> bool:
        peaks = worker_peaks(tasks_by_worker, weights, grads, mem, prefetches, layer_grain, resident=k, held=held)
        return all(peaks[n] <= (1 - headroom) * limits[n] for n in limits)
    lo, hi = 0, len(weights)   # the peak grows with k: the largest k that fits, by bisection
    if not fits(0):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
