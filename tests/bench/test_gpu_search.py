"""bench/gpu_search.py and its rows: the search's top follows the planner's prediction, the search keeps to its
time limit and reports the bracket it reached (also from a process killed at its limit), and the prediction's
process sees no GPU."""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_search  # noqa: E402


def test_search_bound_follows_the_prediction():
    """143,802 predicted (Qwen3-1.7B at 24 GiB): top 1.25 x that rounded up to 2048 (180,224, past the old fixed
    65,536), first probe the prediction rounded down (never below seq_min, the top at least a grain above it); no
    prediction keeps --seq-max and says so."""
    assert gpu_search.search_bound(143_802, 4096, 2048, 65536) == (180_224, 143_360, "1.25 x predicted 143802")
    assert gpu_search.search_bound(4100, 4096, 2048, 65536)[:2] == (6144, 4096)
    top, first, source = gpu_search.search_bound(None, 4096, 2048, 65536)
    assert (top, first) == (65536, None) and "no prediction" in source
    assert gpu_search.search_bound(100, 4096, 2048, 65536)[:2] == (65536, None)   # below seq_min: not a bound


def walk(lo, hi, grain, first, truth):
    probes = []
    while (t := gpu_search.next_probe(lo, hi, grain, *gpu_search.bracket(probes), first)) is not None:
        assert lo <= t <= hi and t % grain == 0 and t not in [p["t"] for p in probes]
        probes.append({"t": t, "ok": t <= truth})
    return [p["t"] for p in probes], gpu_search.bracket(probes)


@pytest.mark.parametrize("truth", [3000, 4096, 60_000, 149_000, 143_360, 10**6])
def test_bisection_brackets_the_truth_from_the_prediction(truth):
    """From the prediction as first probe, the bisection ends with the longest length that trains and the next grain
    above it failing, or hi training, or even lo failing; never probing a length twice or off the grain."""
    order, (fit, fail) = walk(4096, 180_224, 2048, 143_360, truth)
    assert order[0] == 143_360
    if truth < 4096:
        assert (fit, fail) == (None, 4096)
    elif truth >= 180_224:
        assert (fit, fail) == (180_224, None) and order == [143_360, 180_224]
    else:
        assert fit == truth // 2048 * 2048 and fail == fit + 2048


def test_bisection_without_a_prediction_starts_at_both_ends():
    """No prediction: lo first, then hi, then the middle (the search as it was, to --seq-max)."""
    order, (fit, fail) = walk(4096, 65536, 2048, None, 10_000)
    assert order[:3] == [4096, 65536, 34816] and (fit, fail) == (8192, 10240)


def test_bisect_keeps_to_its_time_limit():
    """Probes cost 2 s + forward_backward's 1.5e-9 s x tokens^2 (~31 s at 143k) on a fake clock: with 20 s the first
    probe (no estimate yet) runs and nothing after it; with 200 s the search goes on, and every probe after the first
    ends before the limit (the estimate from earlier probes bounds it)."""
    def run(budget):
        now = [0.0]

        def probe(t):
            fb = 1.5e-9 * t * t
            now[0] += 2.0 + fb
            return {"t": t, "ok": t <= 150_000, "s": 2.0 + fb, "fb_s": fb}

        probes, stopped = gpu_search.bisect(probe, 4096, 180_224, 2048, 143_360, lambda: budget - now[0])
        return probes, stopped, now[0]

    probes, stopped, spent = run(20.0)
    assert [p["t"] for p in probes] == [143_360] and stopped.startswith("time limit: 180224 not tried")
    fit, words = gpu_search.describe(probes, 4096, 180_224, stopped, "1.25 x predicted 143802")
    assert fit == 143_360 and words.startswith("fits 143360; time limit") and "top 180224: 1.25 x" in words
    probes, stopped, spent = run(200.0)
    assert len(probes) > 2 and spent <= 200.0
    fit, fail = gpu_search.bracket(probes)
    assert fit <= 150_000 < fail


def test_describe_says_when_even_the_shortest_fails():
    """A search whose every probe failed down to lo says so with the reason the probe gave."""
    probes = [{"t": 8192, "ok": False, "why": "OutOfMemoryError: x"}, {"t": 4096, "ok": False, "why": "ValueError: y"}]
    assert gpu_search.describe(probes, 4096, 8192, "", "--seq-max") == (
        0, "even 4096 does not train: ValueError: y; top 8192: --seq-max")


def test_a_search_killed_at_its_limit_still_reports_its_bracket(tmp_path, monkeypatch):
    """A search process killed at its row's limit: the row's error names the bracket from the PROBE lines printed so
    far (a line cut by the kill is left out), and its max seq is the longest that trained."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import time
        print('PROBE {"t": 143360, "ok": true, "s": 30.0, "fb_s": 28.0}', flush=True)
        print('PROBE {"t": 180224, "ok": false, "s": 1.0, "why": "ValueError: too long"}', flush=True)
        print('PROBE {"t": 161', flush=True)
        time.sleep(60)
    """))
    monkeypatch.setattr(gpu_bench, "CHILD", child)
    case = next(c for c in gpu_plan.plan(True, 2 << 20, 60.0) if c.provider == "ours-maxseq")
    args = argparse.Namespace(warmup=0, steps=1, lr=1e-4, threads=1, seq_min=32, seq_max=512, grain=32, search_s=20.0,
                              dry=True, peers=tmp_path / "peers")
    result = gpu_bench.run_case(case, args, 3.0, tmp_path / "search.log", {})
    assert "timed out after 3 s" in result["error"] and "probes done: fits 143360, not 180224" in result["error"]
    assert result["seq_len"] == 143_360 and len(result["probes"]) == 2
    row = gpu_bench.row_of(case, result, None)
    assert row["max seq"] == 143_360 and row["status"].startswith("failed: timed out")


def test_the_prediction_process_sees_no_gpu(tmp_path, monkeypatch):
    """The prediction row's process gets CUDA_VISIBLE_DEVICES="" (it runs beside the GPU rows and must open no CUDA
    context); every other row's process keeps the environment's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cases = {c.provider: c for c in gpu_plan.plan(False, 24 * gpu_plan.GiB, 100.0)}
    env, _ = gpu_bench.child_env(cases["ours-predicted"], tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    for provider in ("ours-maxseq", "ours-sync", "torch", "roundpipe-0.1.1"):
        assert gpu_bench.child_env(cases[provider], tmp_path)[0]["CUDA_VISIBLE_DEVICES"] == "0", provider


@pytest.mark.slow
def test_the_prediction_row_runs_without_cuda(tmp_path):
    """The dry prediction row, run as the benchmark runs it: its process saw CUDA_VISIBLE_DEVICES="" and had no CUDA
    context after the planner's prediction."""
    case = next(c for c in gpu_plan.plan(True, 2 << 20, 60.0) if c.provider == "ours-predicted")
    args = argparse.Namespace(warmup=0, steps=1, lr=1e-4, threads=1, seq_min=32, seq_max=512, grain=32, search_s=20.0,
                              dry=True, peers=tmp_path / "peers")
    result = gpu_bench.run_case(case, args, 240.0, tmp_path / "predicted.log", {})
    assert "error" not in result, (tmp_path / "predicted.log").read_text()[-2000:]
    assert result["seq_len"] > 0 and result["cuda_visible_devices"] == "" and result["cuda_context"] is False
