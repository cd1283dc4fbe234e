"""The shared benchmark runner: timing, table, JSON rows with their provenance."""
import json
import subprocess

import pytest

from roundpipe.bench import runner


def test_report_prints_table_and_appends_rows(tmp_path, capsys):
    """Rows are printed as a table and appended as JSON lines carrying device, CPU, commit and date."""
    out = tmp_path / "r.jsonl"
    for _rep in range(2):
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


class FakeClock:
    """perf_counter for runner: each call of `step` advances it by the next of `durations` (seconds)."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 100.0, list(durations), 0

    def perf_counter(self):
        return self.now

    def step(self):
        self.now += self.durations[self.calls]
        self.calls += 1


def test_median_time_measures_calls(monkeypatch):
    """median_time returns the median seconds of one call, untimed warmup calls left out, and with min_time
    loops each sample until that much time passed, dividing by the calls in it."""
    clock = FakeClock([50, 50] + [0.009, 0.001, 0.003, 0.002, 0.004])   # 2 warmup calls, then 5 timed
    monkeypatch.setattr(runner, "time", clock)
    t = runner.median_time(clock.step, warmup=2, repeat=5)
    assert clock.calls == 7 and t == pytest.approx(0.003)   # the median (the mean would be 0.0038)
    clock = FakeClock([0.001] * 9 + [0.004])   # min_time 2.5 ms: samples of 3, 3, 3 calls, then of 1
    monkeypatch.setattr(runner, "time", clock)
    t = runner.median_time(clock.step, warmup=0, repeat=4, min_time=0.0025)
    assert clock.calls == 10 and t == pytest.approx(0.001)   # per call: 1, 1, 1 and 4 ms
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
