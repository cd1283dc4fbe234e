"""Host-resident training state, one record per layer.

For every parameter of layer l the host keeps:

    master    nn.Parameter of the user's module in master_dtype, fp32 or bf16 (what the
              optimizer updates; `p.grad` is the accumulated fp32 gradient it reads)
    upload    copy in compute_dtype that workers upload from (written only by the
              P-copy, so an optimizer step never tears a weight a worker is reading);
              a master already in compute_dtype is its own upload copy (see below)
    gbuf      landing buffer for downloaded gradients: the sum of every call's
              gradient since the last G-copy; a parameter that got no gradient
              (unused, off the autograd path) has none (`ghas`), so its `p.grad`
              stays None as in PyTorch.  Frozen parameters (requires_grad=False)
              have no landing buffer at all.
    held      the gradient the next step reads when it is not `p.grad`: see below.

Workers download a stage's gradients in the compute dtype (they accumulate its
microbatches in fp32 and round once).  A landing is adopted as it arrived (the
download's own host buffer, no copy); a sum of two or more landings is kept in
fp32.  The G-copy moves the sum into the gradient the step reads: an fp32 sum
becomes `p.grad` itself; a low-precision one (one download, bf16 or fp16) is
held as it is (`held`), read by the fused step directly, and turned into an
fp32 `p.grad` only when something else reads gradients (`materialize`: the
model's synchronize(), a torch optimizer's step).  So with a bf16 compute dtype
and rp AdamW a gradient costs 2 bytes per parameter, 4 while an asynchronous
step reads one call's gradients and the next call lands its own; `p.grad` costs
nothing until it is read.

Loss scaling (roundpipe/engine/step/loss_scale.py).  Landed gradients carry the loss
scale of their calls, and the step divides by it in its one pass.  But `p.grad`
shown to the user (synchronize()) must be the true gradient, so `materialize`
given the scale's fp32 reciprocal multiplies the layer's gradients by it, as
torch's GradScaler.unscale_ does, and records it (`inv_scale`): the G-copies
that follow (more calls of the same step, which use the same scale) add their
landings times it, and the step reads the layer's gradients as they are.  The
step's `clear_grads` forgets it.  A power-of-two scale makes every one of these
products exact, so the gradients a step reads are bitwise the same whether or
not they were looked at.

A stamp (requires_grad, version counter, storage address) of every master
taken at each P-copy lets a call find the masters the user changed since
(`edited`): an in-place edit under no_grad, `load_state_dict`, `p.data = ...`,
a freeze or unfreeze (not an in-place op on `p.data`, see `_stamp`).  A torch optimizer the
user steps (`loss.backward(); opt.step()` through a composed call) writes the masters in place;
its fused kernels (`torch.optim.AdamW(fused=True)` on CPU tensors, torch 2.13) bump no version
counter, so a global optimizer-step post hook (`watch_optimizer_steps`) bumps those of the masters
it stepped: the next call uploads the update instead of a stale upload copy.

Shared parameters (tied embeddings: the same tensor in the first and the last
layer, or any weight used by several layers).  The first layer holding the
tensor owns it; a later one holds an alias (`alias[j]` = (owner layer, index)).
Master and upload copy are one (the alias reads the owner's upload copy); each
occurrence gets its own landing buffer, since each layer's stage sends its own
gradient, and the alias's G-copy adds its sum into the owner's gradient
(`p.grad` or held), so the step reads the total and updates the master once,
with the owner's layer; an alias is never updated, copied or cleared itself.
The layers sharing a parameter form a group (`groups()`): the per-layer
protocol (roundpipe/engine/step/async_step.py) orders each layer's uploads, G-copies
and step against its whole group.

Buffers (BatchNorm running stats, ...) have no extra copy: forward stages
upload them with the parameters and write them back after the stage; they stay
in their own dtype, moved into arena blocks when wrapped (pinned uploads).

Constant buffers: a module may name buffers that no forward ever writes in a
class attribute `constant_buffers` (roundpipe.quant.QuantLinear: a 4-bit base
weight's packed bytes and statistics).  They are frozen state: one arena block
each, uploaded with the stage's parameters (prefetched, LPT windows), never
downloaded back and not in checkpoints (the model they came from holds them);
`LayerState.constants` / `written` split a layer's buffers by that.  host_bytes
counts them apart ("constant_buffers"; "quantized_numel": how many base weights
the 4-bit ones stand for).

Every host buffer of a model comes from `HostState.alloc(shape, dtype)`: the
upload copies and gradient landing buffers above, and the workers' staging
buffers (stage inputs kept for backward, downloaded activations, gradients
and buffers).  With the native core that is one HostArena per model, pinned
when the workers are GPUs (exact-size blocks, no power-of-two rounding, reuse
ordered by the copies' fences), plain memory for CPU workers; without it,
ordinary torch tensors (pinned when CUDA).  `close()` drops the state's own
buffers, so the arena's memory goes back once the last tensor viewing it is
gone.  `HostState.copy(dst, src)` does every host-side conversion.

Peak RSS with CPU workers.  Plain memory is resident where it was touched, so the
arena's plain chunks are 4 MiB (page-locked ones 64 MiB): the unused rest of the
last chunk, paged in or not from run to run, is then too small to matter.  A CPU
worker's "device" buffers are this process's heap memory; a RoundPipe whose CPU
workers have a device_memory cap (they model a GPU's memory) fixes glibc's mmap
threshold at 1 MiB for the process (roundpipe/engine/model.py, `fix_mmap_threshold`),
so that a freed stage buffer goes back to the system as a freed GPU buffer goes back
to the device.  With both the raw peak RSS grows by the accounted bytes
(`RoundPipe.memory_stats`) per added parameter within 0.2 (bench/memory.py --peak,
tests/engine/test_peak_rss.py).  Uncapped CPU workers (`roundpipe train --devices cpu`)
keep glibc's default: freed buffers are reused from the threads' heaps, as a GPU's
caching allocator reuses its blocks.

Masters in the compute dtype (fp32 masters with fp32 compute, CPU workers' default;
bf16 masters with bf16 compute) are their own upload copy: `p.data` is moved into an
arena block and the upload list holds the same tensor, so a trainable parameter
costs no copy beside its master.  The per-layer fused step then writes the upload
copy in its one pass as it updates the master, behind the same gate; a whole-model
update (a torch optimizer) waits for every layer's gate first (`in_place`).  bf16
masters (master_dtype=torch.bfloat16) are updated in fp32 by roundpipe.optim and
rounded back (roundpipe/optim/rounding.py).

Frozen parameters (requires_grad=False when wrapped: a LoRA model's base weights)
keep their dtype (no fp32 master) and have no landing buffer, no gradient and
no optimizer work; one already in the upload dtype is moved into its upload
copy (`p.data` then views it: one host copy, uploaded as it is).  Unfreezing
one that is not fp32 later is a ValueError: wrap after unfreezing.

A frozen parameter whose data maps a file (its loader set FILE_BACKED on it:
rp.hf.from_pretrained(base_in_ram=False), roundpipe/hf/mapped.py) is its own upload
copy as it is: no arena block, no copy, uploads read the page cache.  It must be
in the upload dtype already (a ValueError otherwise: converting it would copy it).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook

from roundpipe import _native, hostops
from roundpipe.optim.rounding import MASTER_DTYPES, ROUNDINGS
from roundpipe.testing import delay_point

# set to True on a frozen parameter whose data is a memory map of a file (roundpipe/hf/mapped.py)
FILE_BACKED = "roundpipe_file_backed"


def _stamp(p: torch.Tensor) -> tuple:
    """What an edit of a master changes: its version counter, storage, requires_grad.

    In-place ops through `.data` (`p.data.mul_()`) bump no version counter (`.data` is
    invisible to autograd by design), so they are not seen; `p.data = t` is.  Checking the
    values themselves would cost a full pass over the masters at every call."""
    return (p.requires_grad, p._version, p.data_ptr())


# every master of a HostState built so far, by id (a WeakSet would compare tensors with ==)
_MASTERS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_watch_lock = threading.Lock()
_watching = False


def _bump_stepped_masters(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """After any torch optimizer's step(): the version counters of the masters it may have written (those
    with a gradient), so that `edited` finds them whether or not its kernels bumped them (fused ones do
    not).  A step the engine runs itself takes its stamps after this, so it sees no edit."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None and _MASTERS.get(id(p)) is p]
    if stepped:
        increment_version(stepped)


