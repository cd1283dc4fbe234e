"""Data-parallel simulation: one rank unchanged, ring all-reduce times, buckets, sync/async exposure, CLI."""
import json
import random

import pytest
from test_sim import check_invariants, random_costs

from roundpipe.sim import AllReduce, Costs, data_parallel, ring_time, simulate
from roundpipe.sim.allreduce import MIB
from roundpipe.sim.cli import main as cli_main

ROUNDPIPE = ("roundpipe", "roundpipe-async")


def gpu_tasks(result):
    """(name, iteration, worker, start, end) of every GPU task, in order."""
    run = result.run
    return [(t.name, t.iteration, t.worker, run.start[i], run.end[i])
            for i, t in enumerate(run.schedule.tasks) if t.cat != "copy"]


def random_case(seed):
    """A seeded generator, workers, microbatches and random costs."""
    rng = random.Random(seed)
    N, M = rng.randint(1, 4), rng.randint(1, 9)
    return rng, N, M, random_costs(rng, rng.randint(2 * N, 16))


def one_bucket(ranks, layers, seconds):
    """An AllReduce of one bucket (every layer, no latency) that takes `seconds`."""
    nbytes = 1e6 * layers
    gbps = 2 * (ranks - 1) / ranks * nbytes / seconds / 1e9
    return AllReduce.uniform(ranks, layers, 1e6, bandwidth_gbps=gbps, bucket_bytes=1 << 40)


@pytest.mark.parametrize("schedule", ROUNDPIPE)
@pytest.mark.parametrize("seed", range(3))
def test_one_rank_is_todays_simulation(schedule, seed):
    """W = 1 reduces nothing: the same tasks, times, makespan and bubbles as without data parallelism."""
    _, N, M, costs = random_case(seed)
    ar = AllReduce.uniform(1, costs.num_layers, 4e8, 1e9, bandwidth_gbps=1.0, latency_us=50)
    base = simulate(schedule, costs, N, M)
    one = simulate(schedule, costs, N, M, allreduce=ar)
    assert gpu_tasks(one) == gpu_tasks(base) and len(one.run.schedule.tasks) == len(base.run.schedule.tasks)
    assert (one.makespan, one.bubbles, one.exposed_comm, one.reduction) == (base.makespan, base.bubbles,
                                                                            base.exposed_comm, 0.0)
    dp = data_parallel(schedule, costs, N, M, ar)
    assert (dp.iteration, dp.single, dp.exposed, dp.scaling, dp.buckets) == (base.makespan, base.makespan, 0.0, 1.0, 0)


def test_ring_time_hand_computed():
    """t = 2(W-1)/W * B / bandwidth + 2(W-1) * latency, worked out by hand."""
    assert ring_time(1e9, 2, 10.0, 5.0) == pytest.approx(1 * 1e9 / 10e9 + 2 * 5e-6)        # 0.10001 s
    assert ring_time(8e6, 4, 4.0, 10.0) == pytest.approx(1.5 * 2e-3 + 6 * 10e-6)          # 3.06 ms
    assert ring_time(8e6, 8, 4.0, 0.0) == pytest.approx(1.75 * 2e-3)                      # 3.5 ms
    assert ring_time(8e6, 1, 4.0, 10.0) == 0.0


def test_buckets_ddp_rule_last_to_first():
    """Layers go last to first (head first), a bucket closes once it holds >= the cap, empty layers are skipped."""
    ar = AllReduce(4, (10 * MIB, 10 * MIB, 0, 10 * MIB, 10 * MIB, 30 * MIB), bandwidth_gbps=4.0, latency_us=10.0,
                   bucket_bytes=25 * MIB)
    assert ar.buckets() == [[5], [4, 3, 1], [0]]
    sizes = [30 * MIB, 30 * MIB, 10 * MIB]
    expected = [1.5 * b / 4e9 + 6 * 10e-6 for b in sizes]
    assert ar.bucket_times() == pytest.approx(expected)
    assert ar.time() == pytest.approx(sum(expected))
    assert AllReduce.uniform(2, 3, 0.0, bandwidth_gbps=1.0).buckets() == []
    assert AllReduce.from_params(2, [5, 7], bandwidth_gbps=1.0).grad_bytes == (20.0, 28.0)


