"""OpenMP teams of the engine's threads: idle ones are given back, so busy ones keep spinning.

torch's CPU kernels and our native core share one OpenMP runtime (libgomp on Linux: the
native core links the soname torch loaded).  libgomp keeps a team of helper threads for
every thread that ever ran a parallel region, and while the helpers of all teams together
outnumber the CPUs it cuts the spin a helper does between two regions from ~300,000
iterations to 100: every region then wakes its helpers from a futex.  A training script's
main thread owns a team from building the model, and the engine's compute, step and
landing threads each get one, so from the first call on every kernel ran throttled: the
tiny decoder's forward and backward took 112 ms a step on a worker thread against 95 ms on
the main thread of a process with no second team (2-core CI VM; 113 ms on both with
OMP_WAIT_POLICY=passive, i.e. the whole gap is the lost spin).

So a thread that has nothing to do gives its team back (`release_team`, libgomp's
`omp_pause_resource_all`, which joins the calling thread's helpers): a compute thread once
it has been idle for `IDLE_RELEASE_S`, the step, G-copy and landing threads as soon as their
queue is empty (SerialExecutor's idle_release_s=0), the caller's thread when a call starts and
when a synchronous step waits.  Only the threads working now keep teams, and one thread computing
on a machine of N CPUs spins as in a plain script.  A team given back is rebuilt by the
thread's next parallel region (a thread start, ~20-60 us), never while it is busy.

Other OpenMP runtimes (LLVM's libomp, Intel's libiomp5) spin without such a rule; where
libgomp is not loaded, or too old for OpenMP 5.0's pause, `release_team` does nothing.

Spinning at full count is what a plain PyTorch script does too, and like it, two processes
that compute on the same cores at once then starve each other (a helper spins out its time
slice while the thread that would start the next region waits for a core).  Processes that
share a machine's cores should share its threads (OMP_NUM_THREADS, as torchrun sets it to 1);
ROUNDPIPE_KEEP_OMP_TEAMS=1 keeps every team instead, so libgomp throttles as before.
"""
from __future__ import annotations

import ctypes
import os
import threading

# How long an engine thread waits for its next job before giving its team back: past
# libgomp's own ~3 ms of spinning its helpers sleep anyway, and a job within the window (the
# next stage of a pipelined call) finds the team as it left it.
IDLE_RELEASE_S = 0.002

_OMP_PAUSE_SOFT = 1   # omp_pause_resource_t: libgomp frees the caller's team for soft and hard alike

_lock = threading.Lock()
_pause = None          # omp_pause_resource_all of the loaded libgomp, once looked up
_looked_up = False


def _pause_fn():
    global _pause, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            if os.environ.get("ROUNDPIPE_KEEP_OMP_TEAMS") == "1":
                return None
            try:   # only a libgomp already loaded (by torch): never load an OpenMP runtime of our own
                lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                fn = lib.omp_pause_resource_all
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _pause = fn
            except (OSError, AttributeError):
                _pause = None
        return _pause


def release_team() -> bool:
    """Gives back the calling thread's idle OpenMP helper threads; True when libgomp did.

    Call only outside parallel regions (any Python code is); a thread without a team is a no-op."""
    fn = _pause_fn()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0


def available() -> bool:
    """True when this process's OpenMP runtime can give teams back (libgomp with OpenMP 5.0)."""
    return _pause_fn() is not None