def watch_optimizer_steps(params: list[torch.Tensor]) -> None:
    """Adds masters to those `_bump_stepped_masters` bumps; registers it (once per process)."""
    global _watching
    with _watch_lock:
        for p in params:
            _MASTERS[id(p)] = p
        if not _watching:
            register_optimizer_step_post_hook(_bump_stepped_masters)
            _watching = True


def allow_fp32_grad(p: torch.Tensor) -> None:
    """Lets a bf16 master hold the fp32 `p.grad` the engine gives every master (torch >= 2.10 checks a
    gradient's dtype against the tensor's `grad_dtype`, its own dtype by default; None allows any, so
    that a torch optimizer can be handed one in the master's dtype: optimizer_step.py)."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None


def make_arena(pinned: bool, device: int | None = None):
    """The model's HostArena (page-locked when pinned, in `device`'s context; plain memory in small
    chunks otherwise: roundpipe/offload/arena.py PLAIN_CHUNK_BYTES), or None without the native core
    or CUDA to pin."""
    if not _native.available():
        return None
    from roundpipe.offload import ArenaConfig, HostArena
    from roundpipe.offload.arena import PLAIN_CHUNK_BYTES
    try:
        if not pinned:
            return HostArena(ArenaConfig(chunk_bytes=PLAIN_CHUNK_BYTES, backend="host"))
        return HostArena(ArenaConfig(backend="cuda", home_device=device))
    except RuntimeError:   # CUDA runtime not loadable by the native core: torch's pinned memory instead
        return None


def default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src with dtype conversion; the native SIMD converter for contiguous host tensors."""
    src = src.detach()
    if (dst.is_contiguous() and src.is_contiguous() and dst.dtype in hostops.NATIVE_DTYPES
            and src.dtype in hostops.NATIVE_DTYPES and dst.device.type == "cpu" and src.device.type == "cpu"):
        hostops.convert_(dst, src)
    else:
        dst.copy_(src)


