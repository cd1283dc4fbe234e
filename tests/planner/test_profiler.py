"""Profiler: proportional attribution, smoothing, estimate scaling; Replanner threshold."""
import pytest

from roundpipe.planner import LayerCost, Profiler, Replanner, estimate_costs


def test_stage_time_split_in_proportion_to_estimates():
    """A stage's per-microbatch time is split over its layers in proportion to their estimates."""
    prof = Profiler([LayerCost(1.0, 3.0), LayerCost(3.0, 9.0), LayerCost(1.0, 3.0)])
    prof.record(range(0, 2), "forward", seconds=16.0, microbatches=2)  # 8 s per microbatch
    costs = prof.costs()
    assert costs[0].fwd_s == pytest.approx(2.0)
    assert costs[1].fwd_s == pytest.approx(6.0)
    # Layer 2 was not measured: its estimate is scaled by the measured/estimated ratio (2x).
    assert costs[2].fwd_s == pytest.approx(2.0)
    assert prof.coverage() == pytest.approx(2 / 6)


def test_ema_smoothing():
    """Later samples move the value by alpha of the difference; the first one replaces the estimate."""
    prof = Profiler([LayerCost(1.0, 3.0)], alpha=0.5)
    prof.record(0, "backward", 10.0)
    prof.record(0, "backward", 20.0)
    assert prof.costs()[0].bwd_s == pytest.approx(15.0)
    prof.record(0, "fused", 15.0)
    assert prof.costs()[0].bwd_s == pytest.approx(15.0)


def test_activation_bytes_recorded():
    """Measured stage activation memory is split over layers like the time."""
    prof = Profiler([LayerCost(1, 3, 10, 100), LayerCost(1, 3, 10, 300)])
    prof.record(range(2), "backward", 1.0, act_bytes=800)
    assert [c.act_bytes for c in prof.costs()] == [200, 600]


def test_table_lists_every_layer_and_marks_measured():
    """The table has a row per layer plus header and total, with '*' on measured values."""
    prof = Profiler([LayerCost(1e-3, 3e-3, 2**20, 0)] * 3)
    prof.record(1, "forward", 2e-3)
    lines = prof.table().splitlines()
    assert len(lines) == 5 and "2.000*" in lines[2] and "*" not in lines[1]


def test_size_based_estimate():
    """Estimates scale with parameter count; modules are counted through .parameters()."""
    import torch

    costs = estimate_costs([1000, torch.nn.Linear(10, 10)], tokens=4, flops_per_s=1e6)
    assert costs[0].fwd_s == pytest.approx(2 * 1000 * 4 / 1e6)
    assert costs[1].param_bytes == 110 * 2
    assert costs[1].bwd_s == pytest.approx(3 * costs[1].fwd_s)


def test_record_rejects_bad_input():
    """Wrong layers, phase or counts raise errors naming the argument."""
    prof = Profiler([LayerCost(1, 3)] * 2)
    with pytest.raises(ValueError, match="layers"):
        prof.record(range(1, 3), "forward", 1.0)
    with pytest.raises(ValueError, match="phase"):
        prof.record(0, "sideways", 1.0)
    with pytest.raises(ValueError, match="microbatches"):
        prof.record(0, "forward", 1.0, microbatches=0)


def test_replanner_replans_only_past_threshold():
    """Small drift keeps the plan without running the partitioner; a big shift re-plans."""
    prof = Profiler([LayerCost(1.0, 3.0)] * 12)
    rp = Replanner(prof, workers=4, microbatches=8, threshold=0.2)
    first, runs = rp.plan, rp.replans
    for i in range(12):
        prof.record(i, "forward", 1.05)
        prof.record(i, "backward", 3.05)
    assert rp.update() is False and rp.replans == runs and rp.plan == first
    # The last layers become 6x slower: the fused tail must shrink.
    for _ in range(10):
        for i in range(8, 12):
            prof.record(i, "backward", 18.0)
            prof.record(i, "forward", 6.0)
    assert rp.update() is True
    assert rp.replans == runs + 1
    assert len(rp.plan.fused) < len(first.fused) or rp.plan != first


def test_replanner_custom_solver():
    """A custom solver (e.g. the simulator-ranked one) is what the replanner calls."""
    from roundpipe.planner import plan as closed_form

    calls = []

    def solver(costs, workers, microbatches, memory_budget):
        calls.append(len(costs))
        return closed_form(costs, workers, microbatches, memory_budget)

    rp = Replanner(Profiler([LayerCost(1.0, 3.0)] * 6), workers=2, microbatches=4, solver=solver)
    assert calls == [6] and rp.plan.num_layers == 6
