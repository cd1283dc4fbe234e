"""bench/gpu_measure.py: the exposed step's estimator (never a negative time) and the kernels a row ran, read from
roundpipe.kernels' state after the work."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "scripts" / "gpu-bench.sh").is_file())
sys.path.insert(0, str(REPO / "bench"))

import gpu_measure  # noqa: E402


def test_exposed_estimate_finds_a_clear_step_cost():
    """Six iterations each way, the step adding 0.5 s over +-0.05 s of jitter: about 0.5 s, a small spread, not noise."""
    rng = random.Random(0)
    without = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(6)]
    with_step = [1.5 + rng.uniform(-0.05, 0.05) for _ in range(6)]
    est = gpu_measure.exposed_estimate(with_step, without)
    assert not est["within_noise"] and abs(est["seconds"] - 0.5) < 0.05
    assert 0 < est["spread_s"] < 0.1 and est["samples"] == 6
    assert gpu_measure.exposed_label(est).startswith("0.5") and "±" in gpu_measure.exposed_label(est)


@pytest.mark.parametrize("shift", [0.0, -0.01, 0.005])
def test_exposed_estimate_within_noise_is_never_a_negative_time(shift):
    """A step cost at or below the jitter (a hidden asynchronous step; iterations with the step even faster): seconds
    is 0, the row says "within noise", and no number in its cell is negative."""
    rng = random.Random(1)
    without = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(5)]
    with_step = [1.0 + shift + rng.uniform(-0.05, 0.05) for _ in range(5)]
    est = gpu_measure.exposed_estimate(with_step, without)
    assert est["within_noise"] and est["seconds"] == 0.0 and est["spread_s"] > 0
    label = gpu_measure.exposed_label(est)
    assert label.startswith("within noise") and "-" not in label


def test_exposed_estimate_needs_iterations():
    """Fewer than 2 iterations a side is refused with both counts; an absent estimate has no cell."""
    with pytest.raises(ValueError, match="at least 2 iterations each way, got 1 and 5"):
        gpu_measure.exposed_estimate([1.0], [1.0] * 5)
    assert gpu_measure.exposed_label(None) is None


KERNEL_RUN = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from roundpipe.kernels import rms_norm
rms_norm(torch.randn(4, 64), torch.ones(64), 1e-6)
import gpu_measure
print("KERNELS " + json.dumps(gpu_measure.kernels_ran()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_kernels_ran_reads_what_ran(interpret):
    """One RMSNorm on a CPU tensor: under TRITON_INTERPRET=1 the Triton kernel launches and the row says "triton" with
    its name; without it (no CUDA here) the call takes the PyTorch reference path and the row says "torch" and why."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET=interpret, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", KERNEL_RUN, str(REPO / "bench")], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=300)
    line = next((x for x in out.stdout.splitlines() if x.startswith("KERNELS ")), None)
    assert line, out.stderr[-2000:]
    ran = json.loads(line[len("KERNELS "):])
    if interpret == "1":
        assert ran == {"kernels": "triton", "kernels_detail": "launched rms_norm_fwd"}, ran
    else:
        assert ran["kernels"] == "torch" and "no CUDA device is visible" in ran["kernels_detail"], ran
