"""Checkpoints that resume bit for bit, in synchronous and asynchronous mode.

    model.save_checkpoint("ckpt/step-1000", optimizer, lr_scheduler)
    ...                                             # a new process, a fresh model
    model.load_checkpoint("ckpt/step-1000", optimizer, lr_scheduler)

A checkpoint is a directory:

    checkpoint.json       format and version, every file's size, the engine's counters, the
                          pending step, the loss scaler, the plan (for inspection), and a
                          fingerprint of each base tensor left out (`constants`, below)
    model.safetensors     the masters and buffers under the model's own names (state_dict);
                          a tensor shared by several names is stored once (metadata `aliases`);
                          the base the run was wrapped over is not (a 4-bit base's packed weights,
                          weights left in their files): the model holds it, loading leaves it
    engine.safetensors    gradients not yet applied: what the next step reads (`p.grad`, or a
                          held low-precision one, in its dtype) and the landing sums not yet
                          moved into it; the caller's CPU (and CUDA) RNG state.  Saved as
                          they are: with fp16 loss scaling the step's gradients are unscaled
                          where synchronize() showed them (`grads_unscaled` in checkpoint.json:
                          per layer the factor they were multiplied by, or null), so a resume
                          re-multiplies nothing and stays bitwise
    upload.safetensors    what workers read when it is not the masters rounded (compute dtype):
                          staleness compensation's predicted weights, or the old weights the
                          calls of a stale window read after a whole-model update already ran
    optimizer.pt, lr_scheduler.pt   their state_dict()s (torch.save)
    optimizer_offload.bin/.json     with offload_dir=: the offloaded layers' optimizer state, copied a
                          layer at a time from their files through one ring buffer (bounded RAM), and its
                          layout; loading streams it back (roundpipe/offload/state_tier.py)

What the asynchronous step leaves open (docs/async_step.md).  After `step(opt)`
with `asynchronous=True` the next calls still read the weights before that step,
and the step updates each layer only once they have begun.  Saving then waits
for everything that can finish (calls in flight, G-copies, earlier steps) but
neither closes the window nor issues anything, so the trajectory of the run
that saved is unchanged; the step stays pending and the checkpoint records it
with the state it will read: the masters and optimizer state before it, its
gradients, its `max_grad_norm` and how many calls still read the old weights.
Loading re-issues it with the optimizer and scheduler given, so the resumed
run goes on exactly as the saving one did.  With a torch optimizer (one pass
over every layer, run as soon as the gradients are in) the update may already
have happened: the masters and optimizer state are then after it, and the old
weights the window's calls read are saved beside them (upload.safetensors).

The RNG: each call draws its dropout seed from the caller's CPU generator
(roundpipe/workers/rng.py), and the workers' generators are reseeded per
layer from it, so the caller's generator state is the only random state the
engine depends on; it is saved and restored (loading sets it).

The base is left out but fingerprinted (base_tensors.py): loading into a model over
another base is a ValueError naming the layer and the tensor.

Files are written to a temporary directory beside the target and renamed into
place; loading checks every file's size against the manifest, every tensor's
name, shape and dtype against the model, and the format version before it
changes anything, with a ValueError naming the file and the mismatch.  A save
killed mid-way leaves its temporary directory: the next save or load of the
path removes it once its writer is dead (save_folders.py, clean_crashed).  Checkpoints
may come from elsewhere: the manifest's fields are type-checked, its files must
be regular files inside the directory, the tensor files' headers are checked
against their real sizes before anything is allocated (tensor_file.py), and
the RNG state, the aliases and the optimizer's and scheduler's own
load_state_dict are tried before the model changes (manifest.py checks the manifest and
the files it lists, load_checks.py the rest).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.engine.state import load_checks, tensor_file
from roundpipe.engine.state.base_tensors import check_constants, constants, left_out
from roundpipe.engine.state.manifest import FORMAT, MANIFEST, VERSION, read_manifest
from roundpipe.engine.state.save_folders import clean_crashed, discard, replace, write_owner
from roundpipe.engine.state.tensor_file import TensorFile
from roundpipe.offload import state_tier

if TYPE_CHECKING:
    from roundpipe.engine.step.async_step import StepRecord

# The model as a checkpoint sees it (roundpipe.engine.model.RoundPipe; not imported: the model imports
# this module): .host, .sync, .devices, .offload, .run_state (engine/state/run_state.py), named_state(),
# reissue_step(), state_dict() and load_state_dict().
RoundPipe = Any



def _saved_state(model: "RoundPipe") -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds: the model's named state but its base (base_tensors.py)."""
    out = left_out(model)
    return {name: t for name, t in model.named_state().items() if id(t) not in out}


