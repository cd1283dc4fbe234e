"""scripts/gpu-bench.sh --dry: the GPU benchmark's program, run on CPU workers so it cannot rot between GPU runs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the repository root, wherever under tests/ this file lies
REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
PROVIDERS = ("ours-sync", "ours-async", "ours-device", "torch", "fsdp2-offload", "deepspeed-zero-offload",
             "roundpipe-0.1.1")


@pytest.mark.slow
def test_dry_run_has_a_row_for_every_provider(tmp_path):
    """Every provider gets a row with tokens/s and a finite loss, or a skip reason; ours and torch agree on the loss."""
    env = dict(os.environ, PYTHON=sys.executable, PEERS=str(tmp_path / "peers"))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-bench.sh"), "--dry", "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "gpu_bench.jsonl").read_text().splitlines()]
    assert {"device", "commit", "date", "torch"} <= set(rows[0])
    for provider in PROVIDERS:
        mine = [r for r in rows if r["provider"] == provider]
        assert mine, f"no row for {provider}"
        for r in mine:
            ran = r["tokens_per_s"] is not None
            if ran:
                assert r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"]), r
            else:
                assert r["reason"], f"{provider}: neither numbers nor a reason: {r}"
    first = {r["provider"]: r for r in rows if r["workload"] == "tiny-qwen3" and r["cap"] != "full"}
    for provider in ("ours-sync", "ours-async", "ours-device", "torch"):
        assert first[provider]["tokens_per_s"] > 0, first[provider]
    assert first["ours-device"]["kept layers"] > 0, first["ours-device"]   # layers stepped on the worker
    for provider in ("ours-sync", "ours-async"):   # the step's exposed seconds: >= 5 iterations each way, never < 0
        exposed = first[provider]["exposed_step"]
        assert exposed["samples"] >= 5 and exposed["seconds"] >= 0 and exposed["spread_s"] >= 0, exposed
        assert first[provider]["exposed step s"].replace("within noise", "")[:1] in " 0123456789"
    for provider in ("ours-sync", "ours-async", "ours-device"):   # which kernels ran: none on CPU workers, and why
        assert first[provider]["kernels"] == "torch", first[provider]
        assert first[provider]["kernels_detail"].startswith("reference path: "), first[provider]
    torch_loss = first["torch"]["final_loss"]
    # the same fp32 weights, batch and AdamW: the synchronous step trains as PyTorch does (rounding apart);
    # the asynchronous one reads weights one step stale, a few hundredths of a nat after 4 steps at lr 1e-4
    assert abs(first["ours-sync"]["final_loss"] - torch_loss) < 1e-3 * torch_loss
    assert abs(first["ours-device"]["final_loss"] - torch_loss) < 1e-3 * torch_loss   # the device step: the same
    assert abs(first["ours-async"]["final_loss"] - torch_loss) < 0.05 * torch_loss
    search = [r for r in rows if r["provider"] in ("ours-maxseq", "ours-predicted")]
    assert all(r["max seq"] and r["max seq"] > 0 for r in search), search
    predicted = next(r for r in search if r["provider"] == "ours-predicted")
    assert predicted["cuda_visible_devices"] == "" and predicted["cuda_context"] is False   # its process saw no GPU
    found = next(r for r in search if r["provider"] == "ours-maxseq")   # its top follows the prediction
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_search import search_bound

    top, first_probe, _ = search_bound(predicted["max seq"], 32, 32, 512)
    assert found["seq_bound"] == top and found["probes"][0]["t"] == first_probe, found
    assert all(p["t"] <= top for p in found["probes"]) and f"top {top}: 1.25 x predicted" in found["status"]
