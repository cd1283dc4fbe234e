"""The shared benchmark runner: timing, table, JSON rows with their provenance."""
import json
import subprocess

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


def test_out_path_file_folder_and_default(tmp_path, monkeypatch):
    """--out FILE.jsonl is the file, any other --out a folder of <name>.jsonl; the default is
    $ROUNDPIPE_BENCH_OUT, else ./roundpipe-bench-results."""
    assert runner.out_path("x", tmp_path / "r.jsonl") == tmp_path / "r.jsonl"
    assert runner.out_path("x", tmp_path / "dir") == tmp_path / "dir" / "x.jsonl"
    assert runner.out_path("x", "bench/results") == runner.Path("bench/results/x.jsonl")
    monkeypatch.delenv("ROUNDPIPE_BENCH_OUT", raising=False)
    assert runner.out_path("x") == runner.Path("roundpipe-bench-results/x.jsonl")
    monkeypatch.setenv("ROUNDPIPE_BENCH_OUT", str(tmp_path / "env"))
    report = runner.Report("demo", device="cpu")
    report.add(case="a", ms=1.0)
    assert report.save() == tmp_path / "env" / "demo.jsonl" and (tmp_path / "env" / "demo.jsonl").exists()


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=runner.REPO_ROOT, capture_output=True, text=True, timeout=30)


def test_default_run_leaves_checkout_clean(monkeypatch, capsys):
    """A quick run of a benchmark with no --out, from the top of a checkout, changes nothing git sees."""
    try:
        if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
            pytest.skip("not a git checkout")
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is not available")
    from roundpipe.bench import convert

    monkeypatch.chdir(runner.REPO_ROOT)
    monkeypatch.delenv("ROUNDPIPE_BENCH_OUT", raising=False)
    target = runner.REPO_ROOT / runner.out_path("convert")
    existed = target.parent.exists()
    size = target.stat().st_size if target.exists() else None
    before = set(_git("status", "--porcelain", "--untracked-files=all").stdout.splitlines())
    try:
        assert convert.main(["--quick", "--elements", "65536"]) == 0
        assert f"rows appended to {runner.out_path('convert')}" in capsys.readouterr().out
        after = set(_git("status", "--porcelain", "--untracked-files=all").stdout.splitlines())
        # Other files may change meanwhile in a shared checkout; no result file may appear.
        assert not [line for line in after - before if line.endswith(".jsonl") or runner.DEFAULT_OUT in line]
        assert _git("check-ignore", "-q", str(target)).returncode == 0
    finally:
        if size is None:
            target.unlink(missing_ok=True)
        else:
            with target.open("r+b") as f:
                f.truncate(size)
        if not existed:
            target.parent.rmdir()
