"""Data a layer keeps from its forward for its recompute: rp.save_for_recompute, rp.get_recompute_data,
rp.doing_recompute.

A backward stage recomputes its layers' forward from the saved stage input.  What a layer builds from
its inputs alone (attention masks, rotary tables, per-expert token counts) it would build twice, and where
building it reads a device value on the host (`.item()`, `.tolist()`, `nonzero`: a device sync on CUDA)
the recompute pays that sync again.  A layer can instead hand such values to its own recompute:

    def forward(self, x):
        if rp.doing_recompute():
            (mask,) = rp.get_recompute_data()      # what the first run saved, on this worker's device
        else:
            mask = build_mask(x)                   # may sync with the host
            rp.save_for_recompute(mask)            # no-op where no recompute follows
        ...

Where each function applies (the published roundpipe's names and behaviour, so code written for it runs
unchanged; its asserts are RuntimeErrors here):

    save_for_recompute(*data)   in a layer's first run in a forward stage of a training call (microbatch m):
                                keeps `data` (a nest of tuples, lists and dicts of tensors and other values)
                                for that layer's recompute of m; once per layer run (a second call is a
                                RuntimeError).  Everywhere else a no-op: outside a call, in forward-only
                                calls, in the fused tail stage and kept graphs (never recomputed) and in
                                the recompute.
    get_recompute_data()        while a layer is recomputed: the tuple it saved, its tensors on this
                                worker's device (private copies, detached), or None if it saved nothing.
                                Outside a recompute a RuntimeError (check doing_recompute() first).
    doing_recompute()           True exactly while a backward stage recomputes a layer.

How the data travels: keyed by (call, layer, microbatch), on the call's board (board.py) under
("recompute", layer, microbatch).  After each layer of a training call's forward stage the engine puts
what it saved there (None when nothing), its tensors sent towards host memory as a stage output is
(`Worker.send(need_host=True, keep_device=False)`), and the backward stage recomputing that layer takes
the entry before its compute starts (`Worker.receive` + `use`: uploaded to its worker, which may be
another one).  Each entry has one consumer, so the board drops it once the recompute took it; a failed
or interrupted call's abort drops what is left.  A backward stage may recompute microbatch m before
the forward stage of its upper layers ran m (it needs only its own input), so taking an entry waits for
it, giving the worker's turn back meanwhile as every board wait does.

Cost: one board entry per layer and microbatch of the forward stages of a training call (a lock and a
dict entry; none in forward-only calls or the fused stage) and, for what a layer saves, its bytes
twice over the host link (down after the forward, up before the recompute) plus host memory until the
recompute.  So keep what is small or costly to rebuild; a large tensor that is cheap to rebuild without
a sync is better rebuilt (roundpipe/hf/layers.py `Embed` keeps its masks by that rule).
Non-tensor values are handed over as they are: they must not hold device tensors of their own.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from roundpipe.engine.calls.context import CallContext
    from roundpipe.workers.base import Worker

_local = threading.local()   # the layer run of this thread (each worker computes on its own thread)


class _Scope:
    """One layer run: the first (saving) or the recompute (with the data the first run saved)."""

    __slots__ = ("layer", "recompute", "data", "saved")

    def __init__(self, layer: int, recompute: bool, data: tuple | None):
        self.layer, self.recompute, self.data = layer, recompute, data
        self.saved: tuple | None = None


def save_for_recompute(*data: Any) -> None:
    """Keeps `data` for this layer's recompute of this microbatch (a no-op where none follows)."""
    scope = getattr(_local, "scope", None)
    if scope is None or scope.recompute:
        return
    if scope.saved is not None:
        raise RuntimeError(f"save_for_recompute was called twice in one run of layer {scope.layer}; call it at most "
                           "once per layer and microbatch, with every value the recompute needs")
    scope.saved = data


def get_recompute_data() -> tuple | None:
    """While a layer is recomputed: what its first run saved (a tuple), or None if it saved nothing."""
    scope = getattr(_local, "scope", None)
    if scope is None or not scope.recompute:
        raise RuntimeError("get_recompute_data() is only defined while a backward stage recomputes a layer; "
                           "check rp.doing_recompute() first")
    return scope.data


def doing_recompute() -> bool:
    """Whether a backward stage is recomputing a layer on this thread right now."""
    scope = getattr(_local, "scope", None)
    return scope is not None and scope.recompute


def _key(layer: int, m: int) -> tuple:
    return ("recompute", layer, m)


class LayerRuns:
    """The recompute data of one stage-microbatch's layer runs (compute.run_layers drives it).

    recompute: the backward stage's recompute; first: a forward stage (the layers' first run, which a
    training call's backward stages recompute: every layer before the fused tail)."""

    def __init__(self, ctx: CallContext, w: Worker, layers: range, m: int, recompute: bool, first: bool):
        self.ctx, self.w, self.m, self.recompute = ctx, w, m, recompute
        self.saving = first and not recompute and ctx.call is not None and ctx.call.training
        self.kept: dict[int, tuple | None] = self._take(layers) if recompute else {}
        self.scope: _Scope | None = None

    def _take(self, layers: range) -> dict[int, tuple | None]:
        """The forward's entries for these layers, received on this worker (called before the compute span:
        it may wait for another worker's forward)."""
        board, w = self.ctx.board, self.w
        arriving = {}
        for l in layers:
            found, h = board.poll(_key(l, self.m))
            if not found:
                w.before_wait()
                with w.yielded():
                    h = board.get(_key(l, self.m))
            arriving[l] = None if h is None else w.receive(h, forward=False)
        return {l: None if a is None else w.use(a) for l, a in arriving.items()}

    @contextlib.contextmanager
    def _scoped(self, scope: _Scope) -> Iterator[_Scope]:
        outer = getattr(_local, "scope", None)
        _local.scope = self.scope = scope
        try:
            yield scope
        finally:
            _local.scope = outer

    def layer(self, l: int) -> contextlib.AbstractContextManager:
        """Around layer l's call: the scope the three public functions read (none outside both runs)."""
        if self.recompute:
            return self._scoped(_Scope(l, True, self.kept.pop(l)))
        if self.saving:
            return self._scoped(_Scope(l, False, None))
        return contextlib.nullcontext()

    def keep(self, l: int) -> None:
        """After layer l's first run: what it saved (None: nothing) on the board for its recompute."""
        saved, self.scope = self.scope.saved, None
        value = None if saved is None else self.w.send(saved, need_host=True, keep_device=False)
        self.ctx.board.put(_key(l, self.m), value, 1)
