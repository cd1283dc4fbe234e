"""The ring of read-ahead slots a step streams the offloaded layers' state through (StateTier's step side).

`StateTier` (state_tier.py) derives from `StateRing`: its placement makes the ring (`slots`
buffers, each [state | masters] as large as the largest offloaded layer's) and the regions;
here is what a step does with them.  Per offloaded layer, tail first as the gates open
(state_tier.py draws the timeline), a slot goes through

    kind     holds                                         enters by          leaves by
    free     nothing (layer None)                          _free              _load
    read     layer l, its reads in flight                  _load              _take (waits), _drop
    ready    layer l, nothing to read or a kept buffer     _load              _take, _drop
    busy     layer l: the update runs on views of it       _take              _pack_and_write, _free (it raised)
    write    layer l's new state, being written behind     _pack_and_write    _retire_write

`_take(l)` waits for layer l's slot (loading it then if no read ahead did), then reads the
next layers below l ahead into free slots (`_prefetch`); a slot whose write is done is free
again.  When every slot is taken a write is waited for, else a layer read ahead out of order
(a gate opened early) gives its slot up.  After a step's last offloaded layer its writes are
waited for and the next step's first layers read ahead.

Failures (the contract: state_tier.py's "Failure semantics"):
  - a failed read: `_take` frees the slot, waits for the earlier layers' writes and raises;
    that layer's update never runs.
  - a failed write: the slot is `kept` (its buffer is the layer's only up-to-date state);
    freeing it moves the buffer to `resident` and gives the slot a fresh one, and the
    layer's next `_load` takes that buffer instead of reading the region the failed write
    left unreadable.  The error waits in `error`; `_raise_pending` raises it at the next
    step's start or a sync point (settle, quiesce, close).
"""
from __future__ import annotations

from typing import Any

import torch

from roundpipe.offload.masters import view as master_view
from roundpipe.offload.state_layout import slice_view

TRIM_BYTES = 1 << 20


def trim_heap() -> None:
    """Hands freed heap memory back to the kernel (glibc malloc_trim).  The first step's fresh state
    tensors are freed once copied into the ring, but glibc raises its mmap threshold after freeing
    large chunks and keeps later ones on the heap: measured (bench/nvme_train.py, 8 x Linear(2048),
    AdamW) the peak RSS stayed at the in-RAM run's without this."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Slot:
    """A ring buffer: free (layer None), or holding layer's state being read / ready / in use / written.

    kept: buf is the layer's state after a failed write (taken from StateTier.resident), its only copy until a
    write of it succeeds; giving the slot up (_free) hands it back to `resident`, never drops it."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.layer, self.kind, self.fence, self.kept = buf, None, "free", None, False


