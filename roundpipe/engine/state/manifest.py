"""A checkpoint's manifest (checkpoint.json): its format, every field's type and range, and the files it
lists, checked before anything of a checkpoint is read (checkpoints may come from elsewhere).

`read_manifest(path)` returns the checked manifest (defaults filled in for fields older checkpoints
lack); `member(path, name)` the path of a file the checkpoint names: a plain name, a regular file,
inside the folder once links are followed.  checkpoint.py writes the manifest and reads the rest.
"""
from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

import torch

from roundpipe.engine.state import tensor_file

FORMAT = "roundpipe-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and abs(v) < float("inf")


def _is_count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_history(v: Any) -> bool:   # loss_scale.history: relative step -> [scale, growth tracker]
    return isinstance(v, dict) and all(
        re.fullmatch(r"-?[0-9]{1,18}", k) and isinstance(e, list) and len(e) == 2 and _is_number(e[0]) and e[0] > 0
        and _is_count(e[1]) for k, e in v.items())


# manifest field -> (check, what it must be, default when absent: _REQUIRED if it must be there)
_REQUIRED = object()
_FIELDS = {
    "files": (lambda v: isinstance(v, dict) and all(_is_count(s) for s in v.values()),
              "an object of file name -> size in bytes", _REQUIRED),
    "world_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1", 1),
    "num_layers": (_is_count, "an integer >= 0", _REQUIRED),
    "master_dtype": (lambda v: isinstance(v, str), "a dtype's name", str(torch.float32)),
    "calls": (_is_count, "an integer >= 0", _REQUIRED),
    "steps": (_is_count, "an integer >= 0", _REQUIRED),
    "calls_since_step": (_is_count, "an integer >= 0", _REQUIRED),
    "grads_pending": (_is_bool, "true or false", _REQUIRED),
    "latest_asynchronous": (_is_bool, "true or false", _REQUIRED),
    "extra": (lambda v: isinstance(v, dict), "an object", {}),
    "pending_step": (lambda v: v is None or isinstance(v, dict), "null or an object", _REQUIRED),
    "loss_scale": (lambda v: v is None or (isinstance(v, dict) and _is_history(v.get("history"))
                                           and _is_count(v.get("skipped"))),
                   "null or {history: {step: [scale > 0, count]}, skipped: count}", _REQUIRED),
    "whole_batch": (lambda v: v in (None, "unknown") or (isinstance(v, dict) and set(v) == {"fits", "batch"}
                                                          and _is_bool(v["fits"]) and _is_count(v["batch"])),
                    "null or {fits: true or false, batch: count}", "unknown"),
    "constants": (lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(c, dict) and _is_count(c.get("layer")) and isinstance(c.get("fingerprint"), str)
        for c in v.values())), "null or an object of name -> {layer, fingerprint}", None),
}
_STEP_FIELDS = {
    "kind": (lambda v: v in ("copy", "update"), '"copy" or "update"'),
    "window": (_is_count, "an integer >= 0"),
    "max_grad_norm": (lambda v: v is None or (_is_number(v) and v >= 0), "null or a number >= 0"),
    "scale_used": (_is_int, "an integer"),
    "skipped": (_is_bool, "true or false"),
    "predict": (_is_number, "a number"),
    "lr_factor": (_is_number, "a number"),
}


def _bad(mpath: str, field: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"load_checkpoint: {mpath}: {field} is {tensor_file.short(value)}; expected {expected} "
                      "(a corrupt or hand-edited checkpoint)")


def _check_fields(manifest: dict, mpath: str) -> None:
    """Every field load_checkpoint reads has its type and range (defaults filled in for older ones)."""
    for key, (ok, expected, default) in _FIELDS.items():
        if key not in manifest:
            if default is _REQUIRED:
                raise ValueError(f"load_checkpoint: {mpath} has no field {key!r} (not written by save_checkpoint?)")
            manifest[key] = default
        if not ok(manifest[key]):
            raise _bad(mpath, key, manifest[key], expected)
    step = manifest["pending_step"]
    for key, (ok, expected) in _STEP_FIELDS.items() if step is not None else ():
        if not ok(step.get(key)):
            raise _bad(mpath, f"pending_step.{key}", step.get(key), expected)


def member(path: str, name: Any) -> str:
    """The path of a file the checkpoint names: a plain name, a regular file, inside the folder
    once links are followed (a checkpoint from elsewhere must not make us read outside it)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or os.path.basename(name) != name \
            or (os.altsep and os.altsep in name):
        raise ValueError(f"load_checkpoint: {os.path.join(path, MANIFEST)} lists the file {tensor_file.short(name)}; "
                         "a checkpoint's files are plain names inside its folder")
    fpath, folder = os.path.join(path, name), os.path.realpath(path)
    real = os.path.realpath(fpath)
    if os.path.commonpath([real, folder]) != folder:
        raise ValueError(f"load_checkpoint: {fpath} is a link to {real}, outside the checkpoint folder {path!r}")
    if not os.path.lexists(fpath):
        raise ValueError(f"load_checkpoint: {fpath} is missing (" + ("the manifest lists it)" if name != MANIFEST else
                         "not a roundpipe checkpoint, or not completely written)"))
    if not (os.path.exists(fpath) and stat.S_ISREG(os.stat(fpath).st_mode)):
        raise ValueError(f"load_checkpoint: {fpath} is not a regular file (a dangling link, FIFO, device or folder)")
    return fpath


def read_manifest(path: str) -> dict:
    """The checked manifest: format, version, every field's type, every file present, inside the
    folder and of its recorded size."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"load_checkpoint: {path!r} is not a directory (a checkpoint is one, written by "
                         "save_checkpoint)")
    mpath = member(path, MANIFEST)
    with os.fdopen(tensor_file.open_regular(mpath, "the manifest"), "rb") as f:
        raw = f.read(tensor_file.MAX_HEADER + 1)
    if len(raw) > tensor_file.MAX_HEADER:
        raise ValueError(f"load_checkpoint: {mpath} is over {tensor_file.MAX_HEADER} bytes; not a manifest")
    try:
        manifest = json.loads(raw, object_pairs_hook=tensor_file.no_duplicates)
    except RecursionError:
        raise ValueError(f"load_checkpoint: {mpath} nests too deeply to be a manifest") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"load_checkpoint: {mpath} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {mpath} is not a roundpipe checkpoint manifest (format "
                         f"{tensor_file.short(manifest.get('format') if isinstance(manifest, dict) else None)})")
    if manifest.get("version") != VERSION:
        raise ValueError(f"load_checkpoint: {mpath} has format version {tensor_file.short(manifest.get('version'))}; "
                         f"this roundpipe reads version {VERSION}")
    _check_fields(manifest, mpath)
    for name, size in manifest["files"].items():
        fpath = member(path, name)
        got = os.path.getsize(fpath)
        if got != size:
            raise ValueError(f"load_checkpoint: {fpath} has {got} bytes but the manifest says {size} (truncated or "
                             "from another checkpoint)")
    return manifest
