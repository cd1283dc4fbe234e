"""Structural replicas: one copy of each layer's module per worker, with no weights of its own.

Workers run concurrently, so they must never share a module object (a module's
forward may keep state on `self`, and binding weights into one shared module
from several threads would race).  Each worker gets a deep copy of every layer
whose parameters and buffers are meta tensors; a stage run binds the worker's
uploaded tensors into it and unbinds them afterwards, so a replica holds device
memory only while its stage runs.

`keeping` lists the replica's 4-bit modules (roundpipe.quant: QuantLinear, QuantExperts):
a stage run attaches its DequantKeep to them while it runs (roundpipe/engine/calls/stage.py),
so they dequantize once per stage run, not once per product.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from roundpipe.quant.keep import keeping


def _slots(module: nn.Module, names: list[str], kind: str) -> list[tuple[nn.Module, str]]:
    out = []
    for name in names:
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        table = owner._parameters if kind == "param" else owner._buffers
        assert leaf in table, f"{name} is not a {kind} of the replica"
        out.append((owner, leaf))
    return out


class Replica:
    """A weightless copy of one layer with fast bind/unbind of its parameters and buffers."""

    def __init__(self, layer: nn.Module, param_names: list[str], buffer_names: list[str]):
        memo: dict[int, object] = {}
        for p in layer.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in layer.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        self.module = copy.deepcopy(layer, memo)
        self._params = _slots(self.module, param_names, "param")
        self._buffers = _slots(self.module, buffer_names, "buffer")
        self._meta_params = [owner._parameters[leaf] for owner, leaf in self._params]
        self._meta_buffers = [owner._buffers[leaf] for owner, leaf in self._buffers]
        # Train/eval flags are read from the master's submodules at every bind; other attributes
        # are copied once, here, so change a layer's configuration before wrapping it.
        self._modes = list(zip(self.module.modules(), layer.modules()))
        self.keeping = keeping(self.module.modules())   # modules a stage run's DequantKeep is attached to
        # The layer writes its input in place, so an input leaf that requires grad reaches it as an alias
        # (compute.py `writable`); learned from its first such run, set on every worker's replica.
        self.writes_input = False

    def bind(self, params: list[torch.Tensor], requires_grad: list[bool],
             buffers: list[torch.Tensor]) -> list[nn.Parameter]:
        """Installs device tensors as this replica's weights; returns the bound leaf parameters."""
        bound = []
        for (owner, leaf), t, rg in zip(self._params, params, requires_grad):
            p = nn.Parameter(t, requires_grad=rg)
            owner._parameters[leaf] = p
            bound.append(p)
        for (owner, leaf), t in zip(self._buffers, buffers):
            owner._buffers[leaf] = t
        for rep, master in self._modes:
            if rep.training != master.training:   # nn.Module.__setattr__ is slow; the flag rarely changes
                rep.training = master.training
        return bound

    def bound_buffers(self) -> list[torch.Tensor]:
        return [owner._buffers[leaf] for owner, leaf in self._buffers]

    def unbind(self) -> None:
        for (owner, leaf), meta in zip(self._params, self._meta_params):
            owner._parameters[leaf] = meta
        for (owner, leaf), meta in zip(self._buffers, self._meta_buffers):
            owner._buffers[leaf] = meta
