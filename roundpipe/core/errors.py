"""Errors the engine's threads share.

`Aborted` is the one exception every blocking wait (a hand-off board, a layer's step
event, a fence) raises when the call it serves was aborted by an error elsewhere; it sits
below every floor that waits, so a wait never imports the protocol that aborts it.
"""
from __future__ import annotations


class Aborted(Exception):
    """Internal: a wait gave up because the call was aborted."""