@dataclass
class LayerState:
    """Names, masters and host copies of one layer's parameters and buffers."""

    param_names: list[str]
    params: list[nn.Parameter]
    upload: list[torch.Tensor]
    gbuf: list[torch.Tensor | None]   # None for frozen parameters
    buffer_names: list[str]
    buffers: list[torch.Tensor]
    constant: list[bool] = field(default_factory=list)  # per buffer: never written by a forward (constant_buffers)
    trainable: list[int] = field(default_factory=list)  # indices of params with requires_grad
    ghas: list[bool] = field(default_factory=list)       # per param: gbuf holds a gradient
    held: list[torch.Tensor | None] = field(default_factory=list)    # per param: low-precision gradient for the step
    # the fp32 reciprocal of the loss scale its step gradients were multiplied by (they read as true gradients:
    # materialize for the user); None: they carry the scale of their calls, the step divides by it
    inv_scale: float | None = None
    stamp: list[tuple] = field(default_factory=list)     # per param: _stamp(p) at the last P-copy
    alias: list[tuple[int, int] | None] = field(default_factory=list)   # per param: its owner (layer, index)
    owned: list[int] = field(default_factory=list)       # indices of params that are not aliases

    @property
    def constants(self) -> list[torch.Tensor]:
        """The constant buffers, uploaded with the parameters and never downloaded."""
        return [b for b, c in zip(self.buffers, self.constant) if c]

    @property
    def written(self) -> list[int]:
        """Indices of the buffers a forward stage writes back (all but the constant ones)."""
        return [i for i, c in enumerate(self.constant) if not c]


def constant_buffer_flags(layer: nn.Module, buffer_names: list[str]) -> list[bool]:
    """Per buffer of `layer` (named as named_buffers() gives them): whether its module lists it in
    `constant_buffers`."""
    out = []
    for name in buffer_names:
        owner, _, leaf = name.rpartition(".")
        out.append(leaf in getattr(layer.get_submodule(owner) if owner else layer, "constant_buffers", ()))
    return out


