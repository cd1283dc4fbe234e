"""The one runner every benchmark uses: timing, an aligned table, JSON rows.

A benchmark builds a `Report`, adds one row per (case, provider) measurement,
prints the table and appends the rows as JSON Lines.  Every row carries the
environment it was measured in (device, CPU model, commit, date, versions), so
results committed under bench/results/ say where they came from.

    report = Report("convert", columns=["case", "provider", "ms", "GB/s", "% of copy"])
    t = median_time(lambda: fn(x))
    report.add(case="fp32->bf16 64M", provider="roundpipe", ms=t * 1e3, ...)
    report.finish(args.out)         # prints the table, appends JSON rows

Where rows go (`--out`): a path ending in ".jsonl" is the file itself; any other
path is a folder that gets one <name>.jsonl per benchmark.  Without `--out` the
folder is $ROUNDPIPE_BENCH_OUT, else ./roundpipe-bench-results in the current
directory (git-ignored), so a run never touches the committed rows; a maintainer
adds rows to those with `--out bench/results`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "roundpipe-bench-results"


def default_out_dir() -> Path:
    """$ROUNDPIPE_BENCH_OUT, else ./roundpipe-bench-results (relative to the current directory)."""
    return Path(os.environ.get("ROUNDPIPE_BENCH_OUT") or DEFAULT_OUT)


def out_path(name: str, out: str | os.PathLike | None = None) -> Path:
    """The JSON Lines file for benchmark `name`: `out` itself when it ends in .jsonl, else
    <out>/<name>.jsonl, with `out` defaulting to `default_out_dir()`."""
    target = Path(out) if out else default_out_dir()
    return target if target.suffix == ".jsonl" else target / f"{name}.jsonl"


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def commit() -> str:
    """Short commit of the source tree (with '-dirty'), ROUNDPIPE_COMMIT, or 'unknown'."""
    if os.environ.get("ROUNDPIPE_COMMIT"):
        return os.environ["ROUNDPIPE_COMMIT"]
    try:
        run = functools.partial(subprocess.run, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        head = run(["git", "rev-parse", "--short=10", "HEAD"])
        if head.returncode != 0:
            return "unknown"
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' for a CUDA device, else 'cpu: <model>'."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu: {cpu_model()}"


def environment(device: str | None = None) -> dict[str, Any]:
    import torch

    from roundpipe import __version__, _native

    return {
        "device": device_name(device),
        "cpu": cpu_model(),
        "cpu_threads": os.cpu_count(),
        "commit": commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "roundpipe": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "simd": _native.simd_level(),
    }


def median_time(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 7,
                sync: Callable[[], Any] | None = None, min_time: float = 0.0) -> float:
    """Median seconds of one call of `fn` over `repeat` timed calls after `warmup`.

    `sync` (e.g. torch.cuda.synchronize) runs before each clock read; with
    `min_time`, each timed sample loops `fn` until that many seconds pass.
    """
    if repeat < 1:
        raise ValueError(f"repeat={repeat} must be >= 1")
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeat):
        calls = 0
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            if sync:
                sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e6:
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return f"{value:.3g}"
    return str(value)


class Report:
    """Rows of one benchmark run: printed as a table, appended as JSON Lines."""

    def __init__(self, name: str, columns: Iterable[str] | None = None, device: str | None = None):
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name={name!r} must be a non-empty identifier-like string")
        self.name = name
        self.columns = list(columns) if columns is not None else None
        self.env = environment(device)
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        """A line printed under the table and stored with the rows (e.g. 'no GPU: host backend only')."""
        self.notes.append(text)

    def table(self) -> str:
        cols = self.columns or list(dict.fromkeys(k for r in self.rows for k in r))
        cells = [[_fmt(r.get(c, "")) for c in cols] for r in self.rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
        line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
        out = [f"== {self.name} | {self.env['device']} | commit {self.env['commit']} | {self.env['date']}",
               line(cols), line(["-" * w for w in widths])]
        out += [line(r) for r in cells]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Appends one JSON object per row (row fields + environment) to `out_path(name, path)`."""
        target = out_path(self.name, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as f:
            for row in self.rows:
                f.write(json.dumps({"bench": self.name, **self.env, "notes": self.notes, **row}) + "\n")
        return target

    def finish(self, out: str | None = None, *, save: bool = True) -> None:
        print(self.table())
        if save and self.rows:
            print(f"rows appended to {self.save(out)}")
        sys.stdout.flush()


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (under a minute)")
    parser.add_argument("--out", default=None, help="where rows are appended: a FILE.jsonl, or a folder that gets "
                        f"<name>.jsonl per table (default: $ROUNDPIPE_BENCH_OUT or ./{DEFAULT_OUT}; "
                        "bench/results holds the committed rows)")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
