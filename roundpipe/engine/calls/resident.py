"""Resident weights: a prefix of layers keeps its uploaded weights on each worker across stage runs.

Every stage run uploads its layers' weights from the host upload copies (stage.py).  On one
GPU a layer's forward stage and the backward stage that recomputes it upload the same bytes
twice per iteration, and a frozen weight (a LoRA or QLoRA base) is uploaded again every
iteration though it never changes.  When the device has room left after the plan's working set,
the first `count` layers' uploaded tensors stay on the worker after their stage, and a later
stage of the same layer on the same worker binds them instead of copying them again.

Validity.  A kept tensor is reused only while the host values it was copied from are unchanged:
HostState.upload_keys gives each uploaded tensor a key that moves whenever its upload copy may be
rewritten (a trained weight at every P-copy or fused update of its layer's group, a frozen one or
a constant buffer only when the user changes masters); an entry whose key differs is replaced by a
fresh upload.  The per-layer protocol (roundpipe/engine/step/async_step.py) already keeps a call's
uploads of a layer apart from the step that rewrites it, so a key read where the upload would have
read the host copy names exactly the values that upload would have copied.

So with the host step a trained resident layer saves the second upload within an iteration (when
its forward and backward stage run on the same worker: always with one worker), and a frozen
resident weight is uploaded once for the whole run.  Written buffers (BatchNorm statistics) are
never kept: a forward writes them back to the host every stage.

Memory.  Kept tensors stay in the worker's ledger as weights.  How many layers are kept is the
largest prefix whose bytes, beside the plan's predicted working set, keep every worker's
predicted peak under its device_memory cap (roundpipe/engine/device_memory.py, `resident_prefix`);
a worker with no cap (CPU workers by default) keeps none unless `RoundPipe(resident_layers=k)`
asks for it.  An entry past the current prefix is dropped by its worker at its next stage (after a
re-plan shrank it), and every entry at a failed call, a checkpoint load and close.  A trained weight
the device step took over (roundpipe/engine/step/device_step.py) is bound from the worker's own copy
instead, and its kept upload copy is dead weight: each device update stamps the layer, so the copy's
key no longer matches and the next lookup drops it; none is kept again while the device step owns it.
"""
from __future__ import annotations

import threading

import torch


class ResidentWeights:
    """Per worker, the kept device tensors of resident layers: (layer, tensor index) -> (key, tensor)."""

    def __init__(self):
        self._kept: dict[str, dict[tuple[int, int], tuple[tuple, torch.Tensor]]] = {}
        self._lock = threading.Lock()   # clear() runs on the caller's thread, lookups on the workers'
        self._counts: dict[str, int] = {}   # per worker, the prefix its entries were last trimmed to

    def lookup(self, worker: str, layer: int, keys: list[tuple]) -> list[torch.Tensor | None]:
        """Per tensor of the layer, its kept device copy when its key still matches, else None (stale
        entries are dropped)."""
        with self._lock:
            kept = self._kept.get(worker)
            if not kept:
                return [None] * len(keys)
            out = []
            for j, key in enumerate(keys):
                entry = kept.get((layer, j))
                if entry is not None and entry[0] != key:
                    del kept[(layer, j)]
                    entry = None
                out.append(None if entry is None else entry[1])
            return out

    def keep(self, worker: str, layer: int, keys: list[tuple], tensors: list[torch.Tensor | None]) -> None:
        """Keeps a layer's uploaded tensors on the worker under their keys (None: not kept anew: bound from a kept
        copy, or a device-stepped weight, roundpipe/engine/step/device_step.py)."""
        with self._lock:
            kept = self._kept.setdefault(worker, {})
            for j, (key, t) in enumerate(zip(keys, tensors)):
                if t is not None:
                    kept[(layer, j)] = (key, t)

    def trim(self, worker: str, count: int) -> None:
        """Drops the worker's entries of layers >= count (the prefix shrank); a no-op, without a scan of the
        entries, while the count stays what it was (every stage run of a resident layer asks)."""
        with self._lock:
            if self._counts.get(worker) == count:
                return
            self._counts[worker] = count
            kept = self._kept.get(worker)
            if kept:
                for k in [k for k in kept if k[0] >= count]:
                    del kept[k]

    def clear(self) -> None:
        """Drops every kept tensor (a failed call, a checkpoint load, close)."""
        with self._lock:
            self._kept = {}

    def nbytes(self, worker: str) -> int:
        """Device bytes the worker keeps."""
        with self._lock:
            return sum(t.nbytes for _, t in self._kept.get(worker, {}).values())

    def layers(self, worker: str) -> list[int]:
        """The layers of which the worker keeps at least one tensor."""
        with self._lock:
            return sorted({l for l, _ in self._kept.get(worker, {})})
