"""The optimizer-state tier: the state of the layers that do not fit `host_memory` lives on NVMe.

    model = RoundPipe(layers, offload_dir="/nvme/rp", host_memory=64 << 30)
    model.step(rp.optim.AdamW(model.parameters()))   # first step: placement, files preallocated

Where state lives.  Upload copies and gradients stay in host memory.  At the first
step the tier learns the optimizer's per-parameter state layout exactly (its own
`_states` run on meta tensors: AdamW 8 B/param, AdamW8bit 2 B/param + absmax; state_layout.py).
Phase 1: it keeps the state of layers in RAM, first fit from layer 0, while masters +
upload copies + gradients + the ring + the resident state stay under `host_memory`,
and gives every other layer one region (a preallocated file) of an `NVMeStore` under
`offload_dir`.  Between steps an offloaded parameter's `optimizer.state[p]` holds only
its 'step' count.  Phase 2, when even all the state on disk leaves the masters over
`host_memory`: every layer's state on disk, and the fp32 masters that do not fit
(first fit from layer 0) in a second region per layer, travelling with the state
through the same ring slot (roundpipe/offload/masters.py: placeholders between steps,
what cannot move).

A step, per offloaded layer (the protocol visits layers tail first):

    ring slot:   [ read l (ahead) ] [ update l: state[p] = views of the slot ] [ write l (behind) ]
    meanwhile:   the reads of the next layers below l into the other slots (`slots`, 3 by default)

The unchanged fused `step_layer` runs on views of a slot (the kernels update in place, so
the bytes and the arithmetic are those of training in RAM: bitwise equal); after it the
slot is written back whole.  Each state byte crosses the disk once each way per step.
When the last offloaded layer of a step is updated the writes are waited for and the
first layers of the next step are read ahead.  The ring and its slots' states: state_ring.py
(`StateRing`, the step side StateTier derives from); placement, sync points, the masters on
disk and checkpoints are here.

Failure semantics (per layer all or nothing):
  - a read fails (StorageError naming the file): that layer and every layer after it in
    the step are not updated (their masters and state are as before, upload copies
    rewritten from the masters, gradients dropped, as after any step error); layers
    updated before it keep their update, state written; the error reaches the caller.
  - a write fails: the layer was updated and its new state is still in the slot, which
    the tier keeps in RAM (that layer is resident until a later write of it succeeds: read
    ahead into a slot that is then given up, by a gate opening out of order or a quiesce, its
    buffer goes back to RAM, never re-read from the region the failed write poisoned), so
    masters and state agree; the error is raised by the next step before it updates any
    layer, or by `synchronize()` / `save_checkpoint` / `close()`, whichever comes first.
"""
from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Callable

import torch

from roundpipe.core.checks import is_int
from roundpipe.core.file_values import no_duplicates, short
from roundpipe.offload.masters import LazyMaster, MasterLayout, master_layout, movable_bytes, placeholder
from roundpipe.offload.masters import view as master_view
from roundpipe.offload.nvme import NVMeConfig, NVMeStore, check_free_space
from roundpipe.offload.state_layout import LayerLayout, Slice, probe_layout, slice_view
from roundpipe.offload.state_ring import Slot, StateRing, trim_heap


def fixed_bytes(host: Any, compute_dtype: torch.dtype) -> dict[str, int]:
    """Host bytes that stay in RAM whatever is offloaded: masters, upload copies and gradients
    (a landing buffer and the step's gradient per trainable element, in the compute dtype)."""
    b = host.host_bytes()
    trainable = {id(p): p for st in host.layers for p in st.params if p.requires_grad}
    item = torch.empty((), dtype=compute_dtype).element_size()
    return {"masters": b["masters"], "upload_copies": b["upload_copies"],
            "gradients": 2 * item * sum(p.numel() for p in trainable.values())}


