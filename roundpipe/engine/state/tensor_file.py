"""Streaming reader and writer of the safetensors file format, on plain file I/O.

A file is an 8-byte little-endian header length, a JSON header naming every
tensor's dtype, shape and byte range (plus a `__metadata__` map of strings),
and the tensors' bytes.  The writer hands each tensor's own memory to the file
(no serialised copy of the whole state, as `safetensors.torch.save_file` makes),
and the reader reads each tensor straight into its destination, so a checkpoint
of a model as large as host memory needs no second copy of it.  The files are
ordinary safetensors: `safetensors.safe_open` reads them.

Every malformed input (a short file, a header that is not JSON, a byte range
outside the file, a dtype or shape that differs from the destination's) is a
ValueError naming the file and what is wrong.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, its own memory when contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write(path: str, tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Writes the named tensors to `path` (fsynced); returns the file's size in bytes."""
    tensors = list(tensors)
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if name in header:
            raise ValueError(f"{path}: tensor name {name!r} given twice")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            if t.numel():   # a master on disk (roundpipe/offload/masters.py) is read as it is written
                f.write(_raw(t.materialize() if hasattr(t, "materialize") else t))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


class TensorFile:
    """An open safetensors file: its header, checked against the file's size, and tensor reads."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ValueError(f"{path}: the header claims {n} bytes but the file has {size} (truncated?)")
            try:
                header = json.loads(self._f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: the header is not valid JSON ({e}); not a safetensors file") from None
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            data = size - 8 - n
            for name, e in header.items():
                dtype = _BY_NAME.get(e.get("dtype"))
                begin, end = e.get("data_offsets", (0, -1))
                shape = tuple(e.get("shape", ()))
                if dtype is None:
                    raise ValueError(f"{path}: tensor {name!r} has unknown dtype {e.get('dtype')!r}")
                numel = 1
                for d in shape:
                    numel *= d
                if end - begin != numel * torch.empty((), dtype=dtype).element_size() or end > data or begin < 0:
                    raise ValueError(f"{path}: tensor {name!r} ({e.get('dtype')} {list(shape)}) has bytes "
                                     f"{begin}..{end} but the data section has {data} (truncated or corrupt?)")
                self.entries[name] = (dtype, shape, 8 + n + begin, end - begin)
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], what: str = "the model's") -> None:
        """ValueError unless the file holds `name` with this dtype and shape."""
        if name not in self.entries:
            raise ValueError(f"{self.path}: no tensor {name!r} (the file holds {len(self.entries)} others)")
        got_dtype, got_shape = self.entries[name][:2]
        if got_shape != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {list(got_shape)} but {what} is {list(shape)}")
        if got_dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {got_dtype} but {what} is {dtype}")

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Reads tensor `name` into dst (same dtype and shape; straight into its memory when contiguous)."""
        self.check(name, dst.dtype, tuple(dst.shape))
        target = dst if dst.is_contiguous() and dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
        _, _, offset, nbytes = self.entries[name]
        if nbytes:
            self._f.seek(offset)
            if self._f.readinto(_raw(target)) != nbytes:
                raise ValueError(f"{self.path}: tensor {name!r} ends before its {nbytes} bytes (truncated?)")
        if target is not dst:
            dst.copy_(target)

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` in new memory."""
        dtype, shape = self.entries[name][:2] if name in self.entries else (torch.uint8, ())
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out