@pytest.mark.parametrize("seed", range(4))
def test_sync_exposes_the_reduction(seed):
    """Synchronous: the buckets run back to back after the last backward; iteration = pipeline + reduction."""
    rng, N, M, costs = random_case(seed)
    ar = AllReduce.uniform(rng.randint(2, 16), costs.num_layers, rng.uniform(1, 40) * MIB, 100 * MIB,
                           bandwidth_gbps=rng.uniform(1e-3, 1e-1), latency_us=rng.uniform(0, 100))
    dp = data_parallel("roundpipe", costs, N, M, ar)
    assert dp.reduction == pytest.approx(ar.time()) and dp.buckets == len(ar.buckets()) > 1
    assert dp.iteration == pytest.approx(dp.single + dp.reduction)
    assert dp.exposed == pytest.approx(dp.reduction)
    assert dp.scaling == pytest.approx(ar.ranks * dp.single / (dp.single + dp.reduction))
    assert dp.samples_per_s == pytest.approx(ar.ranks * M / dp.iteration)
    run = dp.result.run
    check_invariants(run)
    assert gpu_tasks(dp.result) == gpu_tasks(simulate("roundpipe", costs, N, M))
    reduce = [i for i, t in enumerate(run.schedule.tasks) if t.cat == "copy"]
    assert run.start[reduce[0]] == pytest.approx(dp.single)
    assert all(run.start[b] == run.end[a] for a, b in zip(reduce, reduce[1:]))
    assert {e.worker for e in dp.result.trace().events if e.cat == "copy"} == {"all-reduce"}
    assert dp.result.bubbles.workers == len({t.worker for t in run.schedule.tasks if t.cat != "copy"})


def test_async_hides_short_reduction_and_exposes_long_one():
    """Asynchronous: a reduction well under an iteration costs nothing; one of 3 iterations sets the period."""
    costs = Costs.uniform(16, 1.0, 2.0, head_fwd=4.0, head_bwd=8.0, comm=0.05)
    T = simulate("roundpipe-async", costs, 4, 8).makespan
    short = data_parallel("roundpipe-async", costs, 4, 8, one_bucket(4, 16, 0.3 * T))
    assert short.reduction == pytest.approx(0.3 * T)
    assert short.iteration == pytest.approx(T) and short.exposed == pytest.approx(0, abs=1e-9)
    assert short.scaling == pytest.approx(4.0)
    long = data_parallel("roundpipe-async", costs, 4, 8, one_bucket(4, 16, 3 * T))
    assert long.iteration == pytest.approx(3 * T)
    assert long.exposed == pytest.approx(2 * T)
    assert long.scaling == pytest.approx(4 / 3)
    sync = data_parallel("roundpipe", costs, 4, 8, one_bucket(4, 16, 0.3 * T))
    assert sync.exposed == pytest.approx(0.3 * T)


def test_async_exposure_grows_with_the_reduction():
    """Between hidden and bottleneck the exposed time never falls as the reduction grows, and never exceeds it."""
    costs = Costs.uniform(12, 1.0, 2.0, head_fwd=3.0, head_bwd=6.0)
    T = simulate("roundpipe-async", costs, 3, 6).makespan
    exposed = []
    for frac in (0.1, 0.4, 0.7, 1.0, 1.3, 2.0):
        dp = data_parallel("roundpipe-async", costs, 3, 6, one_bucket(2, 12, frac * T))
        exposed.append(dp.exposed)
        assert -1e-9 <= dp.exposed <= dp.reduction + 1e-9
        assert dp.iteration >= max(T, dp.reduction) - 1e-9
    assert all(b >= a - 1e-9 for a, b in zip(exposed, exposed[1:])), exposed


@pytest.mark.parametrize("seed", range(3))
def test_async_waits_for_the_buckets_of_its_layers(seed):
    """Every stage of iteration t starts after the buckets holding its layers (fused: and the head) in t - 2."""
    rng = random.Random(seed)
    N, M = rng.randint(2, 4), rng.randint(2, 7)
    costs = random_costs(rng, 12)
    ar = AllReduce.uniform(4, 12, 10 * MIB, 30 * MIB, bandwidth_gbps=rng.uniform(0.5, 5) * 1e-2 * 1e-3,
                           latency_us=5.0, bucket_bytes=25 * MIB)
    r = simulate("roundpipe-async", costs, N, M, allreduce=ar, iterations=5)
    run, tasks = r.run, r.run.schedule.tasks
    check_invariants(run)
    fwd, bwd = r.partition
    bucket_of = {l: b for b, layers in enumerate(ar.buckets()) for l in layers}
    reduced = {(t.iteration, t.mb): run.end[i] for i, t in enumerate(tasks) if t.cat == "copy"}
    top, stage_layers = 12, {}
    for j, n in enumerate(bwd):
        stage_layers[f"B{j + 1}"] = list(range(top - n, top)) + ([12] if j == 0 else [])
        top -= n
    for j, _n in enumerate(fwd):
        stage_layers[f"F{j + 1}"] = list(range(sum(fwd[:j]), sum(fwd[:j + 1])))
    for i, t in enumerate(tasks):
        if t.cat != "copy" and t.iteration >= 2:
            need = max(reduced[t.iteration - 2, bucket_of[l]] for l in stage_layers[t.stage])
            assert run.start[i] >= need - 1e-9, t.name


