"""The strict device model: CPU workers that behave like the worst legal GPU.

A CPU worker's copies normally run as soon as they can (small ones on the issuing thread), so
every copy has finished before the compute after it starts, and a producer-side race, a
kernel writing a tensor a pending copy still reads, can never show.  CUDA promises much less:
a copy reads its source and writes its destination whenever its stream gets to it, after the
events it waits for and before its own event, and nothing else is ordered against it.  Under
`ROUNDPIPE_DEVICE_MODEL=strict` (or `strict.model(...)` in a test) the CPU workers built from then
on keep to that promise and no more:

    CUDA hazard                                   CPU analogue here
    a copy runs late on its own stream            every copy runs on its queue's own thread, after
                                                  its fences and a seeded random delay; none inline
    copy and compute streams run side by side     the four queue threads and the worker thread run
                                                  concurrently
    a kernel writes a copy's source before the    the source's version counter is read when the copy
    copy has read it (no event orders them)       is issued and again when it completed: a torch
                                                  write in between fails the copy's fence, naming
                                                  the copy, the worker, stage and microbatch
    a read of a copy's destination before the     the destination is filled with 0xFF bytes (NaN in
    copy's event                                  every float dtype) when the copy's fences are done,
                                                  and stays so for the copy's delay
    a copy from pageable host memory is staged    a copy whose host side the worker's pinned arena does
    by the driver, synchronous with the issuer    not own fails at once (PageableCopyError): uploads of a
                                                  mapped base go through pinned staging (base.py)
    the caching allocator reuses a block once the  a copy whose device tensor was not marked for its queue
    stream that allocated it is done with it,      (`Worker._empty(queue)`, `_read_by_copy`: where a CUDA
    unless `record_stream` names the copy stream   worker calls record_stream) fails at once
                                                  (StreamUseError)
    fresh device or pinned memory holds garbage   CPU workers' device buffers and download staging
                                                  buffers are born 0xFF-filled

What it cannot show (docs/architecture.md, "The device model"): a write through a raw pointer
(the native optimizer's P-copy) does not move a version counter, so only the copies' own ordering
tests catch it, as wrong numbers; an actual reuse of a released block (a CPU worker's copies keep
their tensors alive until they completed and a Python reference to a freed storage cannot exist, so
released blocks are not poisoned: the marking that prevents the reuse on a GPU is checked instead).
Only CPU workers follow the model; a CUDA worker is the real thing.

The copies themselves are raw memcpy (`_native.lib.copy_many`): a torch `copy_` would move the
destination's version counter and make a later copy reading it (an upload from a landed
download) fail for a write that its fences did order.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import random
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from roundpipe import _native, testing
from roundpipe.core.executor import SerialExecutor

ENV = "ROUNDPIPE_DEVICE_MODEL"
MODES = ("fast", "strict")

# What each queue's copies are, for the error a caught race raises.
ROLES = {"act_up": "stage input upload (act_up)", "act_down": "stage output download (act_down)",
         "param_up": "weight upload (param_up)", "grad_down": "gradient or buffer download (grad_down)"}


class CopyRaceError(RuntimeError):
    """A copy's source was written by compute that no fence ordered after the copy."""


class PageableCopyError(RuntimeError):
    """An asynchronous copy was given host memory outside the pinned arena (on a GPU: a synchronous copy)."""


class StreamUseError(RuntimeError):
    """A copy reads or writes a device tensor that was never marked for its queue (a missing record_stream)."""


_STREAMS = "_roundpipe_streams"   # on a storage object (kept while the storage lives): the queues marked


def record(t: torch.Tensor, queue: str) -> None:
    """Marks t's storage as used by `queue`, as `Tensor.record_stream` marks a CUDA block for a stream."""
    storage = t.untyped_storage()
    marked = getattr(storage, _STREAMS, None)
    if marked is None:
        setattr(storage, _STREAMS, {queue})
    else:
        marked.add(queue)


@dataclass(frozen=True)
class DeviceModel:
    """How CPU workers model a device.

    mode: "fast" (copies as soon as they can, small ones inline) or "strict" (module docstring).
    seed: seeds each queue's delays (with the worker's name and the queue), so a run replays.
    max_delay_s: a delayed copy waits a uniform 0..max_delay_s before it runs.
    prob: the fraction of copies delayed."""

    mode: str = "strict"
    seed: int = 0
    max_delay_s: float = 1e-3
    prob: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"device model mode={self.mode!r} is unknown; expected one of {MODES}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"device model seed must be an int, got {type(self.seed).__name__}")
        if not 0.0 <= self.max_delay_s <= 1.0:
            raise ValueError(f"device model max_delay_s={self.max_delay_s!r} must be within 0..1 seconds")
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"device model prob={self.prob!r} must be within 0..1")


