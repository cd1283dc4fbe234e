"""`SerialExecutor`: one daemon thread running submitted jobs in order.

The engine's threads are all this shape: each worker's driver thread, the host
thread of the optimizer protocol (G-copies, steps, P-copies) and a CUDA
worker's completion thread (waits for a copy's event, then lands it).  A job's
exception is kept (the first one) and re-raised by `raise_error()` or
`wait_idle(raise_errors=True)` on the caller's thread, so it reaches the user
with its own type; later jobs still run.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from roundpipe.async_step import Aborted

_local = threading.local()   # .name: the engine thread's name, on engine threads only


def engine_thread() -> str | None:
    """The name of the engine thread the caller runs on (a layer, a loss_fn), or None."""
    return getattr(_local, "name", None)


class SerialExecutor:
    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        _local.name = self._thread.name
        while True:
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
        self._q.put(None)

    def close(self) -> None:
        self.stop()
        self._thread.join()
