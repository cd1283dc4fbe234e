"""The dry run's memory measurement of one layer: a `LayerMemory` (roundpipe/planner/memory.py).

The layer runs three times on one microbatch, on the CPU for CPU workers and on the meta
device for GPU workers (shapes only): a forward without grad (what a forward stage does),
a forward with grad (a backward stage's recompute) and its backward, with a gradient of
ones flowing in.  A `Timeline` (a dispatch mode) counts the bytes of every storage an op
makes, from that op until the storage dies: so it sees what a worker's caching allocator
would hold live, including autograd's saved tensors and the temporaries of backward, as the
worker's own ledger (roundpipe/workers/ledger.py, `WorkspaceTracker`) will record it.

Attention.  Workers run `F.scaled_dot_product_attention` as a fused kernel (flash or
memory-efficient on GPUs, the flash kernel for CPU on CPU workers) that never holds the
[batch, heads, T, T] scores; the meta device has only the math backend, which does.  So
under the probe attention runs as math unseen, and counts what a fused kernel makes: its
output and an fp32 log-sum-exp per query row forward, dq, dk and dv backward.

Backward with explicit gradients goes through roundpipe/engine/calls/compute.py's
`autograd_backward` / `autograd_grad`, as the stages' does: torch.autograd's own check of those
gradients imports sympy (0.6 s) the first time, and this probe runs in the first training call.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from roundpipe.core.tree import tree_leaves, tree_map
from roundpipe.engine.calls.compute import autograd_backward, autograd_grad, writable
from roundpipe.planner.memory import LayerMemory

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class Timeline(TorchDispatchMode):
    """Live and peak bytes of the storages made under it on `device_type` (one thread).

    A storage counts from the op that made it until it dies (a weak reference's callback):
    views, saved tensors and in-place ops count it once, for as long as they keep it."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:   # as dry_run.FlopCount: no torch._dynamo import
        return False

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = self.peak = 0
        self.paused = False          # the fused-attention model's math runs unseen
        self._refs: dict[int, weakref.ref] = {}

    def _died(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def callback(_: Any) -> None:
            self._refs.pop(key, None)
            self.live -= nbytes
        return callback

    def track(self, t: torch.Tensor, extra: int = 0) -> None:
        """Counts t's storage (and `extra` bytes that live as long as it) from now until it dies."""
        if t.device.type != self.device_type or t.is_sparse:
            return
        s = t.untyped_storage()
        if id(s) in self._refs:
            return
        n = s.nbytes() + extra
        self._refs[id(s)] = weakref.ref(s, self._died(id(s), n))
        self.live += n
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        returns = func._schema.returns
        for i, r in enumerate(returns):
            if r.alias_info is None:
                v = out if len(returns) == 1 else out[i]
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(t, torch.Tensor):
                        self.track(t)
        return out

    def reset_peak(self) -> int:
        self.peak = self.live
        return self.live


class _FusedAttention(torch.autograd.Function):
    """Math attention whose counted bytes are a fused kernel's (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, timeline: Timeline, options: dict, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        timeline.paused = True
        try:
            out = F.scaled_dot_product_attention(q, k, v, **options)
        finally:
            timeline.paused = False
        timeline.track(out, extra=q.numel() // q.shape[-1] * 4)   # the log-sum-exp, fp32 per query row
        ctx.timeline, ctx.options = timeline, options
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v = ctx.saved_tensors
        timeline = ctx.timeline
        timeline.paused = True
        try:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*leaves, **ctx.options)
                grads = autograd_grad([out], leaves, [grad])
        finally:
            timeline.paused = False
        for g in grads:
            timeline.track(g)
        return (None, None, *grads)


class _AttentionAsFused(TorchFunctionMode):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.timeline.paused:
            return func(*args, **kwargs)
        bound = dict(zip(_SDPA_ARGS, args), **kwargs)
        q, k, v = (bound.pop(n) for n in _SDPA_ARGS[:3])
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _FusedAttention.apply(self.timeline, bound, q, k, v)
        self.timeline.paused = True
        try:
            out = func(q, k, v, **bound)
        finally:
            self.timeline.paused = False
        self.timeline.track(out)
        return out


def _float_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def measure_layer(layer: nn.Module, call: Callable[[Any], Any], x: Any, device_type: str,
                  first: bool) -> LayerMemory:
    """The LayerMemory of `layer` (a private copy: its .grad is written) on input x; `call(x)` runs it.
    `first`: x is the model's input (data: no gradient wanted for it)."""
    params = {id(p) for p in layer.parameters()}

    def nbytes(v: Any) -> int:   # a layer may hand on one of its parameters (the HF head its weight)
        return sum(t.numel() * t.element_size() for t in _float_leaves(v) if id(t) not in params)
    timeline = Timeline(device_type)
    attention = _AttentionAsFused(timeline)
    with timeline, attention, torch.no_grad():
        out = call(x)
    nograd = timeline.peak
    del out
    base = timeline.reset_peak()
    if not first:
        for t in _float_leaves(x):
            t.requires_grad_(True)
    with timeline, attention, torch.enable_grad():
        out = call(x)
    saved, recompute = timeline.live - base, timeline.peak - base
    out_bytes = nbytes(out)   # as a backward stage sees it (the HF head gives logits only without grad)
    roots = [t for t in _float_leaves(out) if t.requires_grad]
    if roots:
        grads = [torch.ones_like(t) for t in roots]   # the gradient flowing in: the layer above's bytes
        with timeline, attention:
            autograd_backward(roots, grads)
    backward = timeline.peak - base
    param_grads = sum(p.grad.numel() * p.grad.element_size() for p in layer.parameters() if p.grad is not None)
    return LayerMemory(nbytes(x), out_bytes, nograd, saved, recompute, backward, param_grads)


def measure_loss(loss_fn: Callable, out: Any, labels: Any, device_type: str) -> int:
    """Peak bytes of `loss_fn(out, labels)` and its backward down to `out`, the labels included
    (they are uploaded for the fused stage)."""
    timeline = Timeline(device_type)
    out = tree_map(lambda t: t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   else t, out)
    with timeline, _AttentionAsFused(timeline), torch.enable_grad():
        loss = loss_fn(writable(out), labels)   # as in the fused stage, loss_fn may write `out` in place
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return timeline.peak + sum(t.numel() * t.element_size() for t in tree_leaves(labels) if isinstance(t, torch.Tensor))
