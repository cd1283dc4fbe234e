"""Simulator: closed-form bubbles, invariants of every schedule, work accounting, RoundPipe rules, CLI."""
import json
import random

import pytest

from roundpipe.planner import plan
from roundpipe.sim import SCHEDULES, Costs, simulate
from roundpipe.sim.cli import main as cli_main
from roundpipe.sim.events import Run


def check_invariants(run: Run, tol=1e-9):
    """Every dependency respected (with comm across workers), no overlap on a worker, each task once."""
    tasks = run.schedule.tasks
    assert sorted(i for p in run.schedule.programs for i in p) == list(range(len(tasks)))
    for i, t in enumerate(tasks):
        assert run.end[i] - run.start[i] == pytest.approx(t.duration)
        for d, hop in t.deps:
            delay = run.comm if hop and tasks[d].worker != t.worker else 0.0
            assert run.start[i] >= run.end[d] + delay - tol, (t.name, tasks[d].name)
    for w, program in enumerate(run.schedule.programs):
        assert all(tasks[i].worker == w for i in program)
        for a, b in zip(program, program[1:]):
            assert run.start[b] >= run.end[a] - tol


def expected_work(schedule, costs, M, fused_layers=0):
    """Busy seconds of one iteration from the modelling rules, computed independently."""
    rec = sum(costs.fwd) * 2 + sum(costs.bwd)  # forward + recompute + backward of every layer
    if schedule.startswith("roundpipe"):
        # fused layers: forward + backward, no separate forward stage and no recompute
        rec -= sum(costs.fwd[costs.num_layers - fused_layers:])
    return M * (rec + costs.head_fwd + costs.head_bwd)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(2, 1), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_closed_form_bubble_uniform_stages(schedule, S, M):
    """GPipe and 1F1B with uniform stages and no comm reproduce (S-1)/(M+S-1)."""
    costs = Costs.uniform(2 * S, 1.0, 2.0)
    r = simulate(schedule, costs, S, M)
    assert r.bubbles.ratio == pytest.approx((S - 1) / (M + S - 1))
    assert r.makespan == pytest.approx((M + S - 1) * 2 * (2 * 1.0 + 2.0))


def test_interleaved_closed_form():
    """Interleaved 1F1B with v chunks and uniform stages has bubble (N-1)/(v*M + N-1)."""
    N, v, M = 4, 2, 8
    r = simulate("interleaved-1f1b", Costs.uniform(N * v, 1.0, 2.0), N, M, chunks=v)
    assert r.bubbles.ratio == pytest.approx((N - 1) / (v * M + N - 1))


def random_costs(rng, L):
    return Costs([rng.uniform(0.5, 1.5) for _ in range(L)], [rng.uniform(1.0, 3.0) for _ in range(L)],
                 head_fwd=rng.uniform(0, 5), head_bwd=rng.uniform(0, 10), comm=rng.choice([0.0, 0.05, 0.5]))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(4))
def test_invariants_and_work_accounting(schedule, seed):
    """Every schedule respects dependencies, never double-books a worker, and runs exactly the model's work."""
    rng = random.Random(seed)
    N = rng.choice([1, 2, 3, 4]) if schedule != "interleaved-1f1b" else rng.choice([2, 4])
    M = N * rng.randint(1, 3) if schedule == "interleaved-1f1b" else rng.randint(1, 9)
    costs = random_costs(rng, rng.randint(2 * N, 20))
    r = simulate(schedule, costs, N, M, iterations=5)
    check_invariants(r.run)
    fused = r.partition[1][0] if schedule.startswith("roundpipe") else 0
    iterations = 5 if schedule == "roundpipe-async" else 1
    work = sum(t.duration for t in r.run.schedule.tasks)
    assert work == pytest.approx(iterations * expected_work(schedule, costs, M, fused))
    b = r.bubbles
    assert 0 <= b.ratio < 1
    assert b.busy + b.idle == pytest.approx(b.makespan * b.workers)
    assert r.exposed_comm >= 0
    if costs.comm == 0:
        assert r.exposed_comm == 0


def test_roundpipe_dispatch_rules():
    """Slots go round-robin with g0 carried between rounds of N + 1; recompute precedes its gradient."""
    costs = Costs.uniform(8, 1.0, 2.0, head_fwd=2.0, head_bwd=4.0)
    r = simulate("roundpipe", costs, 3, 7, partition=([4, 2], [2, 2, 4]))
    tasks = r.run.schedule.tasks
    assert r.run.schedule.meta["round_size"] == 4
    slot_worker = {}
    for t in tasks:
        rnd = t.mb // 4
        slot_worker.setdefault((rnd, t.stage), set()).add(t.worker)
    seq = ["F1", "F2", "B1", "B2", "B3"]
    for (rnd, stage), ws in slot_worker.items():
        assert ws == {(rnd * len(seq) + seq.index(stage)) % 3}
    # The fused stage has no recompute; B2's recompute of mb0 starts before B1 mb0 has finished.
    assert not any(t.cat == "recompute" and t.stage == "B1" for t in tasks)
    idx = {t.name: i for i, t in enumerate(tasks)}
    assert r.run.start[idx["B2 mb0 recompute"]] < r.run.end[idx["B1 mb0"]]
    assert r.run.start[idx["B2 mb0"]] >= r.run.end[idx["B1 mb0"]]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_default_round_size_matches_engine(workers):
    """Without round_size the simulator groups microbatches as the engine does by default (N + 1)."""
    import torch.nn as nn

    import roundpipe as rp

    with rp.RoundPipe([nn.Linear(2, 2) for _ in range(2)], devices=["cpu"] * workers) as model:
        engine = model.round_size
    r = simulate("roundpipe", Costs.uniform(2, 1.0, 2.0), workers, 2 * engine + 1, partition=([1], [1, 1]))
    assert r.run.schedule.meta["round_size"] == engine == workers + 1
    assert simulate("roundpipe", Costs.uniform(2, 1.0, 2.0), workers, 4, partition=([1], [1, 1]),
                    round_size=2).run.schedule.meta["round_size"] == 2