class HostState:
    """Masters, upload copies and gradient landing buffers of all layers."""

    copy: Callable[[torch.Tensor, torch.Tensor], None] = staticmethod(default_copy)

    def __init__(self, layers: list[nn.Module], upload_dtype: torch.dtype, pinned: bool, device: int | None = None,
                 master_dtype: torch.dtype = torch.float32, master_rounding: str = "stochastic",
                 self_copy: bool = True):
        # self_copy False: every trained master keeps an upload copy of its own even in the upload dtype
        # (staleness compensation writes predicted weights there, never into the master)
        self.upload_dtype = upload_dtype
        # the user's master_dtype= / master_rounding= were checked by EngineConfig (roundpipe/engine/config.py)
        assert master_dtype in MASTER_DTYPES and master_rounding in ROUNDINGS, (master_dtype, master_rounding)
        self.master_dtype = master_dtype
        self.master_rounding = master_rounding
        self._grad_bytes = 0   # gradient bytes reserved in the arena (reserve_gradients)
        self.pinned = pinned
        # data_ptrs of the placeholders of masters on disk (roundpipe/offload/masters.py): no P-copy from them
        self.placeholders: set[int] = set()
        self.arena = make_arena(pinned, device)   # device: the GPU whose context page-locks the arena
        # this call's landings per (layer, param): None if it started the sum, else what it added
        self._landed: dict[tuple[int, int], list[torch.Tensor] | None] = {}
        seen: dict[int, tuple[int, int]] = {}   # id(master) -> (owner layer, index)
        self.layers: list[LayerState] = []
        # per layer, bumped whenever its upload copies may hold new values (resident weights, below):
        # `versions` at every stamp (a P-copy, a fused update, a refresh), `frozen_versions` only when the
        # user changed its masters (refresh: an edit, a freeze, a load), the one event that changes a frozen one
        self.versions: list[int] = []
        self.frozen_versions: list[int] = []
        self._groups: list[tuple[int, ...]] | None = None
        # base weights held 4-bit in constant buffers (QuantLinear.quantized_numel), for bytes per parameter
        self.quantized_numel = sum(getattr(m, "quantized_numel", 0) for layer in layers for m in layer.modules())
        for i, layer in enumerate(layers):
            names, params = zip(*layer.named_parameters()) if any(True for _ in layer.parameters()) else ((), ())
            for n, p in zip(names, params):
                if p.device.type != "cpu":
                    raise ValueError(f"layers: parameter {i}.{n} is on {p.device}; the model must be on the CPU "
                                     "(roundpipe keeps all weights in host memory)")
                if not p.is_floating_point():
                    raise TypeError(f"layers: parameter {i}.{n} has dtype {p.dtype}; only floating point is supported")
            bnames, bufs = zip(*layer.named_buffers()) if any(True for _ in layer.buffers()) else ((), ())
            for b in bufs:
                self._stage_buffer(b)
            state = LayerState(list(names), list(params), [], [], list(bnames), list(bufs),
                               constant_buffer_flags(layer, list(bnames)))
            for j, p in enumerate(params):
                owner = seen.get(id(p))
                state.alias.append(owner)
                state.gbuf.append(None)
                state.ghas.append(False)
                state.held.append(None)
                if owner is not None:   # shared with an earlier layer: its master and upload copy
                    state.upload.append(self.layers[owner[0]].upload[owner[1]])
                    continue
                seen[id(p)] = (i, j)
                state.owned.append(j)
                if p.dtype != self.master_dtype and p.requires_grad:
                    # masters in master_dtype; converted in place so the user's module stays the master.
                    p.data = p.data.to(self.master_dtype)
                if p.dtype != torch.float32 and p.requires_grad:
                    allow_fp32_grad(p)
                dtype = upload_dtype if p.is_floating_point() else p.dtype
                if getattr(p, FILE_BACKED, False) is True and not p.requires_grad:
                    if p.dtype != dtype or not p.is_contiguous():
                        raise ValueError(f"layers: parameter {i}.{names[j]} maps its file in {p.dtype}, but the upload "
                                         f"dtype is {dtype}; a mapped frozen weight is uploaded as stored: use "
                                         f"compute_dtype={p.dtype}, or load it into RAM")
                    state.upload.append(p.data)   # file-backed: its own upload copy, read from the page cache
                    continue
                u = self.alloc(p.shape, dtype)
                self.copy(u, p.data)
                if p.dtype == dtype and (self_copy or not p.requires_grad):
                    p.data = u   # already in the upload dtype: the upload copy is the master, one copy
                state.upload.append(u)
            self._set_trainable(state)
            watch_optimizer_steps([state.params[j] for j in state.owned])
            state.stamp = [_stamp(p) for p in state.params]
            self.layers.append(state)
            self.versions.append(0)
            self.frozen_versions.append(0)

    def __len__(self) -> int:
        return len(self.layers)

    def groups(self) -> list[tuple[int, ...]]:
        """Per layer, the layers joined to it by shared parameters (transitively), itself included."""
        parent = list(range(len(self.layers)))

        def root(l: int) -> int:
            while parent[l] != l:
                l = parent[l]
            return l
        for l, st in enumerate(self.layers):
            for owner in st.alias:
                if owner is not None:
                    parent[root(l)] = root(owner[0])
        members: dict[int, list[int]] = {}
        for l in range(len(self.layers)):
            members.setdefault(root(l), []).append(l)
        return [tuple(members[root(l)]) for l in range(len(self.layers))]

    def upload_keys(self, layer: int) -> list[tuple]:
        """Per tensor a stage uploads for the layer (its upload copies, then its constant buffers), what
        its host values depend on: equal keys, equal values (roundpipe/engine/calls/resident.py).  A
        trained parameter's key moves at every stamp of its layer's group (a shared weight is written
        by its owner's step), a frozen one's and a constant buffer's only when the user changed masters."""
        if self._groups is None:
            self._groups = self.groups()
        group = self._groups[layer]
        trained = ("t", *(self.versions[k] for k in group))
        frozen = ("f", *(self.frozen_versions[k] for k in group))
        st = self.layers[layer]
        return [trained if p.requires_grad else frozen for p in st.params] + [frozen] * len(st.constants)

    def alloc(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous host tensor: from the arena, else torch (pinned when CUDA)."""
        if self.arena is not None:
            return self.arena.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def reserve_gradients(self, sets: int = 1, reduced: bool = False) -> int:
        """Grows the arena, before the calls that land them, to room for `sets` gradient buffers of
        every trainable parameter in the compute dtype, so that landings on the copy threads are
        carved from it instead of growing the arena mid-iteration: one set (the landing set) before
        the first training call, a second one (the set a pending asynchronous step holds) before the
        first asynchronous step; synchronous training never reserves it.  `reduced` (data
        parallelism): one fp32 set more, the averages the reduction writes beside the landing set
        (DataParallel.reduce_landed); without it the arena grew during the reductions, on the G-copy
        thread, by 0 to 2.3 bytes per parameter from run to run (2 ranks, 28.7M parameters,
        bench/ddp.py --memory; with it: 8.0 synchronous, 10.0 asynchronous, every run).
        Returns the bytes added (0: no arena, already reserved, or the arena's free space covers them)."""
        if self.arena is None:
            return 0
        align = self.arena.config.alignment
        item = torch.empty((), dtype=self.upload_dtype).element_size()   # gradients travel in it
        numels = [st.params[j].numel() for st in self.layers for j in st.trainable]
        target = sum(sets * -(-n * item // align) * align + (-(-n * 4 // align) * align if reduced else 0)
                     for n in numels)
        if target <= self._grad_bytes:
            return 0
        need = target - self._grad_bytes
        if self._grad_bytes == 0:
            need -= self.arena.stats().free_bytes
        self._grad_bytes = target
        if need <= 0:
            return 0
        self.arena.reserve(need)
        return need

    def in_place(self) -> bool:
        """Whether a trained master is its own upload copy (a whole-model update must then wait for
        every layer's gate before writing it)."""
        return any(st.upload[j].data_ptr() == st.params[j].data_ptr() and st.params[j].requires_grad
                   for st in self.layers for j in st.owned)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether t is a block of this state's arena (without an arena, pinned memory on CUDA,
        any memory on CPU: there is no arena to stage through)."""
        if self.arena is not None:
            return self.arena.owns(t)
        return t.is_pinned() if self.pinned else True

    def _stage_buffer(self, b: torch.Tensor) -> None:
        """Moves a module buffer into an arena block (`b.data`: the module and every reference keep the
        same tensor), so that workers upload it from pinned memory: a copy from pageable memory makes
        the CUDA copy synchronous (issue 26 part 2, item 6).  Once per buffer, at wrap time; one the
        user replaces later is staged by the worker at each upload (Worker._staged)."""
        if b.device.type == "cpu" and not (b.is_contiguous() and self.owns(b)):
            u = self.alloc(b.shape, b.dtype)
            u.copy_(b)
            b.data = u

    def staged(self, t: object, snapshot: Callable[[torch.Tensor], torch.Tensor] | None = None) -> object:
        """A copy of a host tensor in this state's (pinned) memory; a device tensor through `snapshot`
        when given (a training call's device-side copy of its GPU inputs: roundpipe/workers/base.py
        `gpu_input_snapshots`), else unchanged; anything else unchanged."""
        if isinstance(t, torch.Tensor) and t.device.type != "cpu" and snapshot is not None:
            return snapshot(t)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        out = self.alloc(t.shape, t.dtype)
        out.copy_(t)
        return out

    def close(self) -> None:
        """Drops the upload copies and landing buffers; their arena blocks return once unreferenced."""
        for st in self.layers:
            st.upload.clear()
            st.gbuf.clear()
            st.held.clear()
        self.arena = None

    def _set_trainable(self, st: LayerState) -> None:
        """The parameters that require grad now; frozen ones lose their landing buffers."""
        st.trainable = [j for j, p in enumerate(st.params) if p.requires_grad]
        for j, p in enumerate(st.params):
            if not p.requires_grad:
                st.gbuf[j] = st.held[j] = None
                st.ghas[j] = False

    def edited(self, layer: int) -> bool:
        """Whether a master of the layer changed (or was frozen/unfrozen) since its last P-copy."""
        st = self.layers[layer]
        return any(_stamp(p) != s for p, s in zip(st.params, st.stamp))

    def host_bytes(self) -> dict[str, int]:
        """Host bytes of the training state by kind (the masters' own bytes included)."""
        def total(get) -> int:   # a shared master (and its upload copy) counted once
            unique = {id(t): t for st in self.layers for t in get(st) if t is not None}
            return sum(t.nbytes for t in unique.values())
        masters = {p.data_ptr() for st in self.layers for p in st.params}   # a frozen master may be its upload copy
        out = {"masters": total(lambda st: [p for p in st.params if p.data_ptr() not in self.placeholders]),
               # masters that are their own upload copies: arena blocks, inside arena_reserved too
               "masters_in_arena": total(lambda st: [p for p in st.params if self.owns(p)] if self.arena else []),
               "upload_copies": total(lambda st: [u for u in st.upload if u.data_ptr() not in masters]),
               "grad_landing": total(lambda st: st.gbuf), "grads_held": total(lambda st: st.held),
               "grads": total(lambda st: [p.grad for p in st.params]),
               "buffers": total(lambda st: [st.buffers[i] for i in st.written]),
               "constant_buffers": total(lambda st: st.constants)}
        out["quantized_numel"] = self.quantized_numel
        if self.arena is not None:
            a = self.arena.stats()
            out["arena_reserved"], out["arena_in_use"] = a.reserved_bytes, a.in_use_bytes
        return out

    def freezes_changed(self, layer: int) -> bool:
        """Whether a parameter of the layer was frozen or unfrozen since the landing buffers were set."""
        st = self.layers[layer]
        return st.trainable != [j for j, p in enumerate(st.params) if p.requires_grad]

    def refresh(self, layer: int) -> None:
        """After the user changed masters: checks them, follows freezes, rewrites the upload copy."""
        st = self.layers[layer]
        for j, (p, u) in enumerate(zip(st.params, st.upload)):
            if p.shape != u.shape or (p.dtype != self.master_dtype and p.requires_grad) or p.device.type != "cpu":
                raise ValueError(f"parameter {st.param_names[j]} of layer {layer} is now a {p.dtype} tensor of shape "
                                 f"{tuple(p.shape)} on {p.device} (requires_grad={p.requires_grad}); after wrapping, "
                                 f"a master may change its values only (it must stay on the CPU, of shape "
                                 f"{tuple(u.shape)}, and {self.master_dtype} (master_dtype) when trained: a frozen "
                                 f"{p.dtype} parameter cannot be unfrozen after wrapping; unfreeze it before)")
        self.frozen_versions[layer] += 1   # frozen weights may have changed too (resident copies are stale)
        self._set_trainable(st)
        for j in st.trainable:
            if st.params[j].dtype != torch.float32:
                allow_fp32_grad(st.params[j])
        self.pcopy(layer)
        for j in st.owned:   # a master replaced in the upload dtype (p.data = t) becomes its upload copy again
            p, u = st.params[j], st.upload[j]
            if p.dtype == u.dtype and p.data_ptr() != u.data_ptr():
                p.data = u
        self.stamp(layer)

    def pcopy(self, layer: int) -> None:
        """P-copy: new fp32 master weights -> upload copy of one layer."""
        delay_point("pcopy")
        st = self.layers[layer]
        for j in st.owned:   # an alias's upload copy is its owner's
            ptr = st.params[j].data_ptr()
            if st.upload[j].data_ptr() != ptr and ptr not in self.placeholders:   # own upload copy; on disk
                self.copy(st.upload[j], st.params[j].data)
        self.stamp(layer)

    def stamp(self, layer: int) -> None:
        """Records the masters as the upload copy now holds them (after any P-copy or fused update)."""
        st = self.layers[layer]
        st.stamp = [_stamp(p) for p in st.params]
        self.versions[layer] += 1

    def gcopy(self, layer: int) -> None:
        """G-copy: landed gradients of one layer -> the gradient the step reads (accumulating).

        Where the layer has no gradient yet the landing sum itself becomes it (no copy): `p.grad`
        when fp32, else `held`; otherwise it is added in (a held gradient turns fp32 first).  An
        alias's sum goes into its owner's gradient."""
        delay_point("gcopy")
        st = self.layers[layer]
        for j in st.trainable:
            if not st.ghas[j]:
                continue
            g = st.gbuf[j]
            st.gbuf[j], st.ghas[j] = None, False
            owner = st.alias[j]
            ost, k = (st, j) if owner is None else (self.layers[owner[0]], owner[1])
            p = ost.params[k]
            if ost.inv_scale is not None:   # shown unscaled (materialize): the landing joins it unscaled
                if p.grad is None:
                    p.grad = self._unscaled(g, ost.inv_scale)
                else:   # inv_scale * g is exact for a power-of-two scale: as if unscaled after the sum
                    p.grad.add_(g, alpha=ost.inv_scale)
                continue
            if p.grad is not None:
                p.grad.add_(g)
            elif ost.held[k] is not None:
                ost.held[k] = self._fp32_sum(ost.held[k], g)
            elif g.dtype == torch.float32:
                p.grad = g
            else:
                ost.held[k] = g
            if ost.held[k] is not None and ost.held[k].dtype == torch.float32:
                p.grad, ost.held[k] = ost.held[k], None

    def _unscaled(self, g: torch.Tensor, inv_scale: float) -> torch.Tensor:
        """g * inv_scale in fp32: in place when g is an fp32 landing sum, else in a new fp32 buffer."""
        if g.dtype != torch.float32:
            out = self.alloc(g.shape, torch.float32)
            self.copy(out, g)
            g = out
        return g.mul_(inv_scale)

    def _fp32_sum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b in fp32: in place when a is fp32, else in a new fp32 buffer."""
        if a.dtype != torch.float32:
            out = self.alloc(a.shape, torch.float32)
            self.copy(out, a)
            a = out
        return a.add_(b)

    def step_grads(self, layer: int) -> list[torch.Tensor | None]:
        """Per parameter the layer owns (`step_params`), the gradient a step reads: p.grad, else the held
        one, else None."""
        st = self.layers[layer]
        return [st.params[j].grad if st.params[j].grad is not None else st.held[j] for j in st.owned]

    def step_params(self, layer: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor | None]]:
        """The masters a step of the layer updates and their upload copies (None: the master is its
        own): all but its aliases."""
        st = self.layers[layer]
        return ([st.params[j] for j in st.owned],
                [None if st.upload[j].data_ptr() == st.params[j].data_ptr() else st.upload[j] for j in st.owned])

    def materialize(self, layer: int, inv_scale: float | None = None) -> None:
        """Held low-precision gradients of the layer -> fp32 `p.grad` (for readers of p.grad).

        inv_scale: the fp32 reciprocal of the loss scale the layer's gradients carry; every
        gradient of the layer is then multiplied by it (GradScaler.unscale_'s arithmetic) unless
        it already was, and later G-copies add theirs unscaled too, until the step clears them."""
        if inv_scale is not None and (isinstance(inv_scale, bool) or not isinstance(inv_scale, float)
                                      or not 0 < inv_scale < float("inf")):
            raise ValueError(f"materialize: inv_scale={inv_scale!r} must be None or a finite float > 0 (the "
                             "reciprocal of a loss scale)")
        st = self.layers[layer]
        unscale = inv_scale is not None and st.inv_scale is None
        for j in st.owned:   # an alias's p.grad is its owner's
            p, h = st.params[j], st.held[j]
            if h is not None:
                p.grad, st.held[j] = h.float(), None
            if unscale and p.grad is not None:
                p.grad.mul_(inv_scale)
        if unscale:
            st.inv_scale = inv_scale

    def land_grads(self, layer: int, grads: list[torch.Tensor | None]) -> None:
        """Adds one stage's downloaded gradients to the layer's landing sums (None: no gradient).

        A first landing is adopted as it is (the caller hands over the download's buffers); a
        second one makes the sum fp32.  Each landing is logged until the call ends (`end_call`),
        so that a failed call can take its gradients out again: a first landing is dropped
        exactly; one added to an earlier call's sum still waiting for its G-copy (gradient
        accumulation while the previous step is pending) is subtracted, exact up to fp32
        rounding."""
        st = self.layers[layer]
        for j, g in zip(st.trainable, grads):
            if g is None:
                continue
            if g.shape != st.params[j].shape or g.device.type != "cpu" or not g.is_floating_point():
                raise ValueError(f"gradient of {st.param_names[j]} (layer {layer}): a {g.dtype} tensor of shape "
                                 f"{tuple(g.shape)} on {g.device}, expected a floating host tensor of shape "
                                 f"{tuple(st.params[j].shape)}")
            log = self._landed.get((layer, j), ())
            if st.ghas[j]:
                st.gbuf[j] = self._fp32_sum(st.gbuf[j], g)
                if log is not None:   # the sum predates this call: keep what to subtract
                    self._landed[(layer, j)] = [*log, g]
            else:
                st.gbuf[j], st.ghas[j] = g, True
                self._landed[(layer, j)] = None   # this call started the sum: dropped whole

    def end_call(self, ok: bool) -> None:
        """Keeps (ok) or takes back the gradients the call landed; the workers have stopped."""
        if not ok:
            for (layer, j), log in self._landed.items():
                st = self.layers[layer]
                if log is None:
                    st.ghas[j], st.gbuf[j] = False, None
                else:
                    for g in log:
                        st.gbuf[j].sub_(g)
        self._landed = {}

    def clear_grads(self, layer: int) -> None:
        """After a step read them: p.grad = None and the held gradients dropped (an alias's by its owner);
        the next gradients carry their calls' loss scale again."""
        st = self.layers[layer]
        st.inv_scale = None
        for j in st.owned:
            st.params[j].grad = None
            st.held[j] = None
