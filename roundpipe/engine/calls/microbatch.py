"""Splitting a call's arguments into microbatches and merging outputs back.

A batch is whatever the caller passes to the model: positional and keyword
arguments, each a tensor or any nest of tuples/lists/dicts of tensors and other
values.  The batch size B is dim 0 of the first tensor (in argument order) that
has a dim 0; every tensor leaf whose dim 0 equals B is split along dim 0 and
every other leaf (scalars, masks of another size, Python values) goes whole to
every microbatch.  Splits may be uneven: B=10 in 4 microbatches gives sizes
3, 3, 2, 2 (the first B % M microbatches get one sample more), and the loss of
microbatch m is weighted by size_m / B (see `Microbatches.weights`), or by 1
with `reduction="sum"` (the loss_fn then returns its share of the batch loss,
e.g. a sum over tokens divided by the batch's token count: token weighting).

A custom `split_fn(args, kwargs, labels, num_microbatches)` may replace the
rule; it returns one `(args, kwargs, labels)` triple per microbatch and the
microbatch sizes are read from dim 0 of the first tensor of each triple.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from roundpipe.core.tree import tensors, tree_leaves, tree_map

SplitFn = Callable[[tuple, dict, Any, int], list]


def batch_size_of(obj: Any) -> int | None:
    for t in tensors(obj):
        if t.dim() >= 1:
            return t.shape[0]
    return None


def even_sizes(batch: int, num: int) -> list[int]:
    return [batch // num + (1 if i < batch % num else 0) for i in range(num)]


def _split_nest(obj: Any, batch: int, sizes: list[int]) -> list[Any]:
    pieces: dict[int, tuple] = {}

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == batch:
            pieces[id(leaf)] = torch.split(leaf, sizes)
        return leaf

    tree_map(cut, obj)
    return [tree_map(lambda leaf: pieces[id(leaf)][m] if id(leaf) in pieces else leaf, obj)
            for m in range(len(sizes))]


@dataclass
class Microbatches:
    """Per-microbatch (args, kwargs, labels) and sizes of one call."""

    args: list[tuple]
    kwargs: list[dict]
    labels: list[Any]
    sizes: list[int]
    reduction: str = "mean"   # "mean": losses weighted by size_m / B; "sum": added as they are
    round_size: int | None = None   # microbatches per round, where the call sets its own (None: the model's)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def weights(self) -> list[float]:
        """size_m / B: makes the weighted sum of per-microbatch mean losses the batch mean (1 each for "sum")."""
        if self.reduction == "sum":
            return [1.0] * len(self.sizes)
        total = sum(self.sizes)
        return [s / total for s in self.sizes]


def split(args: tuple, kwargs: dict, labels: Any, num_microbatches: int | None, default: int,
          split_fn: SplitFn | None = None, labels_required: bool = False) -> Microbatches:
    """Validates the call's inputs and splits them into microbatches.

    labels_required: labels go to a loss_fn, so they must hold a tensor with the batch along
    dim 0 (anything else could not be split per microbatch)."""
    batch = batch_size_of((args, kwargs))
    if batch is None:
        raise ValueError("nothing to split into microbatches: no tensor argument with a batch dimension "
                         "(dim 0) was passed; pass at least one tensor of shape (batch, ...)")
    if batch == 0:
        raise ValueError("the batch is empty (dim 0 of the first tensor argument is 0); pass at least one sample")
    if labels_required and split_fn is None and not any(t.dim() >= 1 for t in tensors(labels)):
        raise TypeError(f"labels must be a tensor (or a nest holding tensors) with the batch ({batch}) along dim 0, "
                        f"got {type(labels).__name__}" + (f" {labels!r}"[:80] if not isinstance(labels, torch.Tensor)
                                                          else f" of shape {tuple(labels.shape)}"))
    if labels is not None:
        for t in tensors(labels):
            if t.dim() >= 1 and t.shape[0] != batch:
                raise ValueError(f"labels have batch size {t.shape[0]} but the inputs have batch size {batch}; "
                                 "they must match along dim 0")
    if num_microbatches is not None and not (isinstance(num_microbatches, int) and num_microbatches >= 1):
        raise ValueError(f"num_microbatches={num_microbatches!r} must be an int >= 1")
    # A batch smaller than the microbatch count (a DataLoader's last batch) runs with one sample
    # per microbatch, its loss weighted as for any other batch.
    num = max(1, min(default if num_microbatches is None else num_microbatches, batch))
    if split_fn is not None:
        parts = split_fn(args, kwargs, labels, num)
        if not isinstance(parts, (list, tuple)) or not parts:
            raise TypeError(f"split_fn must return a non-empty list of (args, kwargs, labels), got {type(parts).__name__}")
        sizes = [batch_size_of(p) for p in parts]
        if any(s is None or s == 0 for s in sizes):
            raise ValueError(f"split_fn returned a microbatch without a batch dimension (sizes {sizes})")
        return Microbatches([tuple(p[0]) for p in parts], [dict(p[1]) for p in parts], [p[2] for p in parts], sizes)
    sizes = even_sizes(batch, num)
    a = _split_nest(tuple(args), batch, sizes)
    k = _split_nest(dict(kwargs), batch, sizes)
    lab = _split_nest(labels, batch, sizes) if labels is not None else [None] * num
    return Microbatches(a, k, lab, sizes)


def weighted_sum(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_m values[m] * weights[m], added in microbatch order: how a call's losses (and a loss_fn's other
    entries) become the batch's."""
    total = values[0] * weights[0]
    for v, w in zip(values[1:], weights[1:]):
        total += v * w
    return total


def merge(outputs: list[Any]) -> Any:
    """Concatenates per-microbatch outputs along dim 0 (tensors with a dim 0), leaf by leaf.

    0-dim tensors are stacked; other values are returned as a list with one entry per microbatch.
    """
    if len(outputs) == 1:
        return outputs[0]
    columns = [list(tree_leaves(o)) for o in outputs]
    merged = []
    for i, first in enumerate(columns[0]):
        col = [c[i] for c in columns]
        if isinstance(first, torch.Tensor):
            merged.append(torch.cat(col) if first.dim() >= 1 else torch.stack(col))
        else:
            merged.append(col)
    it = iter(merged)
    return tree_map(lambda _leaf: next(it), outputs[0])
