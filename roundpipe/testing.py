"""Test hook: inject delays at the engine's synchronisation points.

Every copy and every optimizer step of the engine calls `delay_point(kind)`
first, with kind one of "param_up", "act_up", "act_down", "grad_down",
"pcopy", "gcopy", "optimizer" or "compute".  Normally that is one global read;
under `inject_delays(fn)` it calls `fn(kind)`, which may sleep for a random
time.  A missing wait in the protocol then shows up as a wrong number in the
tests instead of hiding behind a lucky schedule.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from typing import Callable, Iterator

_hook: Callable[[str], None] | None = None
_lock = threading.Lock()


def delay_point(kind: str) -> None:
    hook = _hook
    if hook is not None:
        hook(kind)


def delays_active() -> bool:
    """Whether a hook is installed (copies then hold themselves back through it)."""
    return _hook is not None


@contextlib.contextmanager
def inject_delays(fn: Callable[[str], None]) -> Iterator[None]:
    """Within the block, `fn(kind)` runs at every synchronisation point of the engine."""
    global _hook
    with _lock:
        if _hook is not None:
            raise RuntimeError("inject_delays is already active; nesting is not supported")
        _hook = fn
    try:
        yield
    finally:
        _hook = None


def random_sleeps(max_s: float = 0.002, seed: int = 0, prob: float = 0.5) -> Callable[[str], None]:
    """A hook sleeping a random 0..max_s seconds with probability prob (thread-safe, seeded)."""
    rng = random.Random(seed)
    lock = threading.Lock()

    def hook(kind: str) -> None:
        with lock:
            t = rng.random() * max_s if rng.random() < prob else 0.0
        if t:
            time.sleep(t)

    return hook


def triton_interpreter_unless_cuda() -> bool:
    """For test and bench suites: whether a CUDA GPU is visible; without one, TRITON_INTERPRET=1.

    Call it before any kernel module is imported (Triton reads the variable when decorating)."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return has_cuda


def run_ranks(argv: list[str], world: int, timeout: float) -> tuple[list, list[str]]:
    """Runs `python *argv` as `world` ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, a
    loopback rendezvous for gloo, OMP_NUM_THREADS=1 as torchrun sets it: ranks share the machine's
    cores); waits at most `timeout` s for each, kills whatever is left.  Returns (processes, stderrs)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(world)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    finally:
        for p in procs:
            p.kill()
    return procs, errs
