"""The layer compute of a stage run: layers in order with RNG reseeding, backward, error tags.

Every exception raised by a layer, by loss_fn or in a backward is tagged with where it
happened (`layer 3`, `loss_fn`, `backward of layers 4-5`) and re-raised unchanged in type.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from roundpipe.core.errors import Aborted
from roundpipe.core.tree import tree_leaves
from roundpipe.engine.calls.precision import dtype_mismatch_note
from roundpipe.engine.calls.recompute_data import LayerRuns
from roundpipe.workers.base import Worker
from roundpipe.workers.rng import layer_seed

if TYPE_CHECKING:
    from roundpipe.engine.calls.context import CallContext


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


def run_layers(ctx: CallContext, w: Worker, layers: range, x: Any, m: int,
               publish: Callable[[int, Any], None] | None = None,
               report: Callable[[float, float], None] | None = None, recompute: bool = False,
               saving: bool = True) -> Any:
    """Runs layers on x, each from its own seed (recompute.py); publish(b, x) at saved boundaries inside.

    Random draws go to the worker's own generator, so workers run layers side by side; long
    compute runs outside the worker's turn (Worker.compute_span).  recompute: a backward stage's
    recompute, whose layers get what their first run saved (recompute_data.py); a forward stage
    (one that publishes) of a training call is that first run, unless `saving` is False (layers whose graph
    is kept for their backward: never recomputed)."""
    reps = ctx.replicas[w.name]
    runs = LayerRuns(ctx, w, layers, m, recompute, first=publish is not None and saving)   # may wait: before the span
    with w.compute_span(ctx.compute_s, ("f", layers.start, layers.stop), report) as span, w.rng.stream(), \
            ctx.precision.autocast_on(w.device.type):
        for l in layers:
            if ctx.abort_requested():
                raise Aborted()
            w.rng.reseed(layer_seed(ctx.rng_base, l, m))
            try:
                with runs.layer(l):
                    x = reps[l].module(*x[0], **x[1]) if l == 0 else reps[l].module(x)
            except Exception as e:  # noqa: BLE001 - any layer error is tagged with where it happened
                dtype_mismatch_note(e)
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
