"""Dequantize once per stage run: the dequantized weights a worker keeps while one stage runs.

A stage run (roundpipe/engine/calls/stage.py) runs all of its microbatches on one
worker, and each microbatch needs every 4-bit weight of the stage once or
more: the forward, a backward stage's recompute and the input-gradient product
of the backward.  Dequantizing before each product costs the whole stage's
dequantization (3 x M for a backward stage of M microbatches) and buys nothing
the stage does not already pay for: the stage is sized to hold its layers.  So
the engine hands each stage run a `DequantKeep`: a 4-bit module that has one
(`attach`ed into the worker's replica while the stage's weights are bound)
dequantizes a weight the first time a product needs it in a compute dtype and
then reuses that tensor for every later product of the stage run; `release`
(at the stage's end, when its weights are unbound) drops them all.

    stage run:   upload packed --> m0: F (dequantize, keep) --> m1: F (reuse) ... --> release (kept die)
    without:     every product dequantizes a fresh transient (the module outside the engine)

Device memory.  The kept weights are registered in the worker's ledger as
`weights`, not `workspace`: they are held for the stage's whole duration,
exactly like its uploaded parameters, and the planner counts them with the
layer's weight bytes (roundpipe/engine/dry_run.py `dry_run_costs`), where a
transient would be workspace of one product.  They die at `release`: the
last reference the engine holds goes, and autograd graphs of the stage (which
save the same tensor for an input gradient) are gone by then.

The values are bitwise those of dequantizing per product: the same function,
the same dtype, computed once.  A product whose keep has been released (an
autograd graph kept past its stage, outside the engine) dequantizes again.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
from torch import nn


class DequantKeep:
    """The dequantized weights of one stage run, by (module, name, dtype); `ledger`: the worker's, or None."""

    def __init__(self, ledger=None) -> None:
        self.ledger = ledger
        self._kept: dict[Hashable, torch.Tensor] = {}
        self.released = False
        self.made = 0          # how many dequantizations this keep ran (tests, benchmarks)

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The kept tensor for `key`, made by `make()` the first time (or every time once released)."""
        if self.released:
            return make()
        t = self._kept.get(key)
        if t is None:
            t = self._kept[key] = make()
            self.made += 1
            if self.ledger is not None:
                self.ledger.track(t, "weights")
        return t

    @property
    def nbytes(self) -> int:
        """Bytes of the weights kept now."""
        return sum(t.numel() * t.element_size() for t in self._kept.values())

    def release(self) -> None:
        """Drops every kept weight; later requests dequantize per product."""
        self._kept.clear()
        self.released = True


def keeping(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules (of one layer replica) that dequantize through a keep: those with a `dequant_keep` slot."""
    return [m for m in modules if hasattr(type(m), "dequant_keep")]


def attach(modules: Iterable[nn.Module], keep: DequantKeep | None) -> None:
    """Points the modules' products at `keep` (None: dequantize per product again).  Set in the instance
    __dict__, not through nn.Module.__setattr__: this runs at every stage run's bind and unbind."""
    for m in modules:
        m.__dict__["dequant_keep"] = keep
