"""Streaming reader and writer of the safetensors file format, on plain file I/O.

A file is an 8-byte little-endian header length, a JSON header naming every
tensor's dtype, shape and byte range (plus a `__metadata__` map of strings),
and the tensors' bytes.  The writer hands each tensor's own memory to the file
(no serialised copy of the whole state, as `safetensors.torch.save_file` makes),
and the reader reads each tensor straight into its destination, so a checkpoint
of a model as large as host memory needs no second copy of it.  The files are
ordinary safetensors: `safetensors.safe_open` reads them.

Files may come from anywhere, so the reader trusts nothing in them: every
malformed input (a short file, a header length past MAX_HEADER or the file's
end, a header that is not a JSON object of entries, a dtype it does not know, a
shape that is not a list of non-negative integers, byte ranges that fall outside
the data, overlap, leave gaps or disagree with shape x dtype, metadata that is
not strings, something that is not a regular file) is a ValueError naming the
file, the tensor and the field.  Nothing is allocated by what the header claims
before the claim is checked against the file's real size, so a hostile file
costs at most MAX_HEADER bytes of header to read and parse, never an allocation
sized by its claims or a hang.  The byte-range rules are the safetensors
library's own (it refuses the same layouts).
"""
from __future__ import annotations

import json
import os
import stat
import struct
from typing import Iterable

import torch

from roundpipe.core.file_values import no_duplicates, short  # noqa: F401 - tensor_file.short / .no_duplicates for its readers

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000   # bytes of JSON header, the safetensors library's own limit
MAX_DIMS = 64              # a shape longer than this is not a tensor anyone wrote
_MAX_ELEMS = 2 ** 62       # the product of a shape's dims (zero ones as 1): torch's strides stay in int64


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


def open_regular(path: str, what: str) -> int:
    """A read-only descriptor of `path`, which must be a regular file: a FIFO or a device opened
    for reading could block or never end (opened non-blocking, then checked)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a regular file (a FIFO, device or directory); {what} must be one")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return fd


def parse_header(path: str, raw: bytes, data: int) -> tuple[dict[str, str], dict]:
    """The metadata and name -> (dtype, shape, begin, nbytes) of a header `raw` whose data
    section has `data` bytes; ValueError naming the file, the tensor and the field."""
    try:
        header = json.loads(raw, object_pairs_hook=no_duplicates)
    except RecursionError:
        raise ValueError(f"{path}: the header nests too deeply to be a safetensors header") from None
    except (UnicodeDecodeError, ValueError) as e:   # JSONDecodeError, a duplicate key, a 5000-digit number
        raise ValueError(f"{path}: the header is not valid JSON ({e}); not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must be an object of strings, got {short(metadata)}")
    entries = {}
    for name, e in header.items():
        where = f"{path}: tensor {short(name)}"
        if not isinstance(e, dict):
            raise ValueError(f"{where} is {short(e)}, not an object with dtype, shape and data_offsets")
        code = e.get("dtype")
        dtype = _BY_NAME.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise ValueError(f"{where}: unknown dtype {short(code)} (known: {', '.join(_BY_NAME)})")
        shape = e.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {short(shape)} must be a list of at most {MAX_DIMS} integers >= 0")
        offsets = e.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2 or \
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
            raise ValueError(f"{where}: data_offsets {short(offsets)} must be a list of two integers")
        numel = bound = 1
        for d in shape:
            numel, bound = numel * d, bound * max(d, 1)
            if bound > _MAX_ELEMS:
                raise ValueError(f"{where}: shape {short(shape)} has more than 2**62 elements")
        begin, end = offsets
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data:
            raise ValueError(f"{where}: data_offsets {short(offsets)} fall outside the data section of {data} "
                             "bytes (truncated or corrupt?)")
        if end - begin != nbytes:
            raise ValueError(f"{where}: data_offsets {short(offsets)} hold {end - begin} bytes but dtype {code} "
                             f"shape {short(shape)} needs {nbytes}")
        entries[name] = (dtype, tuple(shape), begin, nbytes)
    at = 0   # the ranges tile the data section, in order of their offsets, as safetensors requires
    for name, (_, _, begin, nbytes) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != at:
            raise ValueError(f"{path}: tensor {short(name)}: data_offsets begin at {begin} but the tensors before it "
                             f"end at {at} ({'overlapping' if begin < at else 'a gap'})")
        at = begin + nbytes
    if at != data:
        raise ValueError(f"{path}: the tensors' data_offsets end at {at} but the data section has {data} bytes")
    return metadata, entries


class TensorFile:
    """An open safetensors file: its header, checked against the file's size, and tensor reads."""

    def __init__(self, path: str):
        self.path = path
        self._f = os.fdopen(open_regular(path, "a safetensors file"), "rb")
        try:
            size = os.fstat(self._f.fileno()).st_size
            head = self._f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ValueError(f"{path}: the header length field says {n} bytes; at most {MAX_HEADER} are read "
                                 "(not a safetensors file, or a hostile one)")
            if 8 + n > size:
                raise ValueError(f"{path}: the header length field says {n} bytes but the file has {size} "
                                 "(truncated?)")
            raw = self._f.read(n)
            if len(raw) != n:
                raise ValueError(f"{path}: the header ends after {len(raw)} of its {n} bytes (truncated?)")
            self.metadata, entries = parse_header(path, raw, size - 8 - n)
            del raw
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {
                name: (dtype, shape, 8 + n + begin, nbytes) for name, (dtype, shape, begin, nbytes) in entries.items()}
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
        """Tensor `name` in new memory (its size checked against the file's when it was opened)."""
        if name not in self.entries:
            raise ValueError(f"{self.path}: no tensor {name!r} (the file holds {len(self.entries)} others)")
        dtype, shape = self.entries[name][:2]
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out
