"""The built-in training data: bytes of text files, cut into next-byte prediction batches.

`roundpipe train` must work offline, so its default corpus is the Python standard
library's own ``*.py`` sources (``sysconfig.get_paths()['stdlib']``, ~30 MB on
CPython 3.11, read in ~0.3 s); ``data_dir`` points it at any folder of text files
instead.  Files are read in sorted relative-path order and joined with a newline,
so the corpus (and every batch drawn from it with a given seed) is the same on
every run of one installation.

Shapes:  B = batch size, T = sequence length, vocabulary = 256 byte values.

    corpus.data                      uint8 [n_bytes]
    input_ids, labels = batch        int64 [B, T]; labels[b, t] = input_ids[b, t + 1]
                                     (the window is T + 1 bytes starting at a random offset)

The last `val_fraction` of the bytes is held out: `batches(split="val")` draws
from it only, so the loss printed at the end of training is not a memorised one.
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Iterator, Literal

import torch

from roundpipe.core.checks import is_int

VOCAB_SIZE = 256
# Installed packages are not the standard library; caches are not sources.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# A NUL byte in a file's first block marks it as binary (the heuristic of grep and git).
_BINARY_PROBE = 8192


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_text(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" not in f.read(_BINARY_PROBE)


def list_files(root: Path, pattern: str) -> list[Path]:
    files = []
    for path in root.rglob(pattern):
        parts = path.relative_to(root).parts
        if any(p in _SKIP_DIRS or p.startswith(".") for p in parts) or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_corpus(root: Path, pattern: str, text_only: bool) -> tuple[torch.Tensor, tuple[Path, ...]]:
    files = tuple(p for p in list_files(root, pattern) if not text_only or is_text(p))
    blob = b"\n".join(p.read_bytes() for p in files)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    return data, files


@functools.lru_cache(maxsize=1)
def _stdlib_corpus(root: Path) -> tuple[torch.Tensor, tuple[Path, ...]]:
    # Cached: tests and benchmarks build several runs in one process; the files do not change.
    return _read_corpus(root, "*.py", False)


class ByteCorpus:
    """A byte string with a train/validation split and seeded (input_ids, labels) batches."""

    def __init__(self, data: torch.Tensor, files: tuple[Path, ...] = (), val_fraction: float = 0.05,
                 source: str = "<tensor>"):
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(f"data must be a 1-D uint8 tensor, got {type(data).__name__}"
                            f"{'' if not isinstance(data, torch.Tensor) else f' {data.dtype} {tuple(data.shape)}'}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
        self.data = data
        self.files = files
        self.source = source
        self.split_at = len(data) - int(len(data) * val_fraction)

    @classmethod
    def from_stdlib(cls, val_fraction: float = 0.05) -> "ByteCorpus":
        """The standard library's ``*.py`` files (the default corpus of `roundpipe train`)."""
        root = stdlib_dir()
        data, files = _stdlib_corpus(root)
        if not files:
            raise RuntimeError(f"no *.py files under the standard library folder {root}; pass a data_dir instead")
        return cls(data, files, val_fraction, source=f"Python standard library ({root}, *.py)")

    @classmethod
    def from_dir(cls, data_dir: str | Path, val_fraction: float = 0.05) -> "ByteCorpus":
        """Every text file under `data_dir` (recursively; hidden and binary files skipped)."""
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise ValueError(f"data_dir={str(data_dir)!r} is not a directory")
        data, files = _read_corpus(root.resolve(), "*", True)
        if not files:
            raise ValueError(f"data_dir={str(data_dir)!r} holds no text files (hidden and binary files are skipped)")
        return cls(data, files, val_fraction, source=f"{root} ({len(files)} text files)")

    @classmethod
    def load(cls, data_dir: str | Path | None = None, val_fraction: float = 0.05) -> "ByteCorpus":
        return cls.from_stdlib(val_fraction) if data_dir is None else cls.from_dir(data_dir, val_fraction)

    def __len__(self) -> int:
        return len(self.data)

    def split(self, split: Literal["train", "val"]) -> torch.Tensor:
        if split == "train":
            return self.data[: self.split_at]
        if split == "val":
            return self.data[self.split_at:]
        raise ValueError(f"split={split!r} must be 'train' or 'val'")

    def batches(self, batch_size: int, seq_len: int, *, seed: int = 0, split: Literal["train", "val"] = "train",
                steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields `steps` (or endless) batches of T+1-byte windows at seeded random offsets."""
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if steps is not None and (not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps={steps!r} must be a non-negative int or None")
        data = self.split(split)
        if len(data) < seq_len + 1:
            raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} bytes, but the {split} split of "
                             f"{self.source} has {len(data)}; use a shorter seq_len or more data")
        gen = torch.Generator().manual_seed(seed)
        window = torch.arange(seq_len + 1)
        count = 0
        while steps is None or count < steps:
            starts = torch.randint(0, len(data) - seq_len, (batch_size, 1), generator=gen)
            chunk = data[starts + window].long()
            yield chunk[:, :-1], chunk[:, 1:]
            count += 1
