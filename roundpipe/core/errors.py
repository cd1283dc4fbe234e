"""Errors the engine's threads share.

`Aborted` is the one exception every blocking wait (a hand-off board, a layer's step
event, a fence) raises when the call it serves was aborted by an error elsewhere; it sits
below every floor that waits, so a wait never imports the protocol that aborts it.
`RoundPipeStalled` is what a caller's wait raises when the engine made no progress for too long
(roundpipe/engine/calls/dispatcher.py, the stall watchdog).
"""
from __future__ import annotations


class Aborted(Exception):
    """Internal: a wait gave up because the call was aborted."""


class RoundPipeStalled(RuntimeError):
    """A worker made no progress for `stall_timeout` seconds (EngineConfig.stall_timeout).

    Raised in the caller instead of waiting forever: the message names the stuck worker, its stage,
    microbatch and what it waits for, and holds every engine thread's stack.  A thread that never
    returns cannot be stopped, so the RoundPipe that raised it takes no more work: close it (close()
    does not wait for the stuck worker) and build a new one."""
