"""bench/cli.py, the main job's speed guard: one real run of each engine at a few steps, the table's pairs and
median, and the last committed row beside it (no timings checked)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cli  # noqa: E402

pytestmark = pytest.mark.slow


def test_one_pair_fills_the_table_beside_the_last_committed_row(tmp_path, monkeypatch, capsys):
    committed = tmp_path / "committed.jsonl"
    committed.write_text("\n".join(json.dumps(r) for r in [
        {"pair": "1", "ratio": 0.5, "commit": "a", "date": "2026-12-01T00:00:00"},
        {"pair": "median", "ratio": 0.91, "commit": "b", "date": "2026-12-02T00:00:00"},
        {"pair": "1", "ratio": 0.7, "commit": "c", "date": "2026-12-03T00:00:00"}]) + "\n")
    monkeypatch.setattr(cli, "COMMITTED", committed)
    out = tmp_path / "rows.jsonl"
    cli.main(["--pairs", "1", "--steps", "3", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["pair"] for r in rows] == ["1", "median"]
    assert rows[0]["roundpipe tok/s"] > 0 and rows[0]["torch tok/s"] > 0
    assert rows[1]["ratio"] == pytest.approx(rows[0]["roundpipe tok/s"] / rows[0]["torch tok/s"])
    assert rows[1]["last committed ratio"] == 0.91   # the last median row, not the last row
    assert "last committed: b on 2026-12-02" in capsys.readouterr().out


def test_a_failing_run_names_the_command(monkeypatch):
    monkeypatch.setattr(cli.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="roundpipe train --devices cpu --steps 2"):
        cli.tokens_per_s("torch", 2)


def test_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--pairs", "0", "--no-save"])
    assert "--pairs=0" in capsys.readouterr().err
