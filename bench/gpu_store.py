"""Where the GPU benchmark's rows go: saved as each one finishes, so a killed call still returns its table.

A device call that runs past its limit is killed with everything it started, and only the files under
$OUT come back (at most 8).  So every row is appended to `gpu_bench.jsonl` (flushed and fsynced) the moment
it exists, and `table.txt` and `logs.tar.gz` (every provider's log in one archive) are rewritten beside it,
each through a temporary file and `os.replace`: a kill at any instant leaves the previous whole file or the
new whole file, never half of one.  `mirror` (the call's $OUT folder) gets a copy of the three after each
row the same way; `out` itself may lie outside $OUT (/tmp on the device) so that the second call on a warm
machine finds the first call's rows and its table holds both.

The jsonl is append-only while the call runs (the ratio columns of a row appended early are empty: the
rows they compare with came later); `finish` rewrites it once with every ratio filled.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tarfile
import threading
from pathlib import Path

from roundpipe.bench.runner import Report

COLUMNS = ["workload", "provider", "cap", "batch x seq", "tokens/s", "exposed step s", "kernels", "kept layers",
           "kept graphs",
           "vs torch", "vs best peer", "first loss", "final loss", "max seq", "device peak GB", "peak RSS GB",
           "overhead s", "s", "status"]
JSONL, TABLE, ARCHIVE = "gpu_bench.jsonl", "table.txt", "logs.tar.gz"


def row_key(row: dict) -> tuple:
    return (row.get("workload"), row.get("provider"), row.get("cap"))


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def add_ratios(rows: list[dict], peers: tuple[str, ...]) -> None:
    """`vs torch` (plain PyTorch on the same workload and cap, else on the full card) and `vs best peer`."""
    def tps(r):
        return r.get("tokens/s") if finite(r.get("tokens/s")) else None

    for r in rows:
        r["vs torch"] = r["vs best peer"] = None
        if tps(r) is None or r["provider"] in ("ours-maxseq", "ours-predicted"):
            continue
        same = [x for x in rows if x["workload"] == r["workload"] and tps(x)]
        torch = ([x for x in same if x["provider"] == "torch" and x["cap"] == r["cap"]]
                 or [x for x in same if x["provider"] == "torch" and x["cap"] == "full"])
        best = [tps(x) for x in same if x["provider"] in peers and x["cap"] == r["cap"]]
        r["vs torch"] = tps(r) / tps(torch[0]) if torch else None
        r["vs best peer"] = tps(r) / max(best) if best else None


def replace_atomically(path: Path, write) -> None:
    """write(tmp_path), then rename over `path`: readers see the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


class Store:
    """The rows of the run so far (earlier calls' rows loaded from `out`), saved after every addition."""

    def __init__(self, out: Path, report: Report, order: list[tuple], peers: tuple[str, ...],
                 mirror: Path | None = None, archive: bool = True):
        """`report` gives the table's format, the environment every row carries and the notes under the table;
        archive=False writes no logs.tar.gz (a merge of rows whose logs are archived already)."""
        self.out, self.mirror, self.order, self.peers, self.archive = out, mirror, order, peers, archive
        self.report, self.env = report, report.env
        self.lock = threading.Lock()
        (out / "logs").mkdir(parents=True, exist_ok=True)
        if mirror:
            mirror.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if (out / JSONL).is_file():   # an earlier call's rows (a line cut by a kill is dropped)
            for line in (out / JSONL).read_text().splitlines():
                try:
                    self.rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.save_derived()

    def add(self, row: dict) -> None:
        full = {"bench": "gpu_bench", **self.env, **row}
        with self.lock:
            self.rows.append(full)
            with (self.out / JSONL).open("a") as f:
                f.write(json.dumps(full) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.save_derived()

    def current(self) -> list[dict]:
        """One row per (workload, provider, cap), the latest, in the plan's order (prepare steps first)."""
        latest: dict[tuple, dict] = {}
        for r in self.rows:
            latest.pop(row_key(r), None)
            latest[row_key(r)] = dict(r)
        place = {k: i for i, k in enumerate(self.order)}
        rows = sorted(latest.values(), key=lambda r: (r.get("workload") != "prepare",
                                                      place.get(row_key(r), len(place))))
        add_ratios(rows, self.peers)
        return rows

    def table(self) -> str:
        self.report.rows = self.current()
        return self.report.table() + "\n"

    def save_derived(self) -> None:
        replace_atomically(self.out / TABLE, lambda p: p.write_text(self.table()))
        logs = self.out / "logs"

        def pack(p: Path) -> None:
            with tarfile.open(p, "w:gz") as tar:
                tar.add(logs, arcname="logs")

        if self.archive:
            replace_atomically(self.out / ARCHIVE, pack)
        if self.mirror and self.mirror.resolve() != self.out.resolve():
            for name in (JSONL, TABLE, ARCHIVE):
                if (self.out / name).is_file():
                    replace_atomically(self.mirror / name, lambda p, n=name: shutil.copyfile(self.out / n, p))

    def finish(self) -> str:
        """Rewrites the jsonl once, one row per key with its ratios; returns the table."""
        with self.lock:
            rows = self.current()
            replace_atomically(self.out / JSONL, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in rows)))
            self.rows = rows
            self.save_derived()
            return self.table()
