"""Training state on local NVMe: named regions in preallocated files, read ahead and written behind.

`NVMeStore` wraps the native file store (csrc/nvme_io.h has the design): each
region is a file under a private folder of `directory`, preallocated when the
region is allocated (a full disk shows up there, not mid-step), and moved with
O_DIRECT, so the bytes do not also sit in the page cache, by an io_uring (one
thread keeps `threads` chunks in the kernel's queue) or, where the kernel has no
io_uring or forbids it, a pool of `threads` I/O threads.  Transfers are asynchronous and return a fence:

    store = NVMeStore("/nvme/offload")
    region = store.allocate("layer3.state", layer_bytes)
    buf = store.empty(layer_bytes)                    # 4096-aligned host tensor
    store.write_async(region, buf)                    # write behind
    ahead = store.read_async(next_region, next_buf)   # read ahead
    ...
    store.wait(ahead)                                 # StorageError if it failed
    store.close()                                     # waits, removes the files

Reads and writes of overlapping bytes of a region run in the order they were
submitted (a read after a write returns the written bytes) without the caller
waiting in between; everything else runs concurrently.  That ordering is of the
bytes on disk: a host buffer is the caller's, so wait for a write's fence before
reading into (or changing) the tensor it writes from.  After a write to a region
failed, reads of it fail until a write of the whole region succeeds.  Tensors are CPU,
contiguous and 4096-aligned (`empty`, or a HostArena with alignment=4096);
the store keeps each one referenced until its transfer completes.

A failure (a full disk, a file truncated or removed underneath, an I/O error)
is a `StorageError` (an OSError: `.errno`, `.filename`, and the region and offset
in the message) raised by `wait` / `synchronize` to the waiting caller.  A folder
on a file system without O_DIRECT gets buffered I/O and one RuntimeWarning.
Before training, `check_free_space` raises a ValueError with the bytes needed
and available.

Backends: `store.backend` is 'io_uring' or 'threads' and `store.backend_reason`
says why ('io_uring_setup succeeded', "backend='threads'", or the errno of the
refused io_uring_setup: EPERM under /proc/sys/kernel/io_uring_disabled or a
container's seccomp filter, ENOSYS before Linux 5.1).  Both give the same bytes,
ordering and errors (tests/offload/test_nvme_io.py and the state-tier tests run every case
on each) and both beat a plain O_DIRECT loop on the disk measured (`roundpipe bench
nvme`, docs/benchmarks.md: the threads a little ahead on sequential transfers), so
falling back is not a degradation and gives no warning.  NVMeConfig(backend=...) forces one.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from roundpipe import _native
from roundpipe.core.checks import is_int
from roundpipe.offload.arena import ArenaConfig, HostArena

ALIGNMENT = 4096  # O_DIRECT: buffer addresses, file offsets and lengths in these units


def _c():
    return _native.require()


def __getattr__(name: str):
    if name == "StorageError":  # resolved lazily so importing needs no native core
        return _c().StorageError
    raise AttributeError(name)


def file_bytes(nbytes: int) -> int:
    """Bytes a region of nbytes takes on disk (rounded up to 4096)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@functools.lru_cache(maxsize=None)
def io_uring_refused() -> str:
    """Why this process cannot use the io_uring backend (io_uring_setup's errno and its likely cause), or ''."""
    store = _c().FileStore(tempfile.gettempdir(), threads=1, direct="off")   # direct off: no probe file
    try:
        return "" if store.backend == "io_uring" else store.backend_reason
    finally:
        store.close()


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the file system holding `path` (statvfs)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_free_space(path: str | os.PathLike, needed: int, what: str = "the offloaded state") -> None:
    """ValueError naming the bytes needed and available when `path`'s file system has less than `needed` free."""
    if not is_int(needed):
        raise TypeError(f"needed must be an int, got {type(needed).__name__}")
    if needed < 0:
        raise ValueError(f"needed={needed} must be >= 0")
    available = free_bytes(path)
    if needed > available:
        raise ValueError(f"{what} needs {needed} bytes ({needed / 2**30:.2f} GiB) on the file system of {path}, "
                         f"which has {available} bytes ({available / 2**30:.2f} GiB) available; free space there "
                         f"or choose another directory")


