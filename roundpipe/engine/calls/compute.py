"""The layer compute of a stage run: layers in order with RNG reseeding, backward, error tags.

Every exception raised by a layer, by loss_fn or in a backward is tagged with where it
happened (`layer 3`, `loss_fn`, `backward of layers 4-5`) and re-raised unchanged in type.

In-place first ops (issue 51).  A stage's input, and at layer grain each layer's, is a fresh autograd
leaf that requires grad (stage.py `_input_with_grad`), so `nn.ReLU(inplace=True)` or `x.add_(b)` as
the first op of the fused tail, of a recomputed backward stage or of a kept forward segment raised
"a leaf Variable that requires grad is being used in an in-place operation", where plain PyTorch,
whose layer inputs are the outputs of the layers before, trains.  Such a layer gets its input through
`writable`: each such leaf replaced by an alias (`_Alias`: the same storage but neither the leaf nor a
view of it, so autograd lets the op write it; its gradient lands on the leaf).  The op then writes the
stage input in place as it writes a forward stage's (every input a worker `use`s is private to it:
workers/base.py).  Which layers need it is learned (`_run_layer`): a layer runs on its input as it is;
when that raises this error, the input is unchanged (torch checks before the kernel writes), so unless
the failed try changed one of the layer's buffers it runs again on `writable(x)` from the same seed,
and its replicas on every worker remember it (`Replica.writes_input`): later microbatches and calls
alias up front and never raise.  Why not the alternatives:

    clone every stage input      one more activation live beside the leaf, for every stage input
    clone on that error          the same for the layers that write their input
    alias every stage input      no retry, but the Function costs every stage-microbatch with autograd
                                 (and every layer at layer grain) ~10 us, whether its first layer writes
                                 in place or not: 24 -> 34 us for an 8-wide linear's forward and backward
                                 (best of 40), +20-30 us per stage-microbatch in a loaded engine trace
                                 whose trivial stage-microbatches compute for 150-170 us (2-core VM,
                                 torch 2.13)
    alias once learned (this)    nothing for a layer that never writes its input; one failed try per
                                 such layer and model (two workers may race to one each), then ~10 us

The retry keys on torch's message (it covers "a view of a leaf Variable ..." too): should torch reword
it, the error reaches the caller as before.  A layer whose failed try changed a buffer (a running
statistic updated before the in-place op) is not run again, which would change the buffer twice: the
error says so.  Other effects before the in-place op (a forward hook, a Python counter) happen twice
in that one failed run; the layers this is for write their input first.  The planner's dry run
(dry_run.py, memory_probe.py) runs its layers on `writable` inputs always (its speed does not matter),
so it measures such models rather than failing over to parameter counts; the alias allocates nothing,
so the measured bytes are the layer's own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from roundpipe.core.errors import Aborted
from roundpipe.core.tree import tree_leaves, tree_unflatten
from roundpipe.engine.calls.precision import dtype_mismatch_note, published_keyword_note
from roundpipe.engine.calls.recompute_data import LayerRuns
from roundpipe.workers.base import Worker
from roundpipe.workers.rng import layer_seed

if TYPE_CHECKING:
    from roundpipe.engine.calls.context import CallContext
    from roundpipe.engine.calls.replica import Replica


def tag(exc: BaseException, where: str) -> BaseException:
    """Names the place of an exception in its message, once, keeping its type."""
    if getattr(exc, "_roundpipe_where", None) is None:
        exc._roundpipe_where = where
        note = f"[roundpipe] raised in {where}"
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]} ({note})",) + exc.args[1:]
        else:
            exc.add_note(note)
    return exc


# torch.autograd.backward's own checks of explicit gradients (`_make_grads`: shapes through the
# symbolic-shape layer, dtypes) cost ~20 us a call, as much as the rest of a trivial
# stage-microbatch, and the first one imports torch.fx.experimental.symbolic_shapes and sympy:
# 0.6 s of the first training call (2-core VM, torch 2.13; a plain loop's scalar loss.backward()
# never passes an explicit gradient, so never pays it).  The engine's gradients match their roots
# by construction (the grad of the next stage's input, converted to compute dtype), so after a
# plain shape, dtype and device comparison backward stages (and the planner's memory probe) call
# the autograd engine the way torch.autograd.backward / grad do after those checks.  Anything else
# (a mismatch: torch's error message; no such entry point) goes through the public function.
_engine_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


def _matching(roots: list[torch.Tensor] | tuple, grads: list[torch.Tensor] | tuple | None) -> bool:
    return grads is not None and _engine_backward is not None and len(roots) == len(grads) and all(
        isinstance(g, torch.Tensor) and r.shape == g.shape and r.dtype == g.dtype and r.device == g.device
        for r, g in zip(roots, grads))


def autograd_backward(roots: list[torch.Tensor], grads: list[torch.Tensor] | None) -> None:
    """torch.autograd.backward(roots, grads); grads matching roots in shape and dtype skip its checks."""
    if not _matching(roots, grads):
        torch.autograd.backward(roots, grads)
    else:
        _engine_backward(tuple(roots), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def autograd_grad(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                  grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """torch.autograd.grad(outputs, inputs, grads), skipping its checks as autograd_backward does."""
    if not _matching(outputs, grads):
        return torch.autograd.grad(outputs, inputs, grads)
    return _engine_backward(tuple(outputs), tuple(grads), False, False, tuple(inputs), allow_unreachable=False,
                            accumulate_grad=False)


def float_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Alias(torch.autograd.Function):
    """Each input as a new tensor on its storage (`detach`: not a view of it, so autograd lets a layer
    write it in place) whose gradient flows to the input unchanged; saves nothing."""

    @staticmethod
    def forward(ctx: Any, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)   # an alias the layer never used passes None, not zeros
        return tuple(t.detach() for t in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def writable(x: Any) -> Any:
    """x with every tensor that is an autograd leaf requiring grad replaced by its `_Alias` (the module
    docstring: a layer may write it in place, its gradient still lands on the leaf); x itself when grad
    mode is off or x holds no such leaf."""
    if not torch.is_grad_enabled():
        return x
    leaves = tree_leaves(x)
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    if not at:
        return x
    for i, alias in zip(at, _Alias.apply(*(leaves[i] for i in at))):
        leaves[i] = alias
    return tree_unflatten(x, leaves)


# torch's message when an op writes a leaf that requires grad, or a view of one, in place
_LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _call(module: torch.nn.Module, l: int, x: Any) -> Any:
    return module(*x[0], **x[1]) if l == 0 else module(x)


def _run_layer(ctx: CallContext, w: Worker, rep: Replica, l: int, x: Any, seed: int) -> Any:
    """Layer l on x, its input `writable` where the layer writes it in place: known from an earlier run, or
    learned now from the error of a first try, then retried from the same seed (the module docstring).

    A recompute's scope (recompute_data.py) hands both tries the same saved data; a saving scope (a
    forward stage's first run) is under no_grad, where the error never happens."""
    if rep.writes_input:
        return _call(rep.module, l, writable(x))
    if not torch.is_grad_enabled():
        return _call(rep.module, l, x)
    versions = [b._version for b in rep.bound_buffers()]
    try:
        return _call(rep.module, l, x)
    except RuntimeError as e:
        if _LEAF_IN_PLACE not in str(e) or not any(isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
                                                   for t in tree_leaves(x)):
            raise
        if versions != [b._version for b in rep.bound_buffers()]:
            e.add_note(f"[roundpipe] layer {l} writes its input in place after it changed a buffer, so it cannot "
                       "be run again on a writable input (the buffer would change twice); write the input in "
                       "place before changing buffers, or out of place")
            raise
    for reps in ctx.replicas.values():   # every worker's replica: later runs alias up front
        reps[l].writes_input = True
    w.rng.reseed(seed)   # the same random draws as the failed try's
    return _call(rep.module, l, writable(x))


