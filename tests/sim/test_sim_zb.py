"""Zero Bubble in the simulator: hand-drawn orders, the paper's bubble formulas and Table 5, roundpipe-zb, CLI."""
import json
import random

import pytest
from test_sim import check_invariants

from roundpipe.sim import Costs, simulate
from roundpipe.sim.cli import main as cli_main
from roundpipe.sim.zerobubble import unit_orders


def unit_costs(stages, **kw):
    """F = B = W = 1 per stage, no recompute: the paper's section 2 model."""
    return Costs.uniform(stages, 1.0, 2.0, w_fraction=0.5, recompute=False, **kw)


def drawn(order):
    return " ".join(f"{op}{m}" for op, _, m in order)


def test_hand_drawn_orders_p4_m8():
    """p = 4, m = 8, F = B = W = 1: the orders of the paper's Figure 3, and their spans.

    By hand: in ZB-H1 worker 0 runs F0..F3 (1F1B's warm-up, 4 microbatches held, its memory
    limit), waits for B0 to come back through 3 workers (F and B of each: idle 3 units, against
    1F1B's 3(F+B+W) = 9), then B W F repeats; worker 3 alternates F and B and defers W while
    it holds fewer than 4 microbatches.  Span of worker 0: 8 x 3 work + 3 idle = 27.
    ZB-H2 takes 2(p-d)-1 forwards on worker d, so B0 reaches worker 0 (at t = 7) exactly
    when its 7th forward ends: no idle time inside any worker's span (24 each)."""
    h1 = unit_orders("zb-h1", 4, 8)
    assert drawn(h1[0]) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert drawn(h1[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    h2 = unit_orders("zb-h2", 4, 8)
    assert drawn(h2[0]).startswith("F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1")
    costs = unit_costs(4)
    spans = {}
    for s in ("1f1b", "zb-h1", "zb-h2"):
        r = simulate(s, costs, 4, 8)
        check_invariants(r.run)
        spans[s] = 24 / (1 - r.span_bubble)
    assert spans == pytest.approx({"1f1b": 33.0, "zb-h1": 27.0, "zb-h2": 24.0})


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_bubble_formulas_of_table_2(p):
    """F = B = W = 1: bubble (p-1)(F+B+W) for 1F1B, (p-1)(F+B-W) for ZB-H1 (m >= p), (p-1)(F+B-2W) = 0 for
    ZB-H2 (m >= 2p-1); peak memory p, p and 2p-1 microbatches (the paper's Table 2)."""
    costs = unit_costs(p)
    for m in (p, 2 * p - 1, 3 * p):
        bubble = {s: (lambda r: r.span_bubble / (1 - r.span_bubble) * 3 * m)(simulate(s, costs, p, m))
                  for s in ("1f1b", "zb-h1", "zb-h2")}
        assert bubble["1f1b"] == pytest.approx(3 * (p - 1))
        assert bubble["zb-h1"] == pytest.approx(p - 1)
        if m >= 2 * p - 1:
            assert bubble["zb-h2"] == pytest.approx(0, abs=1e-9)
    peaks = {s: simulate(s, costs, p, 3 * p).run.schedule.meta["peak_activations"] for s in ("zb-h1", "zb-h2")}
    assert peaks == {"zb-h1": [p] * p, "zb-h2": [2 * p - 1] * p}


# arXiv:2401.10241v1: Table 9 (profiled T_F, T_B, T_W, T_comm, ms) and Table 5 (bubble rates)
TABLE_5 = [("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083),
           ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0554, 0.0294),
           ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672),
           ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1106, 0.0490)]


@pytest.mark.parametrize("row", TABLE_5, ids=[f"{r[0]}-m{r[2]}" for r in TABLE_5])
def test_reproduces_paper_table_5(row):
    """The paper's bubble rates of 1F1B, ZB-H1 and ZB-H2 from its profiled times, to the 4 digits printed."""
    _, p, m, F, B, W, comm, *paper = row
    costs = Costs.uniform(p, F, B + W, comm=comm, w_fraction=W / (B + W), recompute=False)
    ours = [simulate(s, costs, p, m).span_bubble for s in ("1f1b", "zb-h1", "zb-h2")]
    assert ours == pytest.approx(paper, abs=6e-5)