@dataclass(frozen=True)
class NVMeConfig:
    """How a store moves bytes.

    threads: chunks kept in the drive's queue: I/O threads, or the io_uring's depth.
    chunk_bytes: the piece of a transfer one thread (one ring entry) moves (multiple of 4096).
    direct: 'auto' uses O_DIRECT where the file system takes it and warns once
        before falling back to buffered I/O; 'on' raises instead; 'off' is buffered.
    backend: 'auto' uses io_uring when io_uring_setup succeeds, else the thread pool;
        'io_uring' raises a ValueError instead of falling back; 'threads' is the pool.
    """

    threads: int = 4
    chunk_bytes: int = 8 << 20
    direct: Literal["auto", "on", "off"] = "auto"
    backend: Literal["auto", "io_uring", "threads"] = "auto"

    def __post_init__(self):
        for name in ("threads", "chunk_bytes"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"threads={self.threads} must be in [1, 64]")
        if self.chunk_bytes < ALIGNMENT or self.chunk_bytes % ALIGNMENT or self.chunk_bytes > 1 << 30:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a multiple of 4096 between 4096 and 1 GiB")
        if self.direct not in ("auto", "on", "off"):
            raise ValueError(f"direct={self.direct!r} must be 'auto', 'on' or 'off'")
        if self.backend not in ("auto", "io_uring", "threads"):
            raise ValueError(f"backend={self.backend!r} must be 'auto', 'io_uring' or 'threads'")


@dataclass(frozen=True)
class Region:
    """A named byte range of a store, backed by its own file."""

    name: str
    nbytes: int
    path: str
    index: int


def _cleanup(native, folder: str) -> None:
    native.close()
    shutil.rmtree(folder, ignore_errors=True)