def _unique_state(model: "RoundPipe") -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """The saved state with each shared tensor once: (name, tensor) pairs and alias -> name."""
    first: dict[tuple, str] = {}
    items, aliases = [], {}
    for name, t in _saved_state(model).items():
        t = t.detach()
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        items.append((name, t))
    return items, aliases


def _save_obj(obj: Any, path: str) -> int:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def save(model: "RoundPipe", path: str, pending: "StepRecord | None", optimizer: Any, lr_scheduler: Any,
         extra: dict | None = None) -> None:
    """Writes the checkpoint of a settled model (LayerSync.wait_settled); `pending` is its open step."""
    path = checked_path(path, "save_checkpoint")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict or None, got {type(extra).__name__}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: extra must be JSON-serialisable ({e})") from None
    info = model.run_state.step_info
    step = None
    if pending is not None:
        if optimizer is None:
            raise ValueError("save_checkpoint: a step is pending (asynchronous, its stale window still open) and "
                             "optimizer is None; pass the optimizer given to step(), so that the checkpoint holds "
                             "its state, or call synchronize() before saving")
        if optimizer is not info["optimizer"]:
            raise ValueError("save_checkpoint: optimizer is not the one the pending step uses; pass the optimizer "
                             "given to the last step()")
        if info["lr_scheduler"] is not None and lr_scheduler is not info["lr_scheduler"]:
            raise ValueError("save_checkpoint: the pending step steps an lr_scheduler that was not passed; pass the "
                             "lr_scheduler given to the last step()")
        step = {"kind": "copy" if pending.whole else "update", "window": pending.readers_left,
                "max_grad_norm": info["max_grad_norm"], "scale_used": info["scale_used"] - pending.index,
                "skipped": model.scaler is not None and pending.index in model.scaler.skipped,
                "predict": info["predict"], "lr_factor": info["lr_factor"]}
    for name, obj in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if obj is not None and not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"save_checkpoint: {name} has no state_dict() (a {type(obj).__name__}); pass a torch "
                            f"optimizer / lr scheduler or a roundpipe.optim one, or None")
    dp = model.dp
    rank, world = (dp.rank, dp.world) if dp is not None else (0, 1)
    parent = os.path.dirname(os.path.abspath(path))
    # ranks write into one temporary directory (on a filesystem they all see), rank 0 renames it
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp" + (f"-{os.getpid()}" if world == 1 else ""))
    error: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            clean_crashed(path)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            write_owner(tmp)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            error = e
    if dp is not None:
        dp.barrier()
    sizes: dict[str, int] = {}
    try:
        if error is None:
            sizes = _write_files(model, tmp, step, optimizer, lr_scheduler, rank, world)
    except BaseException as e:  # noqa: BLE001
        error = e
    if not (dp.all_true(error is None) if dp is not None else error is None):
        if rank == 0:
            discard(tmp, path)
        if error is not None:
            raise error
        raise RuntimeError(f"save_checkpoint: another rank failed to write its part of {path!r}; nothing was saved")
    try:
        if rank == 0:
            for r in range(1, world):
                for name in rank_files(r, world, model.shards is not None and optimizer is not None):
                    sizes[name] = os.path.getsize(os.path.join(tmp, name))
            manifest = {"format": FORMAT, "version": VERSION, "files": sizes, "world_size": world,
                        "num_layers": len(model.host), "compute_dtype": str(model.compute_dtype),
                        "master_dtype": str(model.host.master_dtype),
                        "calls": model.run_state.counted[0] + model.sync.iteration,
                        "steps": model.run_state.counted[1] + model.sync.steps_issued, "extra": extra or {},
                        "calls_since_step": model.sync.calls_since_step, "grads_pending": model.run_state.grads_pending,
                        "pending_step": step, "loss_scale": _scaler_state(model, pending),
                        "grads_unscaled": [st.inv_scale for st in model.host.layers],
                        "latest_asynchronous": model.run_state.latest_asynchronous, "constants": constants(model),
                        "whole_batch": _whole(model.autoplan.whole_decision),
                        "plan": {"forward": [[r.start, r.stop] for r in model.plan.forward],
                                 "backward": [[r.start, r.stop] for r in model.plan.backward]}}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            replace(tmp, path)
    except BaseException:
        if rank == 0:
            discard(tmp, path)
        raise
    finally:
        if dp is not None:
            dp.barrier()   # the checkpoint is in place on every rank's return