def _from_env() -> DeviceModel | None:
    value = os.environ.get(ENV, "").strip()
    if value in ("", "fast"):
        return None
    if value != "strict":
        raise ValueError(f"{ENV}={value!r} is unknown; expected 'strict', 'fast' or unset")
    seed = os.environ.get(ENV + "_SEED", "0")
    try:
        return DeviceModel("strict", seed=int(seed))
    except ValueError:
        raise ValueError(f"{ENV}_SEED={seed!r} must be an int") from None


_current: DeviceModel | None = _from_env()


def current() -> DeviceModel | None:
    """The strict model CPU workers built now follow, or None (the fast one)."""
    return _current


@contextlib.contextmanager
def model(config: DeviceModel | None) -> Iterator[None]:
    """Within the block, CPU workers built follow `config` (None or mode "fast": the fast model)."""
    global _current
    before = _current
    _current = config if config is not None and config.mode == "strict" else None
    try:
        yield
    finally:
        _current = before


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills a contiguous host tensor's bytes with 0xFF without touching its version counter."""
    n = t.numel() * t.element_size()
    if n:
        ctypes.memset(t.data_ptr(), 0xFF, n)
    return t


class StrictQueues:
    """A CPU worker's four copy queues under the strict model: one thread each, copies in order, late."""

    def __init__(self, config: DeviceModel, name: str, describe: Callable[[], str],
                 owns: Callable[[torch.Tensor], bool]):
        self.config, self.name, self.describe, self.owns = config, name, describe, owns
        self._queues: dict[str, tuple[SerialExecutor, random.Random, threading.Lock]] = {}
        for q in ROLES:
            rng = random.Random(zlib.crc32(f"{config.seed}/{name}/{q}".encode()))
            self._queues[q] = (SerialExecutor(f"roundpipe-{name}-{q}", idle_release_s=0), rng, threading.Lock())

    def executors(self) -> list[SerialExecutor]:
        return [e for e, _, _ in self._queues.values()]

    def submit(self, queue: str, dsts: list, srcs: list, after: list):
        """Queues dsts[i] <- srcs[i] behind `after`; returns the fence it completes (or fails) with."""
        executor, rng, lock = self._queues[queue]
        host, device = (srcs, dsts) if queue in ("act_up", "param_up") else (dsts, srcs)
        for i, h in enumerate(host):
            if not self.owns(h):
                raise PageableCopyError(
                    f"strict device model: the {ROLES[queue]} issued by {self.describe()} has host tensor {i} "
                    f"(shape {tuple(h.shape)}, {h.dtype}) outside the pinned arena; on a GPU the copy would be "
                    "synchronous with the issuing thread: stage it through an arena block first")
        for i, d in enumerate(device):
            if queue not in getattr(d.untyped_storage(), _STREAMS, ()):
                raise StreamUseError(
                    f"strict device model: the {ROLES[queue]} issued by {self.describe()} uses device tensor {i} "
                    f"(shape {tuple(d.shape)}, {d.dtype}) not marked for its queue; on a GPU the caching allocator "
                    "could hand its block out again while the copy still runs (mark it: Worker._read_by_copy)")
        fence = _native.lib.HostFence()
        versions = [s._version for s in srcs]
        where = self.describe()
        with lock:
            delay = rng.random() * self.config.max_delay_s if rng.random() < self.config.prob else 0.0

        def run() -> None:
            try:
                for f in after:
                    f.wait()
                for d in dsts:   # from now until the fence, the destination is the copy's
                    poison(d)
                if delay:
                    time.sleep(delay)
                testing.delay_point(queue)   # a test's own hook (roundpipe.testing) still applies
                _native.lib.copy_many([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs],
                                      [s.numel() * s.element_size() for s in srcs])
                for i, (s, v) in enumerate(zip(srcs, versions)):
                    if s._version != v:
                        raise CopyRaceError(
                            f"strict device model: the {ROLES[queue]} issued by {where} read source {i} "
                            f"(shape {tuple(s.shape)}, {s.dtype}) after compute wrote it in place: no fence "
                            "ordered that write after the copy, so on a GPU the copy races it")
            except BaseException as e:  # noqa: BLE001 - the fence carries it to every waiter
                fence.fail(f"{type(e).__name__}: {e}")
                return
            fence.set()
        executor.submit(run)
        return fence

    def synchronize(self) -> None:
        for executor, _, _ in self._queues.values():
            executor.wait_idle()

    def close(self) -> None:
        for executor, _, _ in self._queues.values():
            executor.close()
