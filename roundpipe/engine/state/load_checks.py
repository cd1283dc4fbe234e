"""What load_checkpoint checks before it changes anything (checkpoint.py, `load`).

A checkpoint may come from elsewhere, so loading one is all or nothing: every file is read
and judged against the model, the optimizer and the scheduler first, and only then is
anything restored.  Each check here raises a ValueError naming the file and the mismatch:

    load_obj          optimizer.pt / lr_scheduler.pt: torch.load with weights_only (no code
                      runs), of a zip whose members are stored (a compressed one could be a zip bomb)
    check_aliases     model.safetensors' `aliases` metadata: tensors this model shares too
    check_rng         the saved CPU generator state (tried on a new generator), CUDA ones' form
    check_grads       engine.safetensors' unapplied gradients: of trainable parameters, their
                      shape, fp32 or a low-precision dtype
    check_optimizer   the optimizer state's group layout and parameter shapes (a roundpipe.optim
                      optimizer judges its own format: check_state_dict)
    check_unscaled    checkpoint.json's per-layer unscale factors (grads_unscaled)
    load_states       the last check: the optimizer's and scheduler's own load_state_dict, tried;
                      on a refusal every object is put back as it was (`_Held`)

The manifest and the files it lists are checked before these (manifest.py), the tensor files'
headers as they are opened (tensor_file.py), the base's fingerprints by base_tensors.py.
"""
from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import torch

from roundpipe.engine.state import tensor_file
from roundpipe.engine.state.tensor_file import TensorFile

# The model (roundpipe.engine.model.RoundPipe; not imported, as in checkpoint.py): check_grads reads .host.
RoundPipe = Any


