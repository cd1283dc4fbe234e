"""Argument checks shared by every floor: the messages users read when a number is wrong.

A bool is an int to Python but never a count or a size to us: `is_int` says "an int and not
a bool", the test behind most inline checks.  The check_* functions raise with the argument's
name and value and return the value converted, so a caller validates and reads in one line.
"""
from __future__ import annotations

import math


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(name: str, value: object, *, positive: bool = False, finite: bool = False,
                 unit: str = "") -> float:
    """float(value); ValueError naming `name` unless a number > 0 (positive) or >= 0, finite if asked.
    `unit` ends the message (" (seconds)")."""
    ok = is_number(value) and (value > 0 if positive else value >= 0) and not (finite and math.isinf(value))
    if not ok:
        raise ValueError(f"{name}={value!r} must be a {'finite ' if finite else ''}number "
                         f"{'> 0' if positive else '>= 0'}{unit}")
    return float(value)


def check_int(name: str, value: object, minimum: int) -> int:
    """value; TypeError naming `name` unless an int (not a bool), ValueError if below `minimum`."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return value