class StateTier(StateRing):
    """Optimizer state of the layers that do not fit `host_memory`, in files under `directory`."""

    def __init__(self, host: Any, directory: Any, host_memory: int | None, compute_dtype: torch.dtype, *,
                 config: NVMeConfig | None = None, slots: int = 3, _test_hooks: dict | None = None):
        self.host = host
        self.fixed = fixed_bytes(host, compute_dtype)
        kept = self.fixed["masters"] - movable_bytes(host)   # masters that are their own upload copies stay
        need = self.fixed["upload_copies"] + self.fixed["gradients"] + kept
        if host_memory is not None:
            if not is_int(host_memory) or host_memory <= 0:
                raise ValueError(f"host_memory={host_memory!r} must be None or a number of bytes > 0")
            if host_memory < need:
                own = (f" + masters that are their own upload copies (the workers read them) {kept}" if kept else "")
                raise ValueError(
                    f"host_memory={host_memory} bytes is below what stays in host memory: upload copies "
                    f"{self.fixed['upload_copies']} + gradients {self.fixed['gradients']}{own} = {need} bytes "
                    f"(the optimizer state and the other fp32 masters go to offload_dir); raise host_memory to at "
                    f"least {need}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"offload_dir must be a path (str or os.PathLike), got {type(directory).__name__}")
        directory = os.fspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"offload_dir={directory!r} exists and is not a directory")
        if not is_int(slots) or slots < 2:
            raise ValueError(f"slots={slots!r} must be an int >= 2 (one updated, one read ahead or written)")
        try:
            self.store = NVMeStore(directory, config, _test_hooks=_test_hooks)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"offload_dir={directory!r} is not a writable directory ({e}); give a directory on a "
                             f"local disk this process may write") from None
        self.directory, self.host_memory, self.nslots = directory, host_memory, slots
        self.optimizer: Any = None
        self.layouts: dict[int, LayerLayout] = {}   # offloaded layers
        self.master_layouts: dict[int, MasterLayout] = {}   # layers whose masters are on disk too (phase 2)
        self.master_regions: dict[int, Any] = {}
        self.master_base = 0                         # where a slot's master part begins
        self.placeholders: dict[tuple[int, int], torch.Tensor] = {}   # (layer, j) -> p.data between steps
        self._cached: int | None = None              # the layer whose masters slot 0 holds (master_view)
        self.resident_bytes = 0                      # optimizer state kept in RAM (estimated at placement)
        self.regions: dict[int, Any] = {}
        self.slots: list[Slot] = []
        self.initialized: set[int] = set()     # optimizer parameter indices whose state is on disk
        self.resident: dict[int, torch.Tensor] = {}   # layers whose write failed: their state, in RAM
        self.error: BaseException | None = None      # a write failure not raised yet
        self._params: list[torch.Tensor] = []
        self._lock = threading.RLock()

    # ---- placement ------------------------------------------------------------------------------
    def bind(self, optimizer: Any) -> None:
        """At the first step: the layout, which layers go to disk, the free-space check, the files."""
        from roundpipe.optim.base import FusedOptimizer
        if self.optimizer is optimizer:
            return
        if self.optimizer is not None:
            raise ValueError("offload_dir: the optimizer state on disk belongs to the optimizer of the first step(); "
                             "step with that optimizer (a new one needs a new RoundPipe)")
        if not isinstance(optimizer, FusedOptimizer):
            raise ValueError(f"offload_dir needs a roundpipe.optim optimizer (AdamW, AdamW8bit, ...: the tier streams "
                             f"the state of its per-layer fused step), got {type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        layouts = [probe_layout(optimizer, l, self.host.step_params(l)[0], index) for l in range(len(self.host))]
        mlayouts = [master_layout(self.host, l, index) for l in range(len(self.host))]
        disk, mdisk, resident = self._place(layouts, mlayouts)
        check_free_space(self.directory, sum(lay.nbytes for lay in disk) + sum(m.nbytes for m in mdisk),
                         "the offloaded optimizer state" + (" and fp32 masters" if mdisk else ""))
        for lay in disk:
            self.regions[lay.layer] = self.store.allocate(f"layer{lay.layer}.optim", lay.nbytes)
            self.layouts[lay.layer] = lay
        for m in mdisk:
            self.master_regions[m.layer] = self.store.allocate(f"layer{m.layer}.master", m.nbytes)
            self.master_layouts[m.layer] = m
        if disk:
            self.master_base = max(lay.nbytes for lay in disk)
            size = self.master_base + max((m.nbytes for m in mdisk), default=0)
            self.slots = [Slot(self.store.empty(size)) for _ in range(self.nslots)]
        self.optimizer, self._params, self.resident_bytes = optimizer, params, resident
        for m in mdisk:   # the masters move: written once, then p.data is the placeholder
            self._write_masters_out(m)
        if mdisk:
            trim_heap()

    def _place(self, layouts: list[LayerLayout], mlayouts: list[MasterLayout]):
        """(state layouts to disk, master layouts to disk, resident state bytes).  Phase 1: masters in RAM, layers
        keep their state first fit from layer 0.  Phase 2, when even every layer's state on disk leaves the
        masters over host_memory: all the state on disk, and the masters that do not fit first fit from layer 0."""
        fixed = sum(self.fixed.values())
        ring = self.nslots * max((lay.nbytes for lay in layouts), default=0)
        budget = None if self.host_memory is None else self.host_memory - fixed - ring
        if budget is None or budget >= 0:
            disk, resident = [], 0
            for lay in layouts:
                if budget is not None and resident + lay.nbytes <= budget:
                    resident += lay.nbytes
                elif lay.params:
                    disk.append(lay)
            return disk, [], resident
        raw = [sum(n for _, _, n in m.params) for m in mlayouts]
        kept = fixed - sum(raw)   # upload copies, gradients and the masters that cannot move
        ring = self.nslots * (max((lay.nbytes for lay in layouts), default=0) + max(m.nbytes for m in mlayouts))
        budget = self.host_memory - kept - ring
        if budget < 0:
            raise ValueError(f"host_memory={self.host_memory} bytes leaves no room for the {self.nslots} ring buffers "
                             f"of a layer's optimizer state and fp32 masters ({ring} bytes) beside upload copies, "
                             f"gradients and the masters that stay in RAM ({kept} bytes); raise host_memory to at "
                             f"least {kept + ring}")
        mdisk, resident = [], 0
        for m, n in zip(mlayouts, raw):
            if resident + n <= budget:
                resident += n
            elif m.params:
                mdisk.append(m)
        return [lay for lay in layouts if lay.params], mdisk, 0

    def _write_masters_out(self, m: MasterLayout) -> None:
        """At placement: the layer's masters -> its master region (through slot 0), then placeholders."""
        st, buf = self.host.layers[m.layer], self.slots[0].buf[self.master_base:]
        for j, off, n in m.params:
            master_view(buf, st.params[j], off, n).copy_(st.params[j].data)
        self.store.write(self.master_regions[m.layer], buf[:m.nbytes])
        for j, _, _ in m.params:
            ph = self.placeholders[m.layer, j] = placeholder(st.params[j])
            st.params[j].data = ph
            self.host.placeholders.add(ph.data_ptr())
        self.host.stamp(m.layer)

    def stats(self) -> dict[str, int]:
        return {"optimizer_state_on_disk": sum(lay.nbytes for lay in self.layouts.values()),
                "offloaded_layers": len(self.layouts),
                "masters_on_disk": sum(n for m in self.master_layouts.values() for _, _, n in m.params),
                "offloaded_master_layers": len(self.master_layouts),
                "offload_ring": sum(s.buf.nbytes for s in self.slots),
                "optimizer_state_resident_after_error": sum(t.nbytes for t in self.resident.values())}

    # ---- sync points (the step itself: state_ring.py) ---------------------------------------------
    def settle(self) -> None:
        """At a sync point (host thread idle): every write waited for, a write failure raised."""
        with self._lock:
            self._settle_writes()
            self._raise_pending()

    def quiesce(self) -> None:
        """settle(), and the reads ahead dropped: the ring is free (checkpoints)."""
        with self._lock:
            self._settle_writes()
            for s in self.slots:
                if s.kind in ("read", "ready"):
                    self._drop(s)
            self._cached = None
            self._raise_pending()

    def close(self) -> None:
        """Writes settled, the masters on disk handed back to the module (read into RAM: the upload copies were
        dropped just before), the files removed."""
        with self._lock:
            try:
                self._settle_writes()
                for s in self.slots:
                    if s.kind in ("read", "ready"):
                        self._drop(s)
                self._cached = None
                for l in sorted(self.master_layouts):
                    st = self.host.layers[l]
                    for j, _, _ in self.master_layouts[l].params:
                        st.params[j].data = self.master_view(l, j).clone()
                        self.host.placeholders.discard(self.placeholders.pop((l, j)).data_ptr())
            finally:
                self.store.close()
            self._raise_pending()

    # ---- masters on disk: read, checkpoints ----------------------------------------------------------
    def _where(self) -> dict[int, tuple[int, int]]:
        """placeholder data_ptr -> (layer, j) of every master on disk."""
        return {ph.data_ptr(): lj for lj, ph in self.placeholders.items()}

    def master_view(self, l: int, j: int) -> torch.Tensor:
        """The master j of layer l as on disk, a view of slot 0 (read once per layer; quiesce() first)."""
        m = self.master_layouts[l]
        off, n = next((off, n) for k, off, n in m.params if k == j)
        p = self.host.layers[l].params[j]
        if l in self.resident:   # its write failed: the newest master is in RAM
            return master_view(self.resident[l][self.master_base:], p, off, n)
        buf = self.slots[0].buf[self.master_base:]
        if self._cached != l:
            self.store.read(self.master_regions[l], buf[:m.nbytes])
            self._cached = l
        return master_view(buf, p, off, n)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """A copy of the master of `p` (read from disk when it lives there; after synchronize())."""
        where = self._where().get(p.data_ptr())
        if where is None:
            return p.detach().clone()
        with self._lock:
            self.quiesce()
            return self.master_view(*where).clone()

    def stream_masters(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
        """A checkpoint's (name, tensor) list with the masters on disk as LazyMaster (read a layer at a time)."""
        where = self._where()
        if not where:
            return items
        self.quiesce()
        return [(name, LazyMaster(self, *where[t.data_ptr()], t) if t.data_ptr() in where else t)
                for name, t in items]

    def masters_on_disk(self, named: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """name -> (layer, j) of the named tensors that are masters on disk."""
        where = self._where()
        return {name: where[t.data_ptr()] for name, t in named.items() if t.data_ptr() in where}

    def load_masters(self, read_into: Callable[[str, torch.Tensor], None], names: dict[str, tuple[int, int]]) -> None:
        """Loading a checkpoint: each layer's masters read (`read_into(name, dst)`) into slot 0, its upload copies
        rewritten from them, the region written; the placeholders back."""
        self.quiesce()
        by_layer: dict[int, list[tuple[str, int]]] = {}
        for name, (l, j) in names.items():
            by_layer.setdefault(l, []).append((name, j))
        with self._lock:
            buf = self.slots[0].buf[self.master_base:]
            for l, entries in sorted(by_layer.items()):
                m, st = self.master_layouts[l], self.host.layers[l]
                self.store.read(self.master_regions[l], buf[:m.nbytes])   # masters the checkpoint has no name for
                views = {j: master_view(buf, st.params[j], off, n) for j, off, n in m.params}
                for name, j in entries:
                    read_into(name, views[j])
                for j, v in views.items():
                    st.params[j].data = v
                self.host.pcopy(l)
                self.store.write(self.master_regions[l], buf[:m.nbytes])
                if l in self.resident:
                    self.resident[l][self.master_base:self.master_base + m.nbytes].copy_(buf[:m.nbytes])
                for j in views:
                    st.params[j].data = self.placeholders[l, j]
                self.host.stamp(l)
            self._cached = None

    # ---- checkpoints: a layer at a time ------------------------------------------------------------
    def save(self, folder: str) -> dict[str, int]:
        """optimizer_offload.bin (every offloaded layer's region, in layer order) and its layout
        optimizer_offload.json, streamed through one ring slot; returns their sizes."""
        self.quiesce()
        meta = {"layers": [], "initialized": sorted(self.initialized)}
        bin_path = os.path.join(folder, BIN)
        with self._lock, open(bin_path, "wb") as f:
            slot = self.slots[0] if self.slots else None
            for l in sorted(self.layouts):
                lay, region = self.layouts[l], self.regions[l]
                if l in self.resident:
                    buf = self.resident[l]
                else:
                    buf = slot.buf
                    if self._needs_read(l):
                        self.store.read(region, buf[:region.nbytes])
                    else:
                        buf[:region.nbytes].zero_()
                f.write(memoryview(buf[:lay.nbytes].numpy()))
                meta["layers"].append({"layer": l, "nbytes": lay.nbytes, "params": lay.describe()})
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(folder, META), "w") as f:
            json.dump(meta, f)
        return {BIN: os.path.getsize(bin_path), META: os.path.getsize(os.path.join(folder, META))}

    def reset(self) -> None:
        """After the optimizer's state was loaded: nothing on disk counts until written again (but the masters of a
        layer whose write failed: written now)."""
        self.quiesce()
        with self._lock:
            for l, buf in list(self.resident.items()):
                if l in self.master_regions:
                    n = self.master_regions[l].nbytes
                    self.store.write(self.master_regions[l], buf[self.master_base:self.master_base + n])
            self.initialized.clear()
            self.resident.clear()


BIN, META = "optimizer_offload.bin", "optimizer_offload.json"
ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "state1", "state2")   # shaped like the parameter


# the dtypes optimizer state is stored in, by the names optimizer_offload.json gives them
STATE_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                             torch.float64, torch.uint8, torch.int8, torch.int32,
                                                             torch.int64)}


