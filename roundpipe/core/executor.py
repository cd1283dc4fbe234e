"""`SerialExecutor`: one daemon thread running submitted jobs in order.

The engine's threads are all this shape: each worker's driver thread, the host
thread of the optimizer protocol (G-copies, steps, P-copies) and a CUDA
worker's completion thread (waits for a copy's event, then lands it).  A job's
exception is kept (the first one) and re-raised by `raise_error()` or
`wait_idle(raise_errors=True)` on the caller's thread, so it reaches the user
with its own type; later jobs still run.

Shutdown.  The threads are daemons, so a script that ends without `close()`
still exits; but a daemon thread still running when the interpreter finalizes
is killed (pthread_exit) the moment it next takes the GIL, and if that moment
is inside torch or pybind11 C++ code that released the GIL (a tensor op, a
fused optimizer step, a fence wait) the forced unwind meets a noexcept
destructor and the process aborts: "terminate called without an active
exception", status 134, in 7 to 18 of 20 runs of a script ending with an
asynchronous step pending (tests/core/test_exit.py).  So no engine thread may outlive
`atexit`:

    owner collected      stop_when_collected: wake(), then each thread exits
                         after its queued jobs (no join: the collector may run on
                         any thread, even one of these)
    interpreter exit     every owner still alive is woken, every thread still
                         running is stopped and joined, before finalization
                         (waits at most EXIT_JOIN_S, then names the threads left)

`wake` is the owner's way of letting queued jobs finish without it (a RoundPipe
closes its stale window, so a pending asynchronous step runs instead of waiting
for a call that never comes).  Work submitted after a stop raises RuntimeError
instead of waiting forever for a thread that is gone.

Stall reports.  A blocking wait of the engine says what it waits for (`waiting_for`: a
hand-off board key, the CPU workers' turn) while it blocks; `engine_stacks` formats every
engine thread's current stack under its name with that, for the stall watchdog
(roundpipe/engine/calls/dispatcher.py).
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Sequence

from roundpipe.core import omp
from roundpipe.core.errors import Aborted

_local = threading.local()   # .name: the engine thread's name, on engine threads only

EXIT_JOIN_S = 60.0   # how long interpreter exit waits for engine threads to finish their jobs

_registry_lock = threading.RLock()   # re-entrant: a collection inside a holder may run _stop_owned
_running: "weakref.WeakSet[SerialExecutor]" = weakref.WeakSet()   # a running thread keeps its executor alive
_owners: dict[int, tuple[Callable[[], None], list["SerialExecutor"]]] = {}
_owner_keys = itertools.count()


_waits: dict[int, str] = {}   # thread ident -> what it blocks on now (waiting_for)
_STDLIB = sysconfig.get_paths()["stdlib"]
_PACKAGES = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], "site-packages", "dist-packages")


def _stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and not any(p in filename for p in _PACKAGES)


class waiting_for:  # noqa: N801 - used as a context manager, like a function
    """`with waiting_for("what"):` marks the calling thread as blocked on `what` for the body, so a
    stall report names it (a plain class: ~0.3 us, entered only when a wait really blocks)."""

    __slots__ = ("what", "ident", "prev")

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        self.ident = threading.get_ident()
        self.prev = _waits.get(self.ident)
        _waits[self.ident] = self.what

    def __exit__(self, *exc) -> None:
        if self.prev is None:
            _waits.pop(self.ident, None)
        else:
            _waits[self.ident] = self.prev


def waits_of(ident: int | None) -> str | None:
    """What thread `ident` is blocked on (`waiting_for`), or None."""
    return None if ident is None else _waits.get(ident)


def innermost(ident: int | None) -> str | None:
    """Thread `ident`'s innermost frame outside the standard library ("file:line in function"), or None."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None and _stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def engine_stacks(first: set[int] | None = None) -> str:
    """Every running engine thread's current stack under its name (sys._current_frames): a stall's evidence.
    `first`: thread idents listed before the others (the stalled model's workers: other RoundPipes alive in
    the process have threads of the same names, "roundpipe-cpu:1" for one, listed after them)."""
    frames = sys._current_frames()
    first = first or set()
    with _registry_lock:   # a closed executor kept alive by a reference: its thread's ident may belong to a new
        #                    thread now (idents are reused), whose stack would be shown under the dead one's name
        executors = sorted((e for e in _running if e.alive), key=lambda e: (e.ident not in first, e.name))
    parts = []
    for e in executors:
        frame = frames.get(e.ident) if e.ident is not None else None
        if frame is None:
            continue
        what = _waits.get(e.ident)
        head = f"thread {e.name!r}" + (f", waiting for {what}" if what else "")
        parts.append(f"{head}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def engine_thread() -> str | None:
    """The name of the engine thread the caller runs on (a layer, a loss_fn), or None."""
    return getattr(_local, "name", None)


def on_thread(submit: Callable[[Callable[[], None]], None], job: Callable[[], None]) -> Callable[[], None]:
    """A job that runs `job` through `submit` (another thread's queue) and waits for it, re-raising its error."""
    def run_there() -> None:
        done, errors = threading.Event(), []

        def run() -> None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - re-raised on the waiting thread
                errors.append(e)
            finally:
                done.set()
        submit(run)
        done.wait()
        if errors:
            raise errors[0]
    return run_there


class SerialExecutor:
    def __init__(self, name: str, idle_release_s: float = omp.IDLE_RELEASE_S):
        # idle_release_s: how long the thread waits for a next job before giving its OpenMP team back
        # (roundpipe/core/omp.py); 0 for threads whose jobs come once per call or step, whose
        # helpers would otherwise spin on the cores the compute threads need.
        self._idle_release_s = idle_release_s
        self._q: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._pending = 0
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        with _registry_lock:
            _running.add(self)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def ident(self) -> int | None:
        """The thread's identifier (sys._current_frames' key), None before it started.  It outlives the thread,
        and a thread started later may be given the same one: ask `alive` first."""
        return self._thread.ident

    @property
    def alive(self) -> bool:
        """Whether the thread runs (it was started and has not exited)."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        _local.name = self._thread.name
        while True:
            try:   # idle a moment: the thread's OpenMP team goes back (roundpipe/core/omp.py)
                job = self._q.get(timeout=self._idle_release_s) if self._idle_release_s > 0 else self._q.get_nowait()
            except queue.Empty:
                omp.release_team()
                job = self._q.get()
            if job is None:
                return
            try:
                job()
            except Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the caller by raise_error()
                if self._error is None:
                    self._error = e
            job = None   # an idle thread must not keep the last job's closure (and its model) alive
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"the engine thread {self.name!r} has stopped (its RoundPipe was closed or "
                                   "collected, or the interpreter is exiting); it takes no more work")
            self._pending += 1
        self._q.put(job)

    def wait_idle(self, raise_errors: bool = False) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait(0.1)
        if raise_errors:
            self.raise_error()

    def raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def discard_error(self) -> None:
        self._error = None

    def stop(self) -> None:
        """Asks the thread to exit after the queued jobs, without waiting (safe from a finalizer)."""
        with self._cv:
            if self._stopped:
                return
            self._stopped = True
        self._q.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread to exit (after stop()); True when it has."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self.stop()
        self.join()


class _Owned:
    """What `stop_when_collected` returns; `detach()` once the owner has closed the threads itself."""

    def __init__(self, key: int, finalizer: weakref.finalize):
        self._key = key
        self._finalizer = finalizer

    def detach(self) -> None:
        self._finalizer.detach()
        with _registry_lock:
            _owners.pop(self._key, None)


def _stop_owned(key: int) -> None:
    with _registry_lock:
        entry = _owners.pop(key, None)
    if entry is not None:
        wake, executors = entry
        wake()
        for e in executors:
            e.stop()


def stop_when_collected(owner: object, executors: Sequence[SerialExecutor],
                        wake: Callable[[], None]) -> _Owned:
    """Stops `executors` when `owner` is garbage-collected and at interpreter exit, calling `wake` first.

    `wake` must not reference `owner` (it would never be collected) and must make every
    queued job able to finish.  At exit the threads are also joined (module docstring)."""
    with _registry_lock:
        key = next(_owner_keys)
        _owners[key] = (wake, list(executors))
    finalizer = weakref.finalize(owner, _stop_owned, key)
    finalizer.atexit = False   # _stop_all_at_exit wakes and joins instead
    return _Owned(key, finalizer)


def _stop_all_at_exit() -> None:
    """atexit: wakes every live owner, then stops and joins every engine thread still running."""
    with _registry_lock:
        keys = list(_owners)
    for key in keys:
        try:
            _stop_owned(key)
        except Exception as e:  # noqa: BLE001 - one owner's failure must not leave the others running
            print(f"roundpipe: stopping engine threads at exit: {type(e).__name__}: {e}", file=sys.stderr)
    with _registry_lock:
        executors = list(_running)
    for e in executors:
        e.stop()
    deadline = time.monotonic() + EXIT_JOIN_S
    stuck = [e.name for e in executors if not e.join(max(0.0, deadline - time.monotonic()))]
    if stuck:
        print(f"roundpipe: engine threads {stuck} did not finish within {EXIT_JOIN_S:.0f} s of interpreter exit; "
              "the process may abort while it finalizes (a layer or step that never returns?)", file=sys.stderr)


def _forget_after_fork() -> None:
    """In a forked child none of these threads exists (and the lock may have been held)."""
    global _registry_lock
    _registry_lock = threading.RLock()
    _running.clear()
    _owners.clear()


# Registered at import, i.e. before any user atexit handler that uses a RoundPipe: those run first.
atexit.register(_stop_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def register_then_queue(register: Callable[[], Any], queue: Callable[[Any], None]) -> None:
    """register() with the protocol, then queue(its record), with Ctrl-C held back in between.

    A KeyboardInterrupt between the two would leave the protocol waiting for a job that never
    runs, and every later call waiting for it.  On the main thread, with Python's default
    SIGINT handler in place, an interrupt arriving meanwhile is recorded and raised once the
    job is queued (one that was already pending may still fire before register(): harmless)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        queue(register())
        return
    hit: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    try:
        queue(register())
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hit:
        raise KeyboardInterrupt