class NVMeStore:
    """Named regions in files under `directory`, read and written asynchronously; see the module docstring."""

    def __init__(self, directory: str | os.PathLike, config: NVMeConfig | None = None, *,
                 arena: HostArena | None = None, _test_hooks: dict | None = None):
        if config is None:
            config = NVMeConfig()
        if not isinstance(config, NVMeConfig):
            raise TypeError(f"config must be an NVMeConfig, got {type(config).__name__}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
        if arena is not None and not isinstance(arena, HostArena):
            raise TypeError(f"arena must be a HostArena or None, got {type(arena).__name__}")
        if arena is not None and arena.config.alignment < ALIGNMENT:
            raise ValueError(f"arena has alignment={arena.config.alignment}; O_DIRECT buffers need "
                             f"ArenaConfig(alignment={ALIGNMENT})")
        C = _c()
        directory = os.fspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"directory={directory!r} exists and is not a directory")
        os.makedirs(directory, exist_ok=True)
        self.config = config
        self.directory = directory
        self.folder = tempfile.mkdtemp(prefix="roundpipe-", dir=directory)  # this store's files, removed on close
        try:
            self._native = C.FileStore(self.folder, threads=config.threads, chunk_bytes=config.chunk_bytes,
                                       direct=config.direct, backend=config.backend, **(_test_hooks or {}))
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._native, self.folder)
        self._arena = arena
        self._regions: dict[str, Region] = {}
        self._in_flight: list[tuple[object, torch.Tensor]] = []   # (fence, tensor kept alive until it completes)
        if not self._native.direct and config.direct == "auto":
            warnings.warn(f"roundpipe: the file system of {directory} does not take O_DIRECT "
                          f"({self._native.direct_reason}); NVMeStore falls back to buffered I/O, which also fills "
                          f"the page cache (host memory) with the offloaded state", RuntimeWarning, stacklevel=2)

    # -- regions and buffers ---------------------------------------------------------------------------
    @property
    def direct(self) -> bool:
        """Whether transfers bypass the page cache (O_DIRECT)."""
        return self._native.direct

    @property
    def backend(self) -> str:
        """'io_uring' or 'threads': what moves the bytes (see backend_reason)."""
        return self._native.backend

    @property
    def backend_reason(self) -> str:
        """Why that backend: 'io_uring_setup succeeded', "backend='threads'", or why io_uring could not be used."""
        return self._native.backend_reason

    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    def allocate(self, name: str, nbytes: int) -> Region:
        """A new region of nbytes in a preallocated file; StorageError when the disk cannot hold it."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not is_int(nbytes):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        self._check_open()
        index = self._native.allocate(name, nbytes)
        region = Region(name, nbytes, self._native.region_path(index), index)
        self._regions[name] = region
        return region

    def empty(self, shape: int | Sequence[int] | torch.Size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised CPU tensor whose data is 4096-aligned: a valid buffer for any transfer."""
        if self._arena is None:
            self._arena = HostArena(ArenaConfig(alignment=ALIGNMENT, backend="host"))
        return self._arena.empty(shape, dtype)

    # -- transfers -------------------------------------------------------------------------------------
    def read_async(self, region: Region, into: torch.Tensor, offset: int = 0):
        """Queues a read of into.nbytes bytes at `offset` of `region` into `into`; returns its fence."""
        nbytes = self._check_transfer(region, "into", into, offset)
        return self._track(self._native.read(region.index, offset, into.data_ptr(), nbytes), into)

    def write_async(self, region: Region, src: torch.Tensor, offset: int = 0):
        """Queues a write of src's bytes to `offset` of `region`; returns its fence.  The write must end on a
        multiple of 4096 or at the region's end."""
        nbytes = self._check_transfer(region, "src", src, offset)
        end = offset + nbytes
        if end % ALIGNMENT and end != region.nbytes:
            raise ValueError(f"src ({nbytes} bytes) at offset={offset} ends at byte {end} of region {region.name!r} "
                             f"({region.nbytes} bytes): a write must end at a multiple of {ALIGNMENT} or at the "
                             f"region's end")
        return self._track(self._native.write(region.index, offset, src.data_ptr(), nbytes), src)

    def read(self, region: Region, into: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """read_async, waited for; returns `into`."""
        self.wait(self.read_async(region, into, offset))
        return into

    def write(self, region: Region, src: torch.Tensor, offset: int = 0) -> None:
        """write_async, waited for."""
        self.wait(self.write_async(region, src, offset))

    def wait(self, *fences) -> None:
        """Blocks until each fence completed; the first failure's StorageError (after all of them ended)."""
        C = _c()
        for f in fences:
            if not isinstance(f, C.IoFence):
                raise TypeError(f"fences must be what read_async/write_async returned (IoFence), got "
                                f"{type(f).__name__}")
        first = None
        for f in fences:
            try:
                f.wait()
            except C.StorageError as exc:
                first = first or exc
        waited = {id(f) for f in fences}
        self._in_flight = [(f, t) for f, t in self._in_flight if id(f) not in waited and f.state == "pending"]
        if first is not None:
            raise first

    def synchronize(self) -> None:
        """Waits for every transfer; raises the first failure among those not waited for through `wait`."""
        self._native.synchronize()
        failed = [f for f, _ in self._in_flight if f.state == "failed"]
        self._in_flight.clear()
        if failed:
            failed[0].wait()   # raises its StorageError

    def close(self) -> None:
        """Waits for all transfers and removes the store's files (idempotent)."""
        self._finalizer()
        self._in_flight.clear()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "NVMeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NVMeStore(folder={self.folder!r}, regions={len(self._regions)}, "
                f"direct={self.direct if not self.closed else '?'}, backend={self.backend!r}, config={self.config})")

    # -- checks ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the NVMeStore is closed")

    def _track(self, fence, tensor: torch.Tensor):
        self._in_flight = [(f, t) for f, t in self._in_flight if f.state != "done"]
        self._in_flight.append((fence, tensor))
        return fence

    def _check_transfer(self, region: Region, arg: str, t: torch.Tensor, offset: int) -> int:
        self._check_open()
        if not isinstance(region, Region):
            raise TypeError(f"region must be a Region from allocate(), got {type(region).__name__}")
        if self._regions.get(region.name) is not region:
            raise ValueError(f"region {region.name!r} is not a region of this store")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"{arg} must be a dense CPU tensor, got device {t.device}, layout {t.layout}")
        if not t.is_contiguous():
            raise ValueError(f"{arg} (shape {tuple(t.shape)}, strides {t.stride()}) must be contiguous")
        if not is_int(offset):
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        if offset < 0 or offset % ALIGNMENT or offset > region.nbytes:
            raise ValueError(f"offset={offset} must be a multiple of {ALIGNMENT} within region {region.name!r} "
                             f"({region.nbytes} bytes)")
        nbytes = t.numel() * t.element_size()
        if nbytes > region.nbytes - offset:
            raise ValueError(f"{arg} has {nbytes} bytes, more than region {region.name!r} holds from offset={offset} "
                             f"({region.nbytes - offset} of {region.nbytes} bytes)")
        if nbytes and t.data_ptr() % ALIGNMENT:
            raise ValueError(f"{arg}.data_ptr()=0x{t.data_ptr():x} is not {ALIGNMENT}-byte aligned (O_DIRECT); "
                             f"allocate it with NVMeStore.empty() or a HostArena(ArenaConfig(alignment={ALIGNMENT}))")
        return nbytes