class StateRing:
    """The step side of `StateTier` (see the module docstring).  The attributes read here are the ones
    StateTier makes (__init__ and bind): host, optimizer, _params, store, slots, layouts, regions,
    master_layouts, master_regions, master_base, placeholders, initialized, resident, error, _cached, _lock;
    and wrap() binds the optimizer with StateTier.bind."""

    # ---- the step ------------------------------------------------------------------------------------
    def wrap(self, fns: Any, optimizer: Any) -> Any:
        """The step's StepFns with every offloaded layer's state read ahead, installed, written behind."""
        self.bind(optimizer)
        if not self.layouts:
            return fns
        inner = fns.update
        started, done = [False], set()

        def update(l: int) -> None:
            with self._lock:
                if not started[0]:
                    started[0] = True
                    self._settle_writes()
                    self._raise_pending()
            if l not in self.layouts:
                return inner(l)
            slot = self._take(l)
            installed, masters = self._install(l, slot)
            try:
                inner(l)
            except BaseException:
                self._uninstall(installed)
                for p, before in masters:
                    p.data = before
                with self._lock:
                    self._free(slot)   # the state on disk (or kept in RAM) is still the one before the step
                raise
            self._pack_and_write(l, slot)
            done.add(l)
            if len(done) == len(self.layouts):   # the step's last offloaded layer: settle, read the next step's first
                with self._lock:
                    self._settle_writes()
                    self._prefetch({s.layer for s in self.slots if s.layer is not None})
        fns.update = update
        fns.update_many = None   # one layer at a time: each offloaded layer's state is installed around its update
        return fns

    def _order(self, skip: set[int]) -> list[int]:
        return sorted((l for l in self.layouts if l not in skip), reverse=True)   # tail first, as gates open

    def _needs_read(self, l: int) -> bool:
        return any(i in self.initialized for i, _ in self.layouts[l].params)

    def _load(self, l: int, slot: Slot) -> None:
        slot.layer = l
        if l in self.resident:   # its state after a failed write: the buffer becomes the slot's, kept
            slot.buf, slot.kind, slot.fence, slot.kept = self.resident.pop(l), "ready", None, True
        else:
            fences = []
            if self._needs_read(l):
                region = self.regions[l]
                fences.append(self.store.read_async(region, slot.buf[:region.nbytes]))
            if l in self.master_regions:
                region, base = self.master_regions[l], self.master_base
                fences.append(self.store.read_async(region, slot.buf[base:base + region.nbytes]))
                self._cached = None
            slot.kind, slot.fence = ("read", fences) if fences else ("ready", None)

    def _free_slot(self, wait: bool) -> Slot | None:
        for s in self.slots:
            if s.kind == "free":
                return s
        for s in self.slots:
            if s.kind == "write" and all(f.state != "pending" for f in s.fence):
                self._retire_write(s)
                return s
        if not wait:
            return None
        for s in self.slots:
            if s.kind == "write":
                self._retire_write(s)
                return s
        for s in self.slots:   # a layer read ahead out of order: give its slot up (a kept one goes back to RAM)
            if s.kind in ("read", "ready"):
                self._drop(s)
                return s
        raise AssertionError("every ring slot is in use")

    def _drop(self, s: Slot) -> None:
        if s.kind == "read":
            try:
                self.store.wait(*s.fence)
            except OSError:
                pass   # a failed read ahead that nobody needs
        self._free(s)

    def _retire_write(self, s: Slot) -> None:
        """Waits for the slot's write; a failure keeps the slot's state (the layer's newest) in RAM."""
        try:
            self.store.wait(*s.fence)
        except OSError as e:
            s.kept = True
            self.error = self.error or e
        self._free(s)

    def _free(self, s: Slot) -> None:
        """The slot free; a kept buffer (a layer's state whose write failed) goes back to `resident` first, so the
        layer's next load takes it instead of reading its region (which the failed write left unreadable)."""
        if s.kept:
            self.resident[s.layer] = s.buf
            s.buf = self.store.empty(s.buf.nbytes)
        s.layer, s.kind, s.fence, s.kept = None, "free", None, False

    def _take(self, l: int) -> Slot:
        with self._lock:
            slot = next((s for s in self.slots if s.layer == l and s.kind in ("read", "ready")), None)
            if slot is None:
                slot = self._free_slot(wait=True)
                self._load(l, slot)
            if slot.kind == "read":
                try:
                    self.store.wait(*slot.fence)
                except OSError:
                    self._free(slot)
                    self._settle_writes()   # the layers updated before this one: their state on disk
                    raise
            slot.kind, slot.fence = "busy", None
            self._prefetch({l} | {s.layer for s in self.slots if s.layer is not None}, after=l)
            return slot

    def _prefetch(self, skip: set[int], after: int | None = None) -> None:
        """Reads the next layers of the step order (below `after`, or from the top) into free slots."""
        for l in self._order(skip):
            if after is not None and l >= after:
                continue
            s = self._free_slot(wait=False)
            if s is None:
                return
            self._load(l, s)

    def _install(self, l: int, slot: Slot) -> tuple[list[tuple[dict, str]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """state[p][key] = a view of the slot, for the layer's parameters whose state is on disk; p.data = a view of
        the slot's master part for those whose master is (a master the user replaced since is copied in first:
        it wins).  Returns what to undo: the state keys, and (p, its data before)."""
        masters = []
        if l in self.master_layouts:
            st, buf = self.host.layers[l], slot.buf[self.master_base:]
            for j, off, n in self.master_layouts[l].params:
                p = st.params[j]
                v, before = master_view(buf, p, off, n), p.data
                if before.data_ptr() != self.placeholders[l, j].data_ptr():
                    v.copy_(before)
                p.data = v
                masters.append((p, before))
        installed = []
        for i, slices in self.layouts[l].params:
            if i not in self.initialized:
                continue
            state = self.optimizer.state[self._params[i]]
            if any(s.key in state for s in slices):   # loaded into the optimizer since (load_state_dict): it wins
                continue
            for s in slices:
                state[s.key] = slice_view(slot.buf, s)
                installed.append((state, s.key))
        return installed, masters

    @staticmethod
    def _uninstall(installed: list[tuple[dict, str]]) -> None:
        for state, key in installed:
            state.pop(key, None)

    def _pack_and_write(self, l: int, slot: Slot) -> None:
        """The layer's state after its update -> the slot (copied where the optimizer made new tensors), out of
        optimizer.state, and the slot written behind."""
        copied = 0
        for i, slices in self.layouts[l].params:
            state = self.optimizer.state.get(self._params[i])
            if not state or not any(s.key in state for s in slices):
                continue
            for s in slices:
                t = state.pop(s.key)
                v = slice_view(slot.buf, s)
                assert t.dtype == s.dtype and tuple(t.shape) == s.shape, (l, i, s, t.dtype, t.shape)
                if t.data_ptr() != v.data_ptr():
                    v.copy_(t)
                    copied += t.nbytes
                del t
            self.initialized.add(i)
        if l in self.master_layouts:   # the masters back to their placeholders, as the upload copies now hold them
            st = self.host.layers[l]
            for j, _, _ in self.master_layouts[l].params:
                st.params[j].data = self.placeholders[l, j]
            self.host.stamp(l)
        if copied >= TRIM_BYTES:   # state the optimizer made in RAM (a first step, a loaded state dict), now freed
            trim_heap()
        with self._lock:
            region = self.regions[l]
            fences = [self.store.write_async(region, slot.buf[:region.nbytes])]
            if l in self.master_regions:
                region, base = self.master_regions[l], self.master_base
                fences.append(self.store.write_async(region, slot.buf[base:base + region.nbytes]))
            slot.kind, slot.fence, slot.kept = "write", fences, False   # its retirement keeps it again if this fails

    def _settle_writes(self) -> None:
        for s in self.slots:
            if s.kind == "write":
                self._retire_write(s)

    def _raise_pending(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e