def _whole(decision: tuple[bool, int] | None) -> dict | None:
    """The fits rule's decision (autoplan.py, whole_batch) as the manifest stores it: calls without a
    count of their own then split alike after a resume (null: not made yet)."""
    return None if decision is None else {"fits": bool(decision[0]), "batch": int(decision[1])}


def _scaler_state(model: "RoundPipe", pending: "StepRecord | None") -> dict | None:
    """The loss scaler's history relative to the last issued step, without the entry of a pending
    step that loading re-issues (it checks its gradients again)."""
    if model.scaler is None:
        return None
    state = model.scaler.state(model.sync.steps_issued)
    if pending is not None and not pending.whole:
        state["history"].pop("0", None)
    return state


def checked_path(path: Any, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{what}: path must be a non-empty str or os.PathLike (the checkpoint directory), got "
                        f"{path!r}")
    return os.fspath(path)


def engine_file(rank: int, world: int) -> str:
    """A rank's own file: its unapplied gradients and RNG state."""
    return "engine.safetensors" if world == 1 else f"engine.rank{rank}.safetensors"


def optimizer_file(rank: int, sharded: bool) -> str:
    """The optimizer's state: one file, or one per rank with shard_optimizer=True (each rank's slices)."""
    return f"optimizer.rank{rank}.pt" if sharded else "optimizer.pt"


def rank_files(rank: int, world: int, sharded_optimizer: bool) -> list[str]:
    return [engine_file(rank, world)] + ([optimizer_file(rank, True)] if sharded_optimizer else [])


def _uploads(model: "RoundPipe") -> list[tuple[str, torch.Tensor]]:
    """The upload copies of the trained masters, named `<layer>.<param>`."""
    return [(f"{l}.{st.param_names[j]}", st.upload[j]) for l, st in enumerate(model.host.layers)
            for j in st.owned if st.params[j].requires_grad]


def _grad_entries(model: "RoundPipe") -> list[tuple[str, torch.Tensor]]:
    """The gradients not yet applied, named `step.<param>` (what the next step reads) and
    `landed.<param>` (landing sums not yet moved there)."""
    out = []
    for l, st in enumerate(model.host.layers):
        for j in st.owned:
            g = st.params[j].grad if st.params[j].grad is not None else st.held[j]
            if g is not None:
                out.append((f"step.{l}.{st.param_names[j]}", g))
        for j in st.trainable:
            if st.ghas[j]:
                out.append((f"landed.{l}.{st.param_names[j]}", st.gbuf[j]))
    return out