def load_obj(path: str) -> Any:
    """torch.load with weights_only (no code runs), of a zip whose members are stored as torch.save
    stores them: a compressed member could unpack to far more than the file (a zip bomb)."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = next((i for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED or i.file_size > size), None)
    except Exception as e:   # noqa: BLE001 - zipfile raises many kinds (BadZipFile, NotImplementedError, ...)
        raise ValueError(f"load_checkpoint: {path} is not a torch.save zip file ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise ValueError(f"load_checkpoint: {path}: member {tensor_file.short(bad.filename)} is compressed or claims "
                         f"{bad.file_size} bytes in a file of {size}; torch.save stores its members as they are")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # noqa: BLE001 - any unpickling failure: name the file
        raise ValueError(f"load_checkpoint: {path} could not be read ({type(e).__name__}: {e})") from None


def load_states(path: str, *given: tuple[Any, Any, str]) -> None:
    """The last check: the (scheduler, optimizer)'s own load_state_dict accepts its saved state; any
    error is a ValueError naming the file, and every object is put back as it was: a scheduler from its
    state dict (small), an optimizer by swapping its own state and groups back in (`_Held`), so a loader
    that failed after assigning part of the state (a subclass's, or one whose checks come late) leaves
    nothing half-loaded and copies no state."""
    done = []
    for obj, state, name in given:
        if state is None:
            continue
        held = _Held(obj)
        try:
            obj.load_state_dict(state)
        except Exception as e:   # noqa: BLE001 - whatever the object's own loader raises: name the file
            for prev in [held] + done[::-1]:
                prev.put_back()
            raise ValueError(f"load_checkpoint: {os.path.join(path, name)}: load_state_dict refused it "
                             f"({type(e).__name__}: {tensor_file.short(str(e))})") from None
        done.append(held)


class _Held:
    """What an object's load_state_dict may replace, kept to put back.  A torch optimizer: its `state` and
    each group's dict, by reference (torch's loader assigns new ones; nothing is copied); anything else: its
    state dict."""

    def __init__(self, obj: Any):
        self.obj = obj
        if isinstance(obj, torch.optim.Optimizer):
            self.state = {p: dict(s) for p, s in obj.state.items()}
            self.groups = [dict(g) for g in obj.param_groups]
        else:
            self.backup = obj.state_dict()

    def put_back(self) -> None:
        obj = self.obj
        if not isinstance(obj, torch.optim.Optimizer):
            obj.load_state_dict(self.backup)
            return
        obj.state.clear()
        obj.state.update({p: dict(s) for p, s in self.state.items()})
        del obj.param_groups[len(self.groups):]
        for i, g in enumerate(self.groups):
            if i < len(obj.param_groups):
                obj.param_groups[i].clear()
                obj.param_groups[i].update(g)
            else:
                obj.param_groups.append(dict(g))


def check_aliases(mf: TensorFile, mine: dict[str, str]) -> dict[str, str]:
    """The file's `aliases` (name -> the name it is stored under): each a tensor this model shares too
    (`mine`, the model's own alias -> name; one left out of the file would otherwise keep whatever it held)."""
    try:
        aliases = json.loads(mf.metadata.get("aliases", "{}"), object_pairs_hook=tensor_file.no_duplicates)
    except (ValueError, RecursionError):
        aliases = None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise ValueError(f"{mf.path}: __metadata__.aliases is {tensor_file.short(mf.metadata['aliases'])}; expected "
                         "a JSON object of tensor name -> the name it is stored under")
    for name, target in aliases.items():
        if mine.get(name) != target:
            raise ValueError(f"{mf.path}: __metadata__.aliases stores {tensor_file.short(name)} as "
                             f"{tensor_file.short(target)}, but in this model they are not one shared tensor")
    return aliases


def check_rng(ef: TensorFile) -> torch.Tensor:
    """The saved CPU generator state, tried on a new generator (torch refuses an invalid mt19937 state)."""
    ref = torch.get_rng_state()
    ef.check("rng.cpu", ref.dtype, tuple(ref.shape), "the CPU generator state's")
    state = ef.read("rng.cpu")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as e:
        raise ValueError(f"{ef.path}: tensor 'rng.cpu' is not a CPU generator state ({e})") from None
    for name, (dtype, shape, _, _) in ef.entries.items():
        if name.startswith("rng.cuda.") and (dtype != torch.uint8 or len(shape) != 1):
            raise ValueError(f"{ef.path}: tensor {name!r} is {dtype} {list(shape)}; a CUDA generator state is 1-D uint8")
    return state


def check_grads(model: "RoundPipe", ef: TensorFile) -> dict[tuple[str, int, int], str]:
    """(kind, layer, index) -> name of every gradient in engine.safetensors, checked against the model."""
    names = {}
    for l, st in enumerate(model.host.layers):
        for j in st.trainable:
            for kind in ("step", "landed"):
                names[f"{kind}.{l}.{st.param_names[j]}"] = (kind, l, j)
    out = {}
    for name, (dtype, shape, _, _) in ef.entries.items():
        if name.startswith("rng."):
            continue
        if name not in names:
            raise ValueError(f"{ef.path}: gradient {name!r} is not of a trainable parameter of this model (a "
                             "checkpoint of another model, or parameters frozen differently?)")
        kind, l, j = names[name]
        p = model.host.layers[l].params[j]
        if shape != tuple(p.shape) or dtype not in (torch.float32, torch.bfloat16, torch.float16) or \
                (kind == "step" and dtype == torch.float32 and getattr(p, "grad_dtype", p.dtype) not in
                 (None, torch.float32)):   # an fp32 p.grad where the parameter takes one (bf16 masters do)
            raise ValueError(f"{ef.path}: gradient {name!r} is {dtype} {list(shape)}; the parameter is {p.dtype} "
                             f"{list(p.shape)} (its gradient: its shape, fp32 or the compute dtype)")
        out[(kind, l, j)] = name
    return out


def check_optimizer(optimizer: Any, state: Any, fpath: str) -> None:
    """The saved optimizer state has the optimizer's group layout and parameter shapes."""
    if not isinstance(state, dict) or "param_groups" not in state:
        return   # not a torch-style state_dict: its own load_state_dict judges it
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return
    saved_groups, per_param = state["param_groups"], state.get("state", {})
    if not (isinstance(saved_groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                   for g in saved_groups)
            and isinstance(per_param, dict) and all(isinstance(s, dict) for s in per_param.values())):
        raise ValueError(f"load_checkpoint: {fpath}: param_groups or state is not of an optimizer's state_dict "
                         "(param_groups: a list of groups with a params list; state: index -> an object)")
    saved = [len(g["params"]) for g in saved_groups]
    mine = [len(g["params"]) for g in groups]
    if saved != mine:
        raise ValueError(f"load_checkpoint: {fpath} has parameter groups of sizes {saved}; the optimizer's are {mine}")
    if callable(getattr(optimizer, "check_state_dict", None)):   # a roundpipe.optim one judges its own format
        try:
            optimizer.check_state_dict(state)
        except ValueError as e:
            raise ValueError(f"load_checkpoint: {fpath}: {e}") from None
        return
    params = [p for g in groups for p in g["params"]]
    for i, s in per_param.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(i, int) and i < len(params) \
                    and v.shape != params[i].shape:
                raise ValueError(f"load_checkpoint: {fpath}: state {k!r} of parameter {i} has shape {list(v.shape)} "
                                 f"but the parameter is {list(params[i].shape)}")


def check_unscaled(manifest: dict, mpath: str) -> list[float | None]:
    """Per layer, the factor its saved step gradients were unscaled by (None: they carry the loss scale);
    a checkpoint from before it was recorded holds only scaled ones."""
    layers = manifest["num_layers"]
    got = manifest.get("grads_unscaled")
    if got is None:
        return [None] * layers
    if not isinstance(got, list) or len(got) != layers or not all(
            v is None or (isinstance(v, float) and 0 < v < float("inf")) for v in got):
        raise ValueError(f"load_checkpoint: {mpath}: grads_unscaled={got!r} must be a list of {layers} entries, "
                         "each null or a finite number > 0 (the factor a layer's gradients were unscaled by)")
    if any(v is not None for v in got) and manifest["loss_scale"] is None:
        raise ValueError(f"load_checkpoint: {mpath}: grads_unscaled holds factors but the checkpoint has no loss "
                         "scaling state")
    return got
