"""Simulator host optimizer step: whole or per layer, synchronous or one step stale, against hand-computed times."""
import pytest
from test_sim import check_invariants

from roundpipe.sim import AllReduce, Costs, HostStep, Uploads, host_step, simulate

# One GPU, one microbatch, 4 layers of forward 1 and backward 2, no head, no comm.
# Partition F1 = layers 0-1, B1 (fused) = layers 2-3, B2 = layers 0-1:
#     GPU 0   F1 [0, 2)   B1 [2, 8) (forward + backward, no recompute)   B2 [8, 14) (recompute + backward)
# so an iteration computes for C = 14; B1's gradients land at 8, B2's at 14.
TOY = Costs.uniform(4, 1.0, 2.0)
TOY_PARTITION = ([2], [2, 2])
C = 14.0


def toy(schedule, policy, per_layer, iterations=6):
    step = HostStep.uniform(4, per_layer, rate=1.0, policy=policy)   # each layer's step takes `per_layer`
    r = host_step(schedule, TOY, 1, 1, step, partition=TOY_PARTITION, iterations=iterations)
    check_invariants(r.result.run)
    return r


@pytest.mark.parametrize("s", [1.0, 10.0])
def test_whole_synchronous_step_is_all_exposed(s):
    """Old path: one step of every layer after the iteration, the GPU idle meanwhile: C + 4 s."""
    r = toy("roundpipe", "whole", s)
    assert r.baseline == pytest.approx(C)
    assert r.iteration == pytest.approx(C + 4 * s)
    assert r.exposed == pytest.approx(4 * s) and r.step == pytest.approx(4 * s)


@pytest.mark.parametrize("s,expected", [(1.0, 16.0), (10.0, 48.0)])
def test_per_layer_synchronous_step_overlaps_the_rest_of_the_backward(s, expected):
    """Layers 3, 2 step from 8 (under B2), layers 1, 0 once B2 ends at 14 (or the host is free); the next F1
    waits for layer 0: s = 1 -> 14 + 2 = 16; s = 10 -> 8 + 4 x 10 = 48."""
    r = toy("roundpipe", "per-layer", s)
    assert r.iteration == pytest.approx(expected)
    assert r.exposed == pytest.approx(expected - C)
    names = [t.name for t in r.result.run.schedule.tasks if t.cat == "optimizer" and t.iteration == 0]
    assert names == ["step head", "step L3", "step L2", "step L1", "step L0"]


@pytest.mark.parametrize("policy", ["per-layer", "whole"])
@pytest.mark.parametrize("s", [1.0, 3.0, 5.0, 10.0])
def test_asynchronous_step_shows_only_past_the_compute(policy, s):
    """One step stale: the step of iteration t hides under iteration t + 1; the period is max(C, 4 s)."""
    r = toy("roundpipe-async", policy, s, iterations=8)
    assert r.baseline == pytest.approx(C)
    assert r.iteration == pytest.approx(max(C, 4 * s))
    assert r.exposed == pytest.approx(max(0.0, 4 * s - C))


def test_policies_rank_on_a_pipeline():
    """8 GPUs, uniform layers: whole sync exposes all the step, per-layer sync less, async nothing when it fits."""
    costs = Costs.uniform(16, 1e-3, 2e-3, 4e-3, 8e-3, comm=1e-4)
    kw = dict(partition=([4, 4, 4], [4, 4, 4, 4]), iterations=6)
    step = HostStep.uniform(16, 1e6, rate=1e9, head_params=2e6)   # 1 ms a layer, 18 ms in all
    whole = host_step("roundpipe", costs, 4, 8, HostStep(step.params, step.rate, "whole"), **kw)
    layer = host_step("roundpipe", costs, 4, 8, step, **kw)
    stale = host_step("roundpipe-async", costs, 4, 8, step, **kw)
    for r in (whole, layer, stale):
        check_invariants(r.result.run)
    assert whole.exposed == pytest.approx(step.time())            # a barrier: everything after shifts by the step
    assert 0 < layer.exposed < whole.exposed
    assert layer.exposed >= 4 * 1e-3 - 1e-12                      # at least the step of the last stage's 4 layers
    assert stale.exposed == 0
    assert stale.iteration < layer.iteration < whole.iteration
    plain = simulate("roundpipe-async", costs, 4, 8, **kw)
    assert stale.baseline == pytest.approx(plain.makespan)       # an instantaneous step changes nothing
    assert stale.result.bubbles.workers == 4 and stale.result.host_step == pytest.approx(0.018)


def test_step_waits_for_uploads_and_reduction():
    """With uploads and an all-reduce the invariants hold; a layer's step follows its bucket."""
    costs = Costs.uniform(8, 1e-3, 2e-3, 2e-3, 4e-3, 1e-4)
    ar = AllReduce.uniform(2, 8, grad_bytes=4e6, head_grad_bytes=8e6, bandwidth_gbps=10, bucket_bytes=8 << 20)
    up = Uploads.uniform(8, 1e7, gbps=20)
    step = HostStep.uniform(8, 1e6, rate=1e9)
    for schedule in ("roundpipe", "roundpipe-async"):
        r = simulate(schedule, costs, 2, 3, partition=([2, 2, 2], [2, 2, 2, 2]), iterations=5,
                     allreduce=ar, uploads=up, host_step=step)
        check_invariants(r.run)
        tasks = r.run.schedule.tasks
        for _i, t in enumerate(tasks):
            if t.cat == "optimizer":
                assert any(tasks[d].name.startswith("all-reduce") for d, _ in t.deps)


def test_host_step_errors():
    """Wrong layer counts, policies, rates and schedules are ValueErrors naming the argument."""
    with pytest.raises(ValueError, match="policy"):
        HostStep.uniform(4, 1.0, 1.0, policy="lazy")
    with pytest.raises(ValueError, match="rate"):
        HostStep.uniform(4, 1.0, 0.0)
    with pytest.raises(ValueError, match="host_step has parameters for 3 layers"):
        simulate("roundpipe", TOY, 1, 1, TOY_PARTITION, host_step=HostStep.uniform(3, 1.0, 1.0))
    with pytest.raises(ValueError, match="RoundPipe schedules only"):
        simulate("1f1b", TOY, 2, 2, host_step=HostStep.uniform(4, 1.0, 1.0))
    with pytest.raises(ValueError, match="iterations=2"):
        simulate("roundpipe", TOY, 1, 1, TOY_PARTITION, iterations=2, host_step=HostStep.uniform(4, 1.0, 1.0))
    with pytest.raises(TypeError, match="host_step"):
        simulate("roundpipe", TOY, 1, 1, TOY_PARTITION, host_step=1.0)
