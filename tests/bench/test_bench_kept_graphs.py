"""bench/kept_graphs.py at its smallest size: every provider's row, the kept stages and the recompute spans they
remove, gradients bitwise equal (no timings checked)."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kept_graphs  # noqa: E402

from roundpipe.engine.calls.dispatcher import Schedule  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_smallest_run_fills_every_row():
    keepable = Schedule.keepable
    rows, note = kept_graphs.measure(hidden=64, blocks=4, rows=4, seq=32, rounds=1, steps=1)
    assert Schedule.keepable is keepable   # the switch is undone
    by = {r["provider"]: r for r in rows}
    assert list(by) == ["plain", "recompute", "kept graphs"]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("ms", "tokens/s", "% of limit", "vs recompute"))
    assert by["recompute"]["kept"] == "-" and by["kept graphs"]["kept"] == "2-3"   # plan [0-1] [2-3] | 4-5* 2-3 0-1
    assert by["recompute"]["recomputed stages"] == 2 and by["kept graphs"]["recomputed stages"] == 1
    assert by["kept graphs"]["peak MiB"] <= by["kept graphs"]["predicted MiB"] * 1.1
    assert "gradients bitwise equal: True" in note


def test_plan_for_puts_forward_stages_on_backward_boundaries():
    plan = kept_graphs.plan_for(8)
    assert [(r.start, r.stop) for r in plan.forward] == [(0, 2), (2, 6)]
    assert [(r.start, r.stop) for r in plan.backward] == [(6, 8), (4, 6), (2, 4), (0, 2)]
