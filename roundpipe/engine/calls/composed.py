"""Calls that compose with autograd: `out = model(x)` as one node of the caller's graph.

    out = model(x)              # grad enabled and the model training (or x requiring grad)
    loss = f(out, other)        # any PyTorch code, another RoundPipe included: b(a(x))
    loss.backward()             # every p.grad as an nn.Sequential's; x.grad too when x requires grad

The node is a torch.autograd.Function (`Node`) over the call's output leaves:

    forward    a forward-only call of the pipeline (RoundPipe._run, training=False), drawing the
               call's RNG base once; the per-microbatch outputs are merged as model(x) merges them
               and each floating tensor leaf of the merged output is an output of the node
    backward   a training call of the same microbatches from the same RNG base (so every dropout
               mask repeats), whose fused stage seeds its backward with the microbatch's slice of
               each incoming gradient instead of a loss (CallContext.seeded): no loss weighting is
               involved, so the gradient landed is exactly d(loss)/d(param); its forwards write no
               buffers (the forward call did, once).  Inputs that require grad get theirs from the
               first stage, which sends them home; split inputs' gradients are concatenated over the
               microbatches, inputs passed whole to every microbatch get the sum.

Why not keep the forward call's stage inputs and run only the backward stages: a forward-only
call's schedule has no backward consumers (roundpipe/engine/calls/dispatcher.py), so its stage inputs
are dropped as soon as the next forward stage took them; keeping them would mean a third kind of
schedule.  The price of the simple way is one extra forward: a composed step costs a forward_backward
plus a forward of the whole model, by FLOP count (forward 1, backward 2, recompute 1) a third more
than forward_backward without recompute, a quarter more with it.  Host memory: the node keeps the
call's microbatch views of the inputs (no copies) and its merged outputs until the graph is freed.

A step between the forward and the backward would make the recompute see other weights: the
backward then raises RuntimeError, as PyTorch does for a tensor saved for backward and modified
in place.

`p.grad` is final when `backward()` returns (PyTorch's contract, what a torch optimizer stepped right
after it relies on: Lightning's and Accelerate's loops).  The node's backward returns as soon as its
training call has seeded every microbatch (with input gradients: once the call ended, since they come
from its last stage), so the rest of the caller's graph runs while the call's last backward stages and
gradient landings finish; each node queues its model's `finish` with autograd's engine, which runs it
at the end of the whole backward pass, before `backward()` (or `torch.autograd.grad`) returns:

    autograd thread   [other nodes] [Node.backward: call seeded] [earlier nodes ...] [finish] -> returns
    workers                                 [tail: last backward stages, landings]
    G-copy thread                                                  [p.grad <- landed sums]

`finish` waits for the calls to end, moves their gradients into p.grad and shows held low-precision
ones in fp32 (RoundPipe._backward_done).  Queueing it goes through `Variable._execution_engine.
queue_callback`, as DDP's and FSDP's end-of-backward waits do: torch has no public API for it.

Measured (2 CPU workers on a shared 2-core VM, loaded by other work, torch 2.13; 8 layers of
Linear(512, 512) + GELU, batch 32, 3 microbatches, torch AdamW; the two variants alternate step by
step in one process, median over 7 runs of 40-60 steps each): `backward(); opt.step()` with this wait
takes 0.98x the time of the old path with `synchronize()` before `opt.step()` (the old exact loop;
0.92-1.14x per run), the wait itself 22-99 ms a step against synchronize()'s 24-103 ms in the same
runs (a quarter of a 77 ms step at the quietest: the tail the old loop let run into `opt.step()`).
Waiting at the end of the pass rather than in each node's backward keeps the overlap of two calls in
one loss, `mse(model(x1)) + mse(model(x2))`: 0.81x the time of waiting in the node (0.68-0.96x).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd import Variable
from torch.autograd.function import once_differentiable

from roundpipe.core.tree import tree_leaves, tree_unflatten
from roundpipe.engine.calls.microbatch import Microbatches, merge

# (microbatches) -> per-microbatch output nests (host tensors)
ForwardFn = Callable[[Microbatches], list]
# (microbatches whose labels are per-microbatch seed lists, input leaf positions) -> per microbatch, the
# gradients of those input leaves (None where an input got none)
BackwardFn = Callable[[Microbatches, tuple[int, ...]], list[list]]
# () -> None: run once the whole backward pass is done; returns when every p.grad it produced is final
FinishFn = Callable[[], None]


def requires_grad(args: tuple, kwargs: dict) -> list[int]:
    """Positions (tree_leaves of (args, kwargs)) of the call's tensor inputs that require grad."""
    return [i for i, t in enumerate(tree_leaves((args, kwargs))) if isinstance(t, torch.Tensor) and t.requires_grad]


