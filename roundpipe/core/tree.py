"""Nests of arguments: tuples (named ones too), lists and dicts of tensors and other values.

Every floor walks them: a call's arguments are split into microbatches, a worker moves a
stage's inputs and outputs, a hand-off carries activations.  The order of the leaves is
the order `tree_map` visits them, which `tree_unflatten` relies on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

_NESTS = (tuple, list, dict)


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Applies fn to every leaf of a nest of tuples (named ones too), lists and dicts."""
    if isinstance(obj, torch.Tensor):   # the common case, a plain activation: no nest to walk
        return fn(obj)
    if isinstance(obj, tuple):
        mapped = [tree_map(fn, o) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
    if isinstance(obj, list):
        return [tree_map(fn, o) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, tree_map(fn, v)) for k, v in obj.items())
    return fn(obj)


def detached(obj: Any) -> Any:
    """The nest with every tensor detached from autograd (other leaves as they are)."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)


def _collect(obj: Any, out: list) -> None:
    if isinstance(obj, (tuple, list)):
        for o in obj:
            _collect(o, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    else:
        out.append(obj)


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of a nest, in the order tree_map visits them."""
    if not isinstance(obj, _NESTS):
        return [obj]
    out: list[Any] = []
    _collect(obj, out)
    return out


def tree_unflatten(like: Any, leaves: list[Any]) -> Any:
    """A nest shaped like `like` whose leaves are `leaves` (in tree_leaves order)."""
    if not isinstance(like, _NESTS):
        return leaves[0]
    it = iter(leaves)
    return tree_map(lambda _leaf: next(it), like)


def tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
