"""Values read from files the user hands us (checkpoints, offloaded state): parsed strictly, shown short.

A file may be damaged or hostile: a JSON object with a key given twice is refused rather than read
as its last value, and a value quoted in an error is cut short so that a huge string cannot make a
huge message.
"""
from __future__ import annotations


def short(value: object) -> str:
    """repr of a value from a file, cut short: a hostile string must not make a huge message."""
    r = repr(value)
    return r if len(r) <= 80 else r[:60] + f"... ({len(r)} characters)"


def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict (json's object_pairs_hook); a key given twice is a ValueError,
    not silently the last one."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {short(key)} appears twice in one object")
        seen.add(key)
    return dict(pairs)
