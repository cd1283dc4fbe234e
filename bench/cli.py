"""The main job's speed guard: `roundpipe train --devices cpu` against `--engine torch`, side by side (issue 54).

`roundpipe train` on its built-in default (a small byte-level decoder on generated text) is what a new
user runs first, and its one-CPU-worker run once fell from 0.95-0.97x to 0.75x of the same training in
plain PyTorch without any test noticing (glibc's mmap threshold, fixed at 1 MiB for every CPU worker:
each 1-6 MiB activation became a fresh mapping, its pages faulted in every step).  This program runs the
two engines alternately, each in a fresh process (`roundpipe train --devices cpu --steps N
--eval-batches 0 [--engine torch]`), --pairs times, the order reversed every other pair, and reads the
tokens/s each prints.  The table gives each pair's ratio (roundpipe / torch), their median, and the last
committed row's median beside it, so a regression shows as the gap between the two.

    python bench/cli.py [--pairs 7] [--steps 100] [--out bench/results] [--no-save]

Seven pairs (about 4 minutes): single pairs spread 0.86-1.14 on the 2-core VM, the spread being per process,
and medians of 5 pairs of the same engine code came out 0.895 and 0.932 (7-9 pairs: 0.952 and 0.989), so a
median of 3 would hide a regression of 5%.

Timed assertions do not belong in tests; the closing note of a change to the engine's hot path quotes
this program's line.  Say the load: /proc/loadavg is read before and after and kept with the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402

NAME = "cli"
ENGINES = ("roundpipe", "torch")
COMMITTED = Path(__file__).resolve().parent / "results" / f"{NAME}.jsonl"   # the rows in the repository
TOKENS = re.compile(r"([\d,]+) tokens/s")


def tokens_per_s(engine: str, steps: int) -> float:
    """Runs `roundpipe train` once in a fresh process and returns the tokens/s it printed."""
    cmd = [sys.executable, "-m", "roundpipe", "train", "--devices", "cpu", "--steps", str(steps),
           "--eval-batches", "0"] + (["--engine", "torch"] if engine == "torch" else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}   # glibc's defaults, as a user has
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = TOKENS.findall(out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return float(found[-1].replace(",", ""))


def last_committed(path: Path) -> dict | None:
    """The last committed median row of this table, or None."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("pair") == "median"]
    return rows[-1] if rows else None


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7, help="alternated runs of each engine (default 7)")
    parser.add_argument("--steps", type=int, default=100, help="training steps of each run (default 100)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps = 1, 20
    if args.pairs < 1 or args.steps < 1:
        parser.error(f"--pairs={args.pairs} and --steps={args.steps} must be >= 1")
    before = last_committed(COMMITTED)
    report = Report(NAME, columns=["pair", "roundpipe tok/s", "torch tok/s", "ratio", "last committed ratio"],
                    device="cpu")
    load_before, ratios = load(), []
    for i in range(args.pairs):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        got = {e: tokens_per_s(e, args.steps) for e in order}
        ratios.append(got["roundpipe"] / got["torch"])
        report.add(pair=str(i + 1), **{"roundpipe tok/s": got["roundpipe"], "torch tok/s": got["torch"],
                                       "ratio": ratios[-1], "last committed ratio": ""})
    report.add(pair="median", **{"roundpipe tok/s": "", "torch tok/s": "", "ratio": statistics.median(ratios),
                                 "last committed ratio": before["ratio"] if before else "none"})
    report.note(f"`roundpipe train --devices cpu --steps {args.steps} --eval-batches 0` against the same with "
                f"--engine torch, each run a fresh process with glibc's defaults, {args.pairs} pairs alternated; "
                f"ratio = roundpipe / torch tokens/s; load average {load_before} before, {load()} after"
                + (f"; last committed: {before['commit']} on {before['date'][:10]}" if before else ""))
    report.finish(args.out, save=not args.no_save)


if __name__ == "__main__":
    main()