def run_layers(ctx: CallContext, w: Worker, layers: range, x: Any, m: int,
               publish: Callable[[int, Any], None] | None = None,
               report: Callable[[float, float], None] | None = None, recompute: bool = False,
               saving: bool = True) -> Any:
    """Runs layers on x, each from its own seed (recompute.py); publish(b, x) at saved boundaries inside.

    Random draws go to the worker's own generator, so workers run layers side by side; long
    compute runs outside the worker's turn (Worker.compute_span).  recompute: a backward stage's
    recompute, whose layers get what their first run saved (recompute_data.py); a forward stage
    (one that publishes) of a training call is that first run, unless `saving` is False (layers whose graph
    is kept for their backward: never recomputed).  A layer that writes its input in place gets it
    `writable` (the module docstring)."""
    reps = ctx.replicas[w.name]
    runs = LayerRuns(ctx, w, layers, m, recompute, first=publish is not None and saving)   # may wait: before the span
    with w.compute_span(ctx.compute_s, ("f", layers.start, layers.stop), report) as span, w.rng.stream(), \
            ctx.precision.autocast_on(w.device.type):
        for l in layers:
            if ctx.abort_requested():
                raise Aborted()
            seed = layer_seed(ctx.rng_base, l, m)
            w.rng.reseed(seed)
            try:
                with runs.layer(l):
                    x = _run_layer(ctx, w, reps[l], l, x, seed)
            except Exception as e:  # noqa: BLE001 - any layer error is tagged with where it happened
                dtype_mismatch_note(e)
                if l == 0:
                    published_keyword_note(e)
                raise tag(e, f"layer {l}")  # noqa: B904 - re-raises e itself, tagged
            if runs.saving:
                with span.untracked():   # its host staging is not the layer's workspace
                    runs.keep(l)
            if publish is not None and (l + 1 in ctx.points or l + 1 == layers.stop):
                with span.untracked():   # host staging of the handoff is not the layers' workspace
                    publish(l + 1, x)
    return x


def loss_parts(value: Any) -> tuple[Any, tuple, list]:
    """What a loss_fn returned, as (the loss to optimize, its form, the other entries).

    A tensor is the loss (form ()); a tuple or list optimizes its first entry and returns the
    rest (form ("tuple", n)); a dict optimizes its "loss" entry, else its first one, and returns the
    others in order (form ("dict", their keys)).  The other entries must be tensors; the loss itself
    is checked by the caller (a floating scalar)."""
    if isinstance(value, (tuple, list)) and value:
        loss, extras, form = value[0], list(value[1:]), ("tuple", len(value) - 1)
    elif isinstance(value, dict) and value:
        key = "loss" if "loss" in value else next(iter(value))
        rest = [k for k in value if k != key]
        loss, extras, form = value[key], [value[k] for k in rest], ("dict", tuple(rest))
    else:
        return value, (), []
    for i, e in enumerate(extras):
        if not isinstance(e, torch.Tensor):
            name = form[1][i] if form[0] == "dict" else i + 1
            raise TypeError(f"loss_fn returned a {type(value).__name__} whose entry {name!r} is a "
                            f"{type(e).__name__}; every entry beside the loss must be a tensor")
    return loss, form, extras