def test_roundpipe_head_only_fused_stage():
    """A fused stage of 0 layers holds only the head and loss."""
    costs = Costs.uniform(6, 1.0, 2.0, head_fwd=3.0, head_bwd=5.0)
    r = simulate("roundpipe", costs, 2, 4, partition=([6], [0, 3, 3]))
    fused = [t for t in r.run.schedule.tasks if t.cat == "fused"]
    assert len(fused) == 4 and all(t.duration == pytest.approx(8.0) for t in fused)


def test_async_beats_sync_and_uses_planner_partition():
    """Overlapping iterations remove fill and drain: async per-iteration time < sync makespan."""
    costs = Costs.uniform(16, 1.0, 2.0, head_fwd=4.0, head_bwd=8.0, comm=0.05)
    sync = simulate("roundpipe", costs, 4, 8)
    asyn = simulate("roundpipe-async", costs, 4, 8)
    assert asyn.makespan < sync.makespan
    assert asyn.bubbles.ratio < sync.bubbles.ratio
    p = plan(costs.planner_costs(), 4, 8)
    assert sync.partition == ([len(x) for x in p.forward], [len(p.fused) - 1] + [len(x) for x in p.backward[1:]])


def test_bad_arguments():
    """Wrong schedule names, stage counts and partitions raise ValueError naming the argument."""
    costs = Costs.uniform(8, 1.0, 2.0)
    with pytest.raises(ValueError, match="schedule"):
        simulate("zigzag", costs, 4, 4)
    with pytest.raises(ValueError, match="multiple of workers"):
        simulate("looped-bfs", costs, 4, 4, partition=[2, 2, 2, 1, 1])
    with pytest.raises(ValueError, match="partition"):
        simulate("gpipe", costs, 2, 4, partition=[3, 3])
    with pytest.raises(ValueError, match="microbatches"):
        simulate("interleaved-1f1b", costs, 4, 6)
    with pytest.raises(ValueError, match="fwd"):
        Costs([1.0, 2.0], [1.0])


def test_cli_json(capsys):
    """`roundpipe simulate --json` prints one JSON object with makespan and bubble ratio in percent."""
    assert cli_main(["--schedule", "1f1b", "--gpus", "4", "--microbatches", "8", "--layers", "8",
                     "--fwd", "1", "--bwd", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_ratio"] == pytest.approx(100 * 3 / 11)
    assert out["makespan_ms"] == pytest.approx(11 * 8.0)


def test_cli_roundpipe_partition(capsys):
    """A 'fwd|bwd' partition with a head-only fused stage is accepted; a malformed one exits with usage."""
    assert cli_main(["--schedule", "roundpipe", "--gpus", "2", "--microbatches", "4", "--layers", "4",
                     "--head-fwd", "3", "--partition", "4|0,2,2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["partition"] == [[4], [0, 2, 2]]
    with pytest.raises(SystemExit):
        cli_main(["--schedule", "roundpipe", "--layers", "4", "--partition", "2,2"])


def test_tuned_partition_never_slower_than_planner_pick():
    """Ranking the planner's candidates by simulation finds a plan at least as fast as the objective's pick."""
    from roundpipe.sim.tune import best_partition, tuned_plan

    costs = Costs.uniform(12, 1.0, 2.0, head_fwd=6.0, head_bwd=12.0, comm=0.1)
    picked = simulate("roundpipe-async", costs, 4, 8)
    plan_, best = best_partition(costs, 4, 8)
    assert best.makespan <= picked.makespan + 1e-9
    assert tuned_plan(costs.planner_costs(), 4, 8, comm=0.1) == plan_
    assert Costs.from_planner(costs.planner_costs(), comm=0.1) == costs


def test_tuned_partition_respects_memory_budget():
    """With layer memory sizes, every candidate the tuner simulates fits half the budget."""
    from roundpipe.planner import LayerCost
    from roundpipe.planner.costs import backward_memory
    from roundpipe.sim.tune import best_partition

    costs = Costs.uniform(10, 1.0, 2.0, head_fwd=3.0, head_bwd=6.0)
    layers = [LayerCost(1.0, 3.0, 100, 10)] * 10 + [LayerCost(3.0, 9.0, 100, 10)]
    plan_, _ = best_partition(costs, 4, 8, memory_budget=2 * 700, layer_costs=layers)
    assert all(backward_memory(layers, r) <= 700 for r in plan_.backward)