def read_meta(folder: str, optimizer: Any) -> dict:
    """The checkpoint's offload layout, read as strictly as the checkpoint's own files (a damaged or hostile file
    is a ValueError naming it, never another error or a read outside the data) and checked against the
    optimizer's parameters and optimizer_offload.bin's size."""
    path = os.path.join(folder, META)
    try:
        with open(path) as f:
            meta = json.load(f, object_pairs_hook=no_duplicates)
        size = os.path.getsize(os.path.join(folder, BIN))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"load_checkpoint: {path} could not be read ({short(str(e))})") from None
    problem = _meta_problem(meta, [p for g in optimizer.param_groups for p in g["params"]], size)
    if problem is not None:
        raise ValueError(f"load_checkpoint: {path}: {problem}")
    return meta


def _meta_problem(meta: Any, params: list, size: int) -> str | None:
    """What is wrong with an optimizer_offload.json (None: nothing): its shape as `StateTier.save` writes it,
    every slice inside its layer's bytes and apart from the others, each parameter's state in one layer."""
    if not isinstance(meta, dict) or set(meta) != {"layers", "initialized"}:
        return "expected an object with exactly the keys 'layers' and 'initialized'"
    init, entries = meta["initialized"], meta["layers"]
    if not isinstance(init, list) or not all(is_int(i) and 0 <= i < len(params) for i in init) \
            or len(set(init)) != len(init):
        return f"'initialized' must list distinct optimizer parameter indices below {len(params)}"
    if not isinstance(entries, list):
        return "'layers' must be a list"
    total, layers_seen, params_seen = 0, set(), set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"layer", "nbytes", "params"}:
            return f"a layer entry {short(entry)} must be an object with the keys 'layer', 'nbytes' and 'params'"
        l, nbytes, plist = entry["layer"], entry["nbytes"], entry["params"]
        if not is_int(l) or l < 0 or l in layers_seen:
            return f"layer {short(l)} is not an index >= 0 or appears twice"
        if not is_int(nbytes) or not 0 <= nbytes <= size:
            return f"layer {l}: nbytes {short(nbytes)} is not an int within the data's {size} bytes"
        layers_seen.add(l)
        total += nbytes
        if not isinstance(plist, list):
            return f"layer {l}: 'params' must be a list"
        spans = []
        for item in plist:
            if not (isinstance(item, list) and len(item) == 2 and is_int(item[0]) and isinstance(item[1], list)):
                return f"layer {l}: {short(item)} is not [optimizer parameter index, slices]"
            i, slices = item
            if not 0 <= i < len(params) or i in params_seen:
                return (f"layer {l} has state of optimizer parameter {i}; the optimizer has {len(params)}, "
                        "each parameter's state in one layer")
            params_seen.add(i)
            for sl in slices:
                if not (isinstance(sl, list) and len(sl) == 4 and isinstance(sl[0], str) and sl[1] in STATE_DTYPES
                        and isinstance(sl[2], list) and all(is_int(d) and d >= 0 for d in sl[2]) and is_int(sl[3])):
                    return (f"layer {l}, parameter {i}: {short(sl)} is not [key, dtype ({', '.join(STATE_DTYPES)}), "
                            "shape, offset]")
                key, dtype, shape, off = sl
                if key in ELEMENTWISE and tuple(shape) != tuple(params[i].shape):
                    return f"state {key!r} of parameter {i} has shape {shape}; the parameter is {list(params[i].shape)}"
                n = math.prod(shape) * STATE_DTYPES[dtype].itemsize   # Python ints: a huge shape cannot overflow
                if not 0 <= off <= nbytes - n:
                    return f"layer {l}, parameter {i}: state {short(key)} ({n} bytes at {off}) is outside its {nbytes} bytes"
                spans.append((off, off + n))
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return f"layer {l}: two slices of its state overlap"
    if total != size:
        return f"{BIN} has {size} bytes; the layers describe {total}"
    return None