class ComposedCall:
    """One composed call: its microbatches (of the detached inputs), its outputs, and its two halves."""

    def __init__(self, mb: Microbatches, inputs: tuple, wanted: list[int], forward: ForwardFn, backward: BackwardFn,
                 finish: FinishFn):
        self.mb = mb
        self.inputs = tree_leaves(inputs)   # the whole call's (detached) input leaves
        self.wanted = tuple(wanted)
        self._forward, self._backward, self.finish = forward, backward, finish
        self.merged: Any = None            # the merged output, until compose() connected it
        self.floating: list[int] = []      # positions of the merged output's floating tensor leaves
        self.connected: list[torch.Tensor] = []   # those leaves (the node returns detached aliases)
        self.num_leaves = 0                # leaves of one microbatch's output
        self.cuts: dict[int, list[int] | None] = {}   # floating leaf -> its microbatches' dim-0 sizes (None: stacked)

    def run_forward(self) -> None:
        """The forward call: the merged output and what the backward needs to cut its gradient again."""
        outputs = self._forward(self.mb)
        self.merged = merge(outputs)
        leaves = tree_leaves(self.merged)
        self.floating = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        self.connected = [leaves[i] for i in self.floating]
        per_mb = [tree_leaves(o) for o in outputs]
        self.num_leaves = len(per_mb[0])
        self.cuts = {i: [p[i].shape[0] for p in per_mb] if per_mb[0][i].dim() >= 1 else None for i in self.floating}

    def rebuild(self, connected: tuple[torch.Tensor, ...]) -> Any:
        """The merged output with its floating leaves replaced by the node's outputs."""
        merged, self.merged, self.connected = self.merged, None, []   # the node's outputs hold them from here
        leaves = tree_leaves(merged)
        for i, t in zip(self.floating, connected):
            leaves[i] = t
        return tree_unflatten(merged, leaves)

    def seeds(self, grads: tuple[torch.Tensor | None, ...]) -> list[list]:
        """Per microbatch, the incoming gradient of each of its output leaves (None: none flows there)."""
        n = len(self.mb)
        seeds: list[list] = [[None] * self.num_leaves for _ in range(n)]
        for i, g in zip(self.floating, grads):
            if g is None:
                continue
            cut = self.cuts[i]
            if n == 1:
                pieces = [g]
            elif cut is not None:   # merged by torch.cat along dim 0
                pieces = g.split(cut)
            else:                   # 0-dim leaves were stacked
                pieces = list(g.unbind(0))
            for m, p in enumerate(pieces):
                seeds[m][i] = p.contiguous()
        return seeds

    def run_backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """The backward call; returns the gradient of every input that requires grad (in `wanted` order)."""
        mb = Microbatches(self.mb.args, self.mb.kwargs, self.seeds(grads), self.mb.sizes, reduction="sum")
        per_mb = self._backward(mb, self.wanted)
        return [self._input_grad(i, [g[k] for g in per_mb]) for k, i in enumerate(self.wanted)]

    def _input_grad(self, i: int, parts: list) -> torch.Tensor | None:
        """Input leaf i's gradient from its microbatches' (cut along dim 0 as split() cut it, else whole)."""
        if all(p is None for p in parts):
            return None
        whole, batch = self.inputs[i], sum(self.mb.sizes)
        pieces = [tree_leaves((a, kw))[i] for a, kw in zip(self.mb.args, self.mb.kwargs)]
        parts = [torch.zeros_like(piece) if p is None else p for p, piece in zip(parts, pieces)]
        if whole.dim() >= 1 and whole.shape[0] == batch:
            g = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:
            g = parts[0]
            for p in parts[1:]:
                g = g + p
        return g.to(device=whole.device, dtype=whole.dtype)


class Node(torch.autograd.Function):
    """The pipeline call as one autograd node: inputs (anchor, *the call's inputs that require grad),
    outputs the merged output's floating leaves."""

    @staticmethod
    def forward(ctx, call: ComposedCall, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)   # an output the loss does not use seeds nothing (None), not zeros
        # detached aliases, not the tensors themselves: autograd sets the history of what forward returns,
        # and call.merged holding those would be a cycle through the node (call -> tensor -> node -> call)
        return tuple(t.detach() for t in call.connected)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        input_grads = ctx.call.run_backward(grads)
        # p.grad final before backward() returns: at the end of the pass, not here (module docstring)
        Variable._execution_engine.queue_callback(ctx.call.finish)
        return (None, None, *input_grads)


def compose(call: ComposedCall, inputs: list[torch.Tensor]) -> Any:
    """Runs the call's forward and returns its output connected to the caller's graph through a Node.

    `inputs`: the call's input tensors that require grad, in position order.  The anchor, a leaf that
    requires grad, makes the node part of the graph when no input requires grad (parameters only)."""
    call.run_forward()
    if not call.connected:   # no floating output (token ids, masks): nothing to differentiate
        return call.merged
    anchor = torch.empty(0, requires_grad=True)
    return call.rebuild(Node.apply(call, anchor, *inputs))
