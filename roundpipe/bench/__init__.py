"""Packaged microbenchmarks: `roundpipe bench <name>` or `python -m roundpipe.bench.<name>`.

Every module here except the runner exposes `main(argv) -> int` and reports
through roundpipe.bench.runner.  Benchmarks that compare against peers or need a
checkout (kernels, optimizer, schedules) live in the repository's bench/ folder.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

_NOT_BENCHMARKS = {"runner"}


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_BENCHMARKS and not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = names()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: roundpipe bench <name> [--quick] [--out FILE.jsonl | DIR] [--no-save]\n\nbenchmarks: " + ", ".join(available))
        return 0
    if argv[0] not in available:
        print(f"roundpipe bench: unknown benchmark {argv[0]!r}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"roundpipe.bench.{argv[0]}").main(argv[1:]) or 0)