def test_bad_arguments():
    """AllReduce and simulate reject bad data-parallel arguments, naming them."""
    with pytest.raises(ValueError, match="ranks=0"):
        AllReduce.uniform(0, 4, 1.0, bandwidth_gbps=1.0)
    with pytest.raises(ValueError, match="bandwidth_gbps=0"):
        AllReduce.uniform(2, 4, 1.0, bandwidth_gbps=0)
    with pytest.raises(ValueError, match=r"grad_bytes\[1\]=-1"):
        AllReduce(2, (1.0, -1.0, 0.0), bandwidth_gbps=1.0)
    with pytest.raises(ValueError, match="latency_us"):
        AllReduce.uniform(2, 4, 1.0, bandwidth_gbps=1.0, latency_us=-1)
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        AllReduce.uniform(2, 4, 1.0, bandwidth_gbps=1.0, bucket_bytes=0)
    costs = Costs.uniform(8, 1.0, 2.0)
    with pytest.raises(ValueError, match="4 layers"):
        simulate("roundpipe", costs, 2, 4, allreduce=AllReduce.uniform(2, 4, 1.0, bandwidth_gbps=1.0))
    with pytest.raises(ValueError, match="'1f1b'"):
        simulate("1f1b", costs, 2, 4, allreduce=AllReduce.uniform(2, 8, 1.0, bandwidth_gbps=1.0))
    with pytest.raises(TypeError, match="allreduce"):
        data_parallel("roundpipe", costs, 2, 4, allreduce=4)
    with pytest.raises(ValueError, match="microbatch_size=0"):
        data_parallel("roundpipe", costs, 2, 4, AllReduce.uniform(2, 8, 1.0, bandwidth_gbps=1.0), microbatch_size=0)


BASE = ["--schedule", "roundpipe", "--gpus", "2", "--microbatches", "4", "--layers", "4", "--fwd", "1", "--bwd",
        "2", "--json"]


def test_cli_data_parallel(capsys):
    """--ranks with bandwidth, latency, bucket and gradient sizes prints the hand-computed reduction and scaling."""
    assert cli_main(BASE) == 0
    single = json.loads(capsys.readouterr().out)
    assert "data_parallel" not in single
    assert cli_main(BASE + ["--ranks", "4", "--allreduce-gbps", "2", "--allreduce-latency-us", "10",
                            "--bucket-mb", "25", "--grad-mb-per-layer", "10", "--head-grad-mb", "30",
                            "--microbatch-size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["data_parallel"]
    expected = sum(1.5 * b * MIB / 2e9 + 6 * 10e-6 for b in (30, 30, 10))   # buckets [head], [3, 2, 1], [0]
    assert d["buckets"] == 3 and d["reduction_ms"] == pytest.approx(1e3 * expected)
    assert d["single_rank_ms"] == pytest.approx(single["makespan_ms"])
    assert d["iteration_ms"] == pytest.approx(single["makespan_ms"] + 1e3 * expected) == out["makespan_ms"]
    assert d["samples_per_s"] == pytest.approx(4 * 4 * 8 / (d["iteration_ms"] * 1e-3))
    assert d["scaling"] == pytest.approx(4 * single["makespan_ms"] / d["iteration_ms"])
    assert cli_main(BASE[:-1] + ["--ranks", "2", "--allreduce-gbps", "2", "--grad-mb-per-layer", "10"]) == 0
    text = capsys.readouterr().out
    assert "data parallel: 2 ranks" in text and "samples/s" in text


@pytest.mark.parametrize("flags, message", [
    (["--ranks", "0"], "--ranks: 0 must be >= 1"),
    (["--ranks", "two"], "--ranks: 'two' is not an int"),
    (["--ranks", "2", "--allreduce-gbps", "0", "--grad-mb-per-layer", "1"], "--allreduce-gbps: 0 must be > 0"),
    (["--ranks", "2", "--allreduce-gbps", "1", "--grad-mb-per-layer", "-1"], "--grad-mb-per-layer: -1 must be >= 0"),
    (["--ranks", "2", "--allreduce-gbps", "1", "--grad-mb-per-layer", "1", "--allreduce-latency-us", "-3"],
     "--allreduce-latency-us: -3 must be >= 0"),
    (["--ranks", "2", "--allreduce-gbps", "1", "--grad-mb-per-layer", "1", "--bucket-mb", "0"],
     "--bucket-mb: 0 must be > 0"),
    (["--ranks", "2", "--grad-mb-per-layer", "1"], "--ranks 2 needs --allreduce-gbps"),
    (["--ranks", "2", "--allreduce-gbps", "1"], "--ranks 2 needs --grad-mb-per-layer"),
    (["--allreduce-gbps", "1"], "--allreduce-gbps needs --ranks > 1"),
    (["--ranks", "2", "--allreduce-gbps", "1", "--grad-mb-per-layer", "1", "--schedule", "gpipe"],
     "not --schedule gpipe"),
])
def test_cli_rejects_bad_flags(capsys, flags, message):
    """A bad data-parallel flag exits with a usage error naming the flag and its value."""
    with pytest.raises(SystemExit) as exc:
        cli_main(BASE + flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
