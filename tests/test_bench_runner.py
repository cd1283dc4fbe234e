"""The shared benchmark runner: timing, table, JSON rows with their provenance."""
import json

import pytest

from roundpipe.bench import runner


def test_report_prints_table_and_appends_rows(tmp_path, capsys):
    """Rows are printed as a table and appended as JSON lines carrying device, CPU, commit and date."""
    out = tmp_path / "r.jsonl"
    for rep in range(2):
        report = runner.Report("demo", columns=["case", "ms"], device="cpu")
        report.add(case="a", ms=1.5)
        report.add(case="b", ms=0.25)
        report.note("unit test")
        report.finish(str(out))
    printed = capsys.readouterr().out
    assert "== demo | cpu: " in printed and "note: unit test" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for key in ("device", "cpu", "commit", "date", "torch", "roundpipe", "simd"):
        assert rows[0][key], key
    assert rows[0]["device"].startswith("cpu: ") and rows[1]["case"] == "b" and rows[1]["ms"] == 0.25


def test_median_time_measures_calls():
    """median_time returns the median seconds of one call and runs warmup + repeat calls."""
    calls = []
    t = runner.median_time(lambda: calls.append(1), warmup=2, repeat=5)
    assert len(calls) == 7 and 0 <= t < 0.01
    with pytest.raises(ValueError, match="repeat=0"):
        runner.median_time(lambda: None, repeat=0)


def test_report_rejects_bad_names():
    """A benchmark name must be identifier-like (it becomes a file name)."""
    with pytest.raises(ValueError, match="name='../x'"):
        runner.Report("../x")


def test_convert_benchmark_runs_quick(tmp_path):
    """The packaged smoke benchmark runs end to end and writes rows comparing against torch."""
    from roundpipe.bench import convert

    out = tmp_path / "c.jsonl"
    assert convert.main(["--elements", "100000", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    providers = {r["provider"] for r in rows}
    assert "torch" in providers and "torch copy (limit)" in providers
    assert all(r["GB/s"] > 0 for r in rows)