def load(folder: str, meta: dict, optimizer: Any, tier: StateTier | None) -> None:
    """Streams a checkpoint's offloaded state a layer at a time: into this model's region where the layer is
    offloaded with the same layout, else into optimizer.state (RAM)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if tier is not None:
        tier.bind(optimizer)
        tier.reset()
    init = set(meta["initialized"])
    with open(os.path.join(folder, BIN), "rb") as f:
        for entry in meta["layers"]:
            l, nbytes = entry["layer"], entry["nbytes"]
            lay = tier.layouts.get(l) if tier is not None else None
            same = lay is not None and lay.nbytes == nbytes and lay.describe() == entry["params"]
            buf = tier.slots[0].buf if same else torch.empty(nbytes, dtype=torch.uint8)
            f.readinto(memoryview(buf[:nbytes].numpy()))
            if same:
                tier.store.write(tier.regions[l], buf[:nbytes])
                tier.initialized.update(i for i, _ in entry["params"] if i in init)
                continue
            for i, slices in entry["params"]:
                if i not in init:
                    continue
                state = optimizer.state[params[i]]
                for key, dtype, shape, off in slices:
                    dt = STATE_DTYPES[dtype]
                    n = torch.empty((), dtype=dt).element_size() * torch.Size(shape).numel()
                    state[key] = slice_view(buf, Slice(key, dt, tuple(shape), off, n)).clone()
