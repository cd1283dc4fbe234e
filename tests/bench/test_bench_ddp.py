"""bench/ddp.py runs 1 and 2 gloo ranks on loopback at the smallest size and fills every column."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ddp  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")]


def test_one_and_two_ranks_measured_beside_simulated():
    """A row per schedule and rank count; the baseline's scaling is 1, every number finite (no timings checked)."""
    rows, note = ddp.measure([1, 2], layers=3, width=64, fwd_ms=1.0, bwd_ms=2.0, iterations=4, rounds=1,
                             ping_repeat=1)
    assert [(r["schedule"], r["ranks"]) for r in rows] == [(s, w) for w in (1, 2) for s in ddp.SCHEDULES]
    for r in rows:
        numbers = {k: v for k, v in r.items() if k not in ("schedule", "ranks") and v != "-"}
        assert all(isinstance(v, float) and math.isfinite(v) for v in numbers.values()), r
        assert r["meas ms/it"] > 0 and r["sim ms/it"] > 0 and r["cpu limit ms"] > 0
    for r in rows[:2]:
        assert r["meas scaling"] == r["sim scaling"] == 1.0 and r["ring ms"] == 0.0 and r["ping GB/s"] == "-"
    for r in rows[2:]:
        assert r["ping GB/s"] > 0 and r["ring ms"] > 0
        assert r["sim exposed ms"] >= 0
    assert "3 sleep layers" in note and "2 CPU workers per rank" in note


def test_rejects_a_scaling_without_its_baseline():
    """Rank counts must start with 1 and the window needs 4 iterations; both fail before any launch."""
    with pytest.raises(ValueError, match="ranks"):
        ddp.measure([2, 4])
    with pytest.raises(ValueError, match="iterations"):
        ddp.measure([1, 2], iterations=3)