def _write_files(model: "RoundPipe", tmp: str, step: dict | None, optimizer: Any, lr_scheduler: Any,
                 rank: int = 0, world: int = 1) -> dict[str, int]:
    """Every rank its engine file; rank 0 also the shared state (the same on every rank)."""
    sizes = {}
    engine = _grad_entries(model)
    engine.append(("rng.cpu", torch.get_rng_state()))
    if model.devices[0].type == "cuda" and torch.cuda.is_available():
        engine += [(f"rng.cuda.{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    name = engine_file(rank, world)
    sizes[name] = tensor_file.write(os.path.join(tmp, name), engine)
    if optimizer is not None and model.shards is not None:
        name = optimizer_file(rank, True)
        sizes[name] = _save_obj(optimizer.state_dict(), os.path.join(tmp, name))
    if rank != 0:
        return sizes
    items, aliases = _unique_state(model)
    if model.offload is not None:   # masters on disk: streamed a layer at a time
        items = model.offload.stream_masters(items)
    sizes["model.safetensors"] = tensor_file.write(os.path.join(tmp, "model.safetensors"), items,
                                                   {"format": "pt", "aliases": json.dumps(aliases)})
    # what workers read when it is not the masters rounded: the old weights of a whole-model update's
    # window, or predicted weights (staleness compensation)
    if (step is not None and step["kind"] == "copy") or (model.compensation is not None and model.compensation.predict):
        sizes["upload.safetensors"] = tensor_file.write(os.path.join(tmp, "upload.safetensors"), _uploads(model))
    if optimizer is not None and model.shards is None:
        sizes["optimizer.pt"] = _save_obj(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        if model.offload is not None and model.offload.optimizer is optimizer:   # the state on disk, streamed
            sizes.update(model.offload.save(tmp))
    if lr_scheduler is not None:
        sizes["lr_scheduler.pt"] = _save_obj(lr_scheduler.state_dict(), os.path.join(tmp, "lr_scheduler.pt"))
    return sizes


def load(model: "RoundPipe", path: str, optimizer: Any, lr_scheduler: Any) -> dict:
    """Restores a checkpoint into a drained model (every check before any change)."""
    path = checked_path(path, "load_checkpoint")
    clean_crashed(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    rank, world = (model.dp.rank, model.dp.world) if model.dp is not None else (0, 1)
    opt_file = optimizer_file(rank, model.shards is not None)
    if manifest.get("world_size", 1) != world:
        raise ValueError(f"load_checkpoint: {path} was saved by {manifest.get('world_size', 1)} ranks and this run has "
                         f"{world}; each rank's unapplied gradients and RNG state are its own, so a checkpoint resumes "
                         f"on the same number of ranks (to change it, load with that many, synchronize(), and save "
                         f"model.state_dict() and the optimizer's state_dict() for a fresh start)")
    for name in ("model.safetensors", engine_file(rank, world)):
        if name not in files:
            raise ValueError(f"load_checkpoint: {os.path.join(path, MANIFEST)}: files does not list {name}, which "
                             "every checkpoint of this run holds")
    for name, obj, fname in (("optimizer", optimizer, opt_file), ("lr_scheduler", lr_scheduler, "lr_scheduler.pt")):
        if obj is not None and fname not in files:
            raise ValueError(f"load_checkpoint: {name} was given but {os.path.join(path, fname)} does not exist "
                             f"(saved without one{', or without shard_optimizer' if name == 'optimizer' else ''})")
        if obj is not None and not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"load_checkpoint: {name} has no load_state_dict() (a {type(obj).__name__})")
    step = manifest["pending_step"]
    if step is not None and step["kind"] == "update" and optimizer is None:
        raise ValueError(f"load_checkpoint: {path} holds a pending step (saved with its stale window open); pass "
                         "the optimizer (and lr_scheduler) to re-issue it")
    saved_master = manifest.get("master_dtype", str(torch.float32))   # older checkpoints: fp32 masters
    if saved_master != str(model.host.master_dtype):
        raise ValueError(f"load_checkpoint: {os.path.join(path, MANIFEST)} holds masters of {saved_master} but this "
                         f"model's are {model.host.master_dtype} (master_dtype); build it with "
                         f"master_dtype={saved_master}")
    if manifest["num_layers"] != len(model.host):
        raise ValueError(f"load_checkpoint: {os.path.join(path, MANIFEST)} is of a model with {manifest['num_layers']} "
                         f"layers; this one has {len(model.host)}")
    check_constants(model, manifest.get("constants"), os.path.join(path, MANIFEST))
    if optimizer is not None and model.shards is not None:
        model.shards.adopt(optimizer)   # its groups hold this rank's slices, as the saved state does
    opt_state = load_checks.load_obj(os.path.join(path, opt_file)) if optimizer is not None else None
    sched_state = load_checks.load_obj(os.path.join(path, "lr_scheduler.pt")) if lr_scheduler is not None else None
    with contextlib.ExitStack() as opened:
        mf = opened.enter_context(TensorFile(os.path.join(path, "model.safetensors")))
        ef = opened.enter_context(TensorFile(os.path.join(path, engine_file(rank, world))))
        uf = opened.enter_context(TensorFile(os.path.join(path, "upload.safetensors"))) \
            if "upload.safetensors" in files else None
        aliases = load_checks.check_aliases(mf, _unique_state(model)[1])
        state = {n: t for n, t in _saved_state(model).items() if n not in aliases}
        for name, t in state.items():
            mf.check(name, t.dtype, tuple(t.shape))
        extra = sorted(set(mf.entries) - set(state))
        if extra:
            raise ValueError(f"{mf.path}: tensors {extra[:5]} are not in the model (a checkpoint of another model?)")
        for name, upload in _uploads(model) if uf is not None else ():
            uf.check(name, upload.dtype, tuple(upload.shape), "the upload copy's")
        grads = load_checks.check_grads(model, ef)
        rng = load_checks.check_rng(ef)
        unscaled = load_checks.check_unscaled(manifest, os.path.join(path, MANIFEST))
        if opt_state is not None:
            load_checks.check_optimizer(optimizer, opt_state, os.path.join(path, opt_file))
            offload_meta = state_tier.read_meta(path, optimizer) if state_tier.BIN in files else None
            if model.offload is not None:
                model.offload.bind(optimizer)
        if (manifest["loss_scale"] is None) != (model.scaler is None):
            raise ValueError(f"load_checkpoint: the checkpoint {'has no' if manifest['loss_scale'] is None else 'has'} "
                             f"loss-scaling state but this model {'scales' if model.scaler else 'does not scale'} its "
                             f"loss (compute_dtype={model.compute_dtype}); build it with the same precision policy")
        load_checks.load_states(path, (lr_scheduler, sched_state, "lr_scheduler.pt"), (optimizer, opt_state, opt_file))
        # ---- every check passed: restore
        model.run_state.latest_asynchronous = manifest["latest_asynchronous"]
        if model.scaler is not None:   # indices relative to the last issued step, a pending one re-issued below
            model.scaler.load(manifest["loss_scale"], model.sync.steps_issued + (1 if step is not None else 0))
        on_disk = model.offload.masters_on_disk(state) if model.offload is not None else {}
        with torch.no_grad():
            for name, t in state.items():
                if name not in on_disk:
                    mf.read_into(name, t.data if isinstance(t, torch.nn.Parameter) else t)
        host = model.host
        for l in range(len(host)):
            host.clear_grads(l)
            st = host.layers[l]
            for j in st.trainable:
                st.gbuf[j], st.ghas[j] = None, False
            host.refresh(l)
        if on_disk:   # streamed into their files a layer at a time, upload copies rewritten from them
            model.offload.load_masters(mf.read_into, on_disk)
        if uf is not None:   # before any step could rewrite them: gates are closed
            for name, upload in _uploads(model):
                uf.read_into(name, upload)
        if opt_state is not None:   # loaded above
            if model.offload is not None:
                model.offload.reset()
            if offload_meta is not None:
                state_tier.load(path, offload_meta, optimizer, model.offload)
        torch.set_rng_state(rng)
        cuda = sorted(n for n in ef.entries if n.startswith("rng.cuda."))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([ef.read(n) for n in cuda])
        # a restored whole-model update clears p.grad when re-issued: the later gradients return after it;
        # a restored per-layer update reads them, so they return before it
        if step is not None and step["kind"] == "copy":
            model.reissue_step(step, optimizer, lr_scheduler)
        _restore_step_grads(model, ef, {k: v for k, v in grads.items() if k[0] == "step"}, unscaled)
        if step is not None and step["kind"] == "update":
            model.reissue_step(step, optimizer, lr_scheduler)
        for (kind, l, j), name in grads.items():
            if kind == "landed":
                st = host.layers[l]
                st.gbuf[j], st.ghas[j] = ef.read(name), True
    model.sync.calls_since_step = manifest["calls_since_step"]
    model.run_state.grads_pending = manifest["grads_pending"]
    if manifest["whole_batch"] != "unknown":   # older checkpoints did not record it
        model.autoplan.restore_whole_decision(None if manifest["whole_batch"] is None else
                                              (manifest["whole_batch"]["fits"], manifest["whole_batch"]["batch"]))
    model.run_state.counted = (manifest["calls"] - model.sync.iteration, manifest["steps"] - model.sync.steps_issued)
    return manifest["extra"]


def _restore_step_grads(model: "RoundPipe", ef: TensorFile, names: dict[tuple[str, int, int], str],
                        unscaled: list[float | None]) -> None:
    """The gradients the next step reads: fp32 ones as p.grad, low-precision ones held; a layer's
    unscaled ones marked as such (HostState.materialize), so that the step does not unscale them again."""
    for l, inv in enumerate(unscaled):
        model.host.layers[l].inv_scale = inv
    for (_, l, j), name in names.items():
        st = model.host.layers[l]
        g = ef.read(name)
        if g.dtype == torch.float32:
            st.params[j].grad = g
        else:
            st.held[j] = g
