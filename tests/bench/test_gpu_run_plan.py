"""The GPU benchmark's run plan (bench/gpu_plan.py) and its saving (bench/gpu_store.py): two device calls of at
most 5 minutes with the key rows first, and rows that survive a kill at any instant."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402
import gpu_plan  # noqa: E402
from gpu_store import ARCHIVE, JSONL, TABLE, Store  # noqa: E402

from roundpipe.bench.runner import Report  # noqa: E402

KEY_ROWS = [("ours-sync", "24GiB"), ("ours-async", "24GiB"), ("torch", "full"), ("torch-ckpt", "full"),
            ("roundpipe-0.1.1", "24GiB")]


def table_rows(text: str) -> list[list[str]]:
    """The data lines of table.txt (after the title, the header and the rule; before the notes), split."""
    lines = text.splitlines()
    assert lines[0].startswith("== gpu_bench |") and set(lines[2].replace(" ", "")) == {"-"}, text[:500]
    return [line.split() for line in lines[3:] if not line.startswith("note: ")]


def test_key_rows_come_first_in_call_one():
    """Call 1 holds ours sync/async at 24 GiB, plain PyTorch on the full card with and without checkpointing and
    the published RoundPipe, in that order, before any call-2 case; the dry plan is the same list."""
    full = gpu_plan.plan(False, 24 * gpu_plan.GiB, 100.0)
    dry = gpu_plan.plan(True, 24 * gpu_plan.GiB, 60.0)
    assert [(c.provider, c.cap is None, c.call) for c in full] == [(c.provider, c.cap is None, c.call) for c in dry]
    calls = [c.call for c in full]
    assert calls == sorted(calls) and set(calls) == {1, 2}
    first = [(c.provider, gpu_plan.cap_label(c.cap)) for c in full if c.call == 1]
    assert [k for k in first if k in KEY_ROWS] == KEY_ROWS
    second = {c.provider for c in full if c.call == 2}
    assert {"fsdp2-offload", "deepspeed-zero-offload", "ours-maxseq", "ours-device"} <= second


def test_each_call_fits_five_minutes_with_default_overheads():
    """The estimate of each call, without measurements (8 s a process), stays within the 5-minute share."""
    calls = gpu_plan.expected_seconds(gpu_plan.plan(False, 24 * gpu_plan.GiB, 100.0), {})
    for call, t in calls.items():
        assert 0 < t["total"] <= gpu_plan.CALL_LIMIT_S, (call, t)
    assert calls[1]["prepare"] > calls[2]["prepare"] > 0


def test_estimate_fails_when_a_call_would_pass_the_limit(tmp_path, capsys):
    """A dry run whose measured process overheads put a call past 5 minutes makes the estimate exit 1."""
    rows = [{"workload": "tiny-qwen3", "provider": p, "cap": "24GiB", "overhead cpu s": 200.0}
            for p in ("ours-sync", "ours-async")]
    (tmp_path / JSONL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_bench.main(["--dry", "--estimate", "--out", str(tmp_path)]) == 1
    assert "call 1: expected" in capsys.readouterr().out
    (tmp_path / JSONL).write_text("")
    assert gpu_bench.main(["--dry", "--estimate", "--out", str(tmp_path)]) == 0


def test_host_available_override(monkeypatch):
    """ROUNDPIPE_HOST_AVAILABLE_GIB replaces MemAvailable in the fit checks; a non-number names the variable."""
    monkeypatch.setenv("ROUNDPIPE_HOST_AVAILABLE_GIB", "120")
    assert gpu_bench.host_available() == 120 * gpu_plan.GiB
    monkeypatch.setenv("ROUNDPIPE_HOST_AVAILABLE_GIB", "lots")
    with pytest.raises(ValueError, match="ROUNDPIPE_HOST_AVAILABLE_GIB"):
        gpu_bench.host_available()


def test_store_saves_each_row_and_keeps_an_earlier_calls_rows(tmp_path):
    """Each add appends a jsonl line and rewrites the table, the archive and the mirror's copies; a second store
    on the same folder (call 2) starts from call 1's rows, drops a line a kill cut short, and finish keeps one
    row per key with its ratios."""
    out, mirror = tmp_path / "out", tmp_path / "mirror"
    report = Report("gpu_bench", columns=["workload", "provider", "cap", "tokens/s", "vs torch", "status"])
    order = [("w", "torch", "full"), ("w", "ours-sync", "24GiB")]
    store = Store(out, report, order, gpu_plan.PEERS, mirror)
    (out / "logs" / "one.log").write_text("a provider's log\n")
    store.add({"workload": "w", "provider": "ours-sync", "cap": "24GiB", "tokens/s": 50.0, "status": "ok"})
    for folder in (out, mirror):
        assert [json.loads(x)["provider"] for x in (folder / JSONL).read_text().splitlines()] == ["ours-sync"]
        assert [r[1] for r in table_rows((folder / TABLE).read_text())] == ["ours-sync"]
        with tarfile.open(folder / ARCHIVE) as tar:
            assert "logs/one.log" in tar.getnames()
    with (out / JSONL).open("a") as f:
        f.write('{"workload": "w", "provider": "tor')   # a kill in the middle of an append
    later = Store(out, report, order, gpu_plan.PEERS, mirror)
    later.add({"workload": "w", "provider": "torch", "cap": "full", "tokens/s": 100.0, "status": "ok"})
    later.add({"workload": "w", "provider": "ours-sync", "cap": "24GiB", "tokens/s": 60.0, "status": "ok"})
    assert [r[1] for r in table_rows((mirror / TABLE).read_text())] == ["torch", "ours-sync"]
    later.finish()
    rows = [json.loads(x) for x in (out / JSONL).read_text().splitlines()]
    assert [(r["provider"], r["tokens/s"], r["vs torch"]) for r in rows] == [("torch", 100.0, 1.0),
                                                                              ("ours-sync", 60.0, 0.6)]
    assert (mirror / JSONL).read_text() == (out / JSONL).read_text()


def test_merge_puts_both_calls_rows_in_one_table(tmp_path):
    """--merge of the two calls' jsonl (call 2 on a fresh machine) gives one table in the plan's order, titled
    with the rows' own device, and ratios across the calls; it writes no logs archive (the calls' are kept)."""
    def row(provider, cap, tps, call):
        return {"bench": "gpu_bench", "device": "NVIDIA H100 80GB HBM3", "commit": "abc", "date": "2026-12-07",
                "workload": "qwen3-1.7b", "provider": provider, "cap": cap, "call": call, "tokens/s": tps,
                "status": "ok"}

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text(json.dumps(row("ours-sync", "24GiB", 4000.0, 1)) + "\n" + json.dumps(row("torch", "full", 20000.0, 1)) + "\n")
    two.write_text(json.dumps(row("fsdp2-offload", "24GiB", 1000.0, 2)) + "\n")
    out = tmp_path / "merged"
    assert gpu_bench.main(["--merge", str(one), str(two), "--out", str(out)]) == 0
    text = (out / TABLE).read_text()
    assert text.startswith("== gpu_bench | NVIDIA H100 80GB HBM3 | commit abc")
    assert [r[1] for r in table_rows(text)] == ["ours-sync", "torch", "fsdp2-offload"]
    rows = {r["provider"]: r for r in map(json.loads, (out / JSONL).read_text().splitlines())}
    assert rows["ours-sync"]["vs torch"] == 0.2 and rows["ours-sync"]["vs best peer"] == 4.0
    assert not (out / ARCHIVE).exists()


@pytest.mark.slow
def test_a_call_killed_mid_row_leaves_a_valid_jsonl_and_table(tmp_path):
    """gpu-bench.sh --dry (the project's .venv by default) killed with SIGKILL while its second row runs: the
    first row is in the jsonl and the table, in the folder and in the mirror, and the logs' archive opens."""
    out, mirror = tmp_path / "out", tmp_path / "mirror"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PEERS"] = str(tmp_path / "peers")
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu-bench.sh"), "--dry", "--call", "1", "--prepare", "no",
                             "--jobs", "1", "--only", "ours-sync,ours-async", "--out", str(out), "--mirror", str(mirror)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    second = out / "logs" / "tiny-qwen3_ours-async_24GiB.log"
    try:
        deadline = time.monotonic() + 180
        while not second.is_file() and proc.poll() is None:   # created as its process starts
            assert time.monotonic() < deadline, "the second row never started"
            time.sleep(0.1)
        time.sleep(0.5)   # inside the row: its process takes seconds to import torch alone
        assert proc.poll() is None, "the run ended before it could be killed mid-row"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for folder in (out, mirror):
        rows = [json.loads(line) for line in (folder / JSONL).read_text().splitlines()]
        assert [(r["provider"], r["status"]) for r in rows] == [("ours-sync", "ok")], rows
        assert rows[0]["tokens_per_s"] > 0
        venv = REPO / ".venv" / "bin" / "python"
        if venv.exists():   # --dry without PYTHON runs the project's environment
            assert Path(rows[0]["python_executable"]) == Path(os.path.abspath(venv)), rows[0]["python_executable"]
        assert [r[:3] for r in table_rows((folder / TABLE).read_text())] == [["tiny-qwen3", "ours-sync", "24GiB"]]
        with tarfile.open(folder / ARCHIVE) as tar:
            assert "logs/tiny-qwen3_ours-sync_24GiB.log" in tar.getnames()


def test_the_flux_lora_rows_run_in_call_two_without_diffusers_in_the_plan(monkeypatch):
    """A Flux-shaped LoRA pair at 24 GiB: diffusers with per-module CPU offload ends call 1, ours runs in call 2
    before ours' full-card row; their parameter counts (kept in the plan, which never imports diffusers) are what
    diffusers builds; where diffusers is not installed (the GPU image) the rows say so instead of failing."""
    full = gpu_plan.plan(False, 24 * gpu_plan.GiB, 100.0)
    flux = [c for c in full if gpu_plan.is_dit(c)]
    assert [(c.provider, c.call, gpu_plan.cap_label(c.cap)) for c in flux] == [
        ("diffusers-offload", 1, "24GiB"), ("ours-async", 2, "24GiB")]
    assert [c for c in full if c.call == 1][-1] == flux[0] and full[-2] == flux[1]
    assert full[-1].provider == "ours-async" and full[-1].cap is None
    pytest.importorskip("diffusers")
    for shape in (gpu_plan.FLUX_SMALL, gpu_plan.FLUX_TINY):
        assert gpu_plan.DIT_PARAMETERS[shape.key] == shape.parameters()
    monkeypatch.setattr(gpu_plan.importlib.util, "find_spec", lambda name: None)
    assert "diffusers is absent" in gpu_plan.static_skip(flux[1], False, 128 * gpu_plan.GiB)
    assert gpu_plan.static_skip(flux[1], True, 128 * gpu_plan.GiB) is None   # dry: this machine's diffusers
