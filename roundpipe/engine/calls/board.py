"""The board: where stage runs leave activations, gradients and fences for each other.

Keys are small tuples: ("act", boundary, microbatch) is the input of the layer
at `boundary`, ("grad", boundary, microbatch) the gradient with respect to it,
("buf", layer, round) says that round's forward wrote the layer's buffers, ("recompute", layer,
microbatch) holds what a layer's forward saved for its recompute (recompute_data.py).  A
value is put once with the number of consumers that will `get` it and is
dropped after the last one, so host memory holds a stage input only until its
backward stage has used it.  Every wait gives up with `Aborted` as soon as the
call is aborted, so a failing worker never leaves another one blocked; the abort
also drops every value still on the board (outputs kept on a device die with the
failed call, not with the last reference to its context), and nothing is put after it.
A blocked `get` names its key for stall reports (core/executor.py, `waiting_for`).
"""
from __future__ import annotations

import threading
from typing import Any, Hashable

from roundpipe.core.errors import Aborted
from roundpipe.core.executor import waiting_for


def describe(key: Hashable) -> str:
    """A board key in words: what a stage waiting for it waits for."""
    if isinstance(key, tuple) and len(key) == 3:
        kind, at, index = key
        if kind == "act":
            return f"the input of layer {at}, microbatch {index} (another stage's output)"
        if kind == "grad":
            return f"the gradient at layer {at}, microbatch {index} (from the backward stage after it)"
        if kind == "recompute":
            return f"what layer {at}'s forward of microbatch {index} saved for its recompute (rp.save_for_recompute)"
        if kind == "buf":
            return f"layer {at}'s buffers from round {index}'s forward"
    return f"board entry {key!r}"


class Board:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: dict[Hashable, list] = {}
        self._aborted = False
        self._waiters = 0      # threads in get(): a put with none wakes nobody (saves the notify)

    def put(self, key: Hashable, value: Any, consumers: int) -> None:
        if consumers <= 0:
            return
        with self._cv:
            if self._aborted:   # nobody takes it any more
                return
            assert key not in self._items, f"{key} put twice"
            self._items[key] = [value, consumers]
            if self._waiters:
                self._cv.notify_all()

    def _take(self, key: Hashable) -> Any:
        entry = self._items[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._items[key]
        return entry[0]

    def get(self, key: Hashable) -> Any:
        with self._cv:
            if key in self._items:
                return self._take(key)
            with waiting_for(describe(key)):
                while key not in self._items:
                    if self._aborted:
                        raise Aborted()
                    self._waiters += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._waiters -= 1
            return self._take(key)

    def poll(self, key: Hashable) -> tuple[bool, Any]:
        """Like get, but returns (False, None) at once when the value is not there yet."""
        with self._cv:
            if key not in self._items:
                return False, None
            return True, self._take(key)

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            items, self._items = self._items, {}
            self._cv.notify_all()
        items.clear()   # outside the lock: the values' storages die here

    @property
    def aborted(self) -> bool:
        return self._aborted

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)
