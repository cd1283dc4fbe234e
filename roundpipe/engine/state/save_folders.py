"""A checkpoint save's temporary folder, and what a save killed mid-way leaves of it.

`save_checkpoint` (checkpoint.py) writes into a folder beside its target and swaps it into place with
two renames; `clean_crashed` removes what a killed save left, only once its writer is dead:

      .<name>.tmp-<pid>   one process's save (.<name>.tmp: a data-parallel one, written by every rank)
        .writer.json        {"host", "pid"} of the process that made it (rank 0's)
        .replaced/          the checkpoint it replaces, from the first rename until it is removed

A save renames <name> into .replaced, the folder to <name>, then removes .replaced and the owner
file.  Killed before the first rename, the folder is junk; between the renames, <name> is missing
and .replaced goes back (the save never returned, so the old checkpoint stands); after, only
.replaced and .writer.json inside <name> are left.  clean_crashed removes these once the writer
is dead: on this host (its owner file's host; without one, a writer killed before writing it,
the pid in the folder's name) and not a live pid (os.kill(pid, 0)), so a save in progress, here or
on another host sharing the filesystem, is never touched.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat

from roundpipe.core.checks import is_int

OWNER = ".writer.json"      # in a save's temporary folder: who writes it (clean_crashed, below)
REPLACED = ".replaced"      # in a save's temporary folder: the checkpoint it replaces, during the swap


def _pid_dead(pid: int) -> bool:
    """No process has this pid (os.kill(pid, 0) -> ProcessLookupError); one we may not signal lives."""
    if os.name == "nt":   # os.kill there terminates the process: nothing is judged dead
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):   # PermissionError: another user's process
        return False
    return False


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def write_owner(folder: str) -> None:
    with open(os.path.join(folder, OWNER), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)


def _owner(folder: str) -> tuple[str, int] | None:
    """(host, pid) from a folder's owner file, None without a readable one (a link is not read)."""
    try:
        fd = os.open(os.path.join(folder, OWNER), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |
                     getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            got = json.loads(f.read(4096)) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(got, dict) and isinstance(got.get("host"), str) and is_int(got.get("pid")) and got["pid"] > 0:
        return got["host"], got["pid"]
    return None


def _crashed(folder: str, name_pid: int | None) -> bool:
    """The process that wrote `folder` is dead (see above); False whenever that cannot be told."""
    owner = _owner(folder)
    if owner is not None:
        host, pid = owner
        if host != socket.gethostname() or (name_pid is not None and pid != name_pid):
            return False
    elif name_pid is None:
        return False
    else:
        pid = name_pid
    return pid != os.getpid() and _pid_dead(pid)


def discard(folder: str, path: str) -> None:
    """Removes a save's temporary folder, first putting back the checkpoint it was replacing."""
    replaced = os.path.join(folder, REPLACED)
    if os.path.lexists(replaced) and not os.path.lexists(path):
        try:
            os.rename(replaced, path)
        except OSError:
            return   # left whole: it holds the only copy of the old checkpoint
    shutil.rmtree(folder, ignore_errors=True)


def replace(tmp: str, path: str) -> None:
    """Moves the finished folder to `path`, replacing what is there (the two renames above)."""
    if os.path.lexists(path):
        os.rename(path, os.path.join(tmp, REPLACED))
    os.rename(tmp, path)
    _remove_leftovers(path)


def _remove_leftovers(path: str) -> None:
    replaced = os.path.join(path, REPLACED)
    if _is_dir(replaced):
        shutil.rmtree(replaced, ignore_errors=True)
    with contextlib.suppress(OSError):
        if os.path.lexists(replaced):
            os.remove(replaced)   # a link that stood at the path
        os.remove(os.path.join(path, OWNER))


def clean_crashed(path: str) -> None:
    """Removes what saves of `path` killed mid-way left beside and inside it; only the exact names
    above, only real folders (never through a link), only when their writer is dead.  Errors are
    ignored: cleaning up never fails a save or a load."""
    parent, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp(?:-([1-9][0-9]{{0,9}}))?")
    try:
        entries = [e for e in os.scandir(parent) if pattern.fullmatch(e.name)]
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            name_pid = pattern.fullmatch(entry.name).group(1)
            if entry.is_dir(follow_symlinks=False) and _crashed(entry.path, int(name_pid) if name_pid else None):
                discard(entry.path, path)
    with contextlib.suppress(OSError):
        if _is_dir(path) and _crashed(path, None):
            _remove_leftovers(path)