def test_zb_v_two_chunks_per_worker_v_shape():
    """ZB-V: chunk c on worker c, then back (worker 0 holds the first and the last chunk, so the head);
    peak 2p chunk activations (p M_B); below ZB-H1's bubble at F = B = W."""
    p, m = 4, 12
    costs = Costs.uniform(2 * p, 0.5, 1.0, w_fraction=0.5, recompute=False)
    r = simulate("zb-v", costs, p, m)
    check_invariants(r.run)
    workers = {t.stage: t.worker for t in r.run.schedule.tasks}
    assert [workers[f"F{c}"] for c in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert r.run.schedule.meta["peak_activations"] == [2 * p] * p
    assert r.span_bubble < simulate("zb-h1", costs, p, m).span_bubble


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("seed", range(3))
def test_zb_invariants_and_work(schedule, seed):
    """Random costs, comm and recompute: dependencies hold and the work is the model's (B + W = backward)."""
    rng = random.Random(seed)
    p, m = rng.randint(1, 5), rng.randint(1, 12)
    L = rng.randint(2 * p, 20)
    recompute = rng.random() < 0.5
    costs = Costs([rng.uniform(0.5, 1.5) for _ in range(L)], [rng.uniform(1, 3) for _ in range(L)],
                  head_fwd=rng.uniform(0, 4), head_bwd=rng.uniform(0, 8), comm=rng.choice([0.0, 0.3]),
                  w_fraction=rng.uniform(0, 0.7), recompute=recompute)
    r = simulate(schedule, costs, p, m)
    check_invariants(r.run)
    per_mb = sum(costs.fwd) * (2 if recompute else 1) + sum(costs.bwd) + costs.head_fwd + costs.head_bwd
    assert sum(t.duration for t in r.run.schedule.tasks) == pytest.approx(m * per_mb)


def test_w_fraction_zero_is_the_unsplit_schedule():
    """Without a W share, ZB-H1 runs as 1F1B and roundpipe-zb as roundpipe."""
    costs = Costs.uniform(8, 1.0, 2.0, head_fwd=3.0, head_bwd=6.0, comm=0.1)
    assert simulate("zb-h1", Costs.uniform(4, 1.0, 2.0), 4, 8).makespan == pytest.approx(
        simulate("1f1b", Costs.uniform(4, 1.0, 2.0), 4, 8).makespan)
    assert simulate("roundpipe-zb", costs, 3, 8).makespan == pytest.approx(simulate("roundpipe", costs, 3, 8).makespan)


def test_roundpipe_zb_defers_w_within_its_slot():
    """roundpipe-zb: every W runs on its B's worker after it and before that worker's next other-stage task;
    same work as roundpipe; the README case gets faster (2.6%: docs/benchmarks.md)."""
    costs = Costs.uniform(32, 9.3, 18.6, 23.9, 45.4, 1.5, w_fraction=0.5)
    base = simulate("roundpipe", costs, 8, 16)
    zb = simulate("roundpipe-zb", costs, 8, 16, partition=base.partition)
    run = zb.run
    tasks = run.schedule.tasks
    for i, t in enumerate(tasks):  # dependencies; deferred W break program order, so overlap is checked in time
        assert all(run.start[i] >= run.end[d] + (run.comm if hop and tasks[d].worker != t.worker else 0) - 1e-9
                   for d, hop in t.deps)
    for program in run.schedule.programs:
        by_time = sorted(program, key=lambda i: (run.start[i], run.end[i]))
        assert all(run.start[b] >= run.end[a] - 1e-9 for a, b in zip(by_time, by_time[1:]))
    assert sum(t.duration for t in tasks) == pytest.approx(sum(t.duration for t in base.run.schedule.tasks))
    for program in run.schedule.programs:  # a worker's slots (stage, round) never interleave, W included
        slots = [(tasks[i].stage, tasks[i].mb // 9) for i in sorted(program, key=lambda i: (run.start[i], i))]
        runs = [k for j, k in enumerate(slots) if j == 0 or slots[j - 1] != k]
        assert len(runs) == len(set(runs))
    for i, t in enumerate(tasks):
        if t.cat == "wgrad":
            (b, _), = t.deps
            assert tasks[b].worker == t.worker and run.start[i] >= run.end[b]
    assert zb.makespan < 0.98 * base.makespan


def test_costs_and_cli(capsys):
    """w_fraction is checked; the CLI splits with --w-fraction, reports the span bubble, and refuses
    --no-recompute for RoundPipe."""
    with pytest.raises(ValueError, match="w_fraction"):
        Costs.uniform(2, 1.0, 2.0, w_fraction=1.5)
    assert cli_main(["--schedule", "zb-h1", "--gpus", "4", "--microbatches", "8", "--layers", "4", "--fwd", "1",
                     "--bwd", "2", "--w-fraction", "0.5", "--no-recompute", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan_ms"] == pytest.approx(27.0) and out["span_bubble"] == pytest.approx(100 * 3 / 27)
    assert cli_main(["--schedule", "roundpipe-zb", "--gpus", "2", "--microbatches", "3", "--layers", "4",
                     "--w-fraction", "0.5"]) == 0
    assert "roundpipe-zb: makespan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["--schedule", "roundpipe", "--layers", "4", "--no-recompute"])
