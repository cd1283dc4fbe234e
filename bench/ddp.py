"""Data-parallel scaling measured on loopback (gloo, 1, 2 and 4 ranks of CPU workers) beside the simulator's.

Each rank is a process (`torch.distributed`, gloo on 127.0.0.1) running its own
RoundPipe over 2 CPU workers on the same local batch (weak scaling: the global
batch, and so samples/s, grows with the ranks), with `process_group` = the world:
the G-copy thread averages the fp32 gradients in 25 MiB buckets at every step
(roundpipe/engine/data_parallel.py).  The layers are sleep layers
(roundpipe.models.sleep) with a `--width` x `--width` Linear each, so the compute
is a GIL-releasing sleep but the gradients are real: 4.2 MB per layer at width 1024.

- ping: first, in each W-rank run, a 4-byte gloo all_reduce (latency) and one of
  the largest gradient bucket's size (bandwidth), medians, with nothing else
  running: the loopback's physical limit for the reduction.  Fitted to the ring
  model of roundpipe.sim.allreduce: latency per ring step = t(4 B) / 2(W-1),
  bandwidth = 2(W-1)/W x bucket / (t(bucket) - t(4 B)).
- per iteration: as bench/overlap.py, seconds between the ends of iterations 2
  and n-1 of the engine's compute-only trace, divided by n-3, on rank 0 (the
  ranks move in lock step through the all-reduce); "roundpipe" steps
  synchronously (the reduction after the last backward), "roundpipe-async"
  asynchronously (the reduction under the next iteration's compute).
- simulated: `roundpipe.sim.data_parallel` on the same plan, fed with the sleep
  layers' times measured in plain PyTorch and the ping's bandwidth and latency.
- scaling = samples/s(W) / samples/s(1) of the same schedule, efficiency =
  scaling / W (100% is the limit: the reduction costs nothing); exposed =
  T(W) - T(1), the reduction's cost per iteration; "ring ms" is what the
  gradients' buckets take at the ping's bandwidth.
- cpu limit: W x the CPU seconds rank 0's process spends per iteration (copies
  of the 4 MB weights and gradients through the CPU workers' copy engine, the
  optimizer, bookkeeping, gloo), over the cores: the shortest iteration this
  machine can give W ranks.  About 130-140 ms per rank at width 1024 on a 2-core
  EPYC VM, against 30 ms at width 8: the sleeps are 8 / 16 ms (not overlap.py's
  4 / 8) so that 4 ranks fit under the simulated iteration.
- rounds: every rank count runs `--rounds` times, interleaved; the fastest
  round counts (other jobs on a shared machine only ever add time).

The ranks are processes on one machine: with 4 ranks, 8 worker threads, 4
G-copy threads and the gloo threads share its cores, so the reduction competes
with the other ranks' bookkeeping (the sleeps emulate device compute only, they
use no core).  The optimizer step (rp.optim.Adam) is real CPU work the simulator
does not model.

Memory (`--memory`, table ddp_shard_memory): 2 ranks of the tiny decoder (hidden 768 x 4 layers, 28.7M
parameters, bf16 compute, rp AdamW), each rank's host peak and accounted bytes per parameter with and
without `shard_optimizer=True`, synchronous and asynchronous steps, beside the expected saving (the
optimizer state sharding removes from the rank: 4 of AdamW's 8 bytes with 2 ranks); the host peak is
the median of `--rounds` runs.

    python bench/ddp.py [--quick] [--no-save] [--ranks 1,2,4] [--rounds 2]
    python bench/ddp.py --memory [--rounds 3] [--no-save]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from overlap import iteration_ends  # noqa: E402  (bench/overlap.py, beside this file)

from roundpipe.bench.runner import Report, add_common_args, median_time  # noqa: E402
from roundpipe.models.sleep import sleep_layers  # noqa: E402
from roundpipe.planner.partition import plan as partition_plan  # noqa: E402
from roundpipe.planner.plan import Plan  # noqa: E402
from roundpipe.sim import AllReduce, Costs, data_parallel  # noqa: E402
from roundpipe.testing import run_ranks  # noqa: E402

WORKERS = 2   # CPU workers per rank
ROWS = 2      # samples per microbatch
SCHEDULES = ("roundpipe", "roundpipe-async")


def calibrate(width: int, fwd_s: float, bwd_s: float, repeat: int = 30) -> tuple[float, float]:
    """Median forward and backward seconds of one sleep layer on a microbatch, plain PyTorch on one
    thread as the ranks run (a sleep overshoots; the Linear, Python and autograd add their part;
    medians, as other jobs on the machine only ever add time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = sleep_layers(1, width=width, fwd_s=fwd_s, bwd_s=bwd_s)[0]
        x = torch.randn(ROWS, width, requires_grad=True)
        fwd = median_time(lambda: layer(x), repeat=repeat)
        both = median_time(lambda: layer(x).sum().backward(), repeat=repeat)
    finally:
        torch.set_num_threads(threads)
    return fwd, both - fwd


# ---- one rank (a subprocess of `measure`)
def ping(nbytes: int, repeat: int) -> tuple[float, float]:
    """Median seconds of a 4-byte and of an `nbytes` all_reduce on the world group, ranks started together."""
    import torch.distributed as dist

    times = []
    for t in (torch.ones(1), torch.ones(nbytes // 4)):
        samples = []
        for i in range(repeat + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
    return times[0], times[1]


def train(cfg: dict, asynchronous: bool) -> tuple[float, float]:
    """Seconds per steady-state iteration of this rank's engine (iterations 2 .. n-1 of the trace), and
    CPU seconds per iteration of this rank's process (all its threads, over the traced iterations)."""
    import torch.distributed as dist

    from roundpipe.engine.model import RoundPipe
    from roundpipe.optim import Adam

    n, m, w = cfg["iterations"], cfg["microbatches"], cfg["width"]
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(m * ROWS, w, generator=g), torch.randn(m * ROWS, w, generator=g)
    layers = sleep_layers(cfg["layers"], width=w, fwd_s=cfg["fwd_s"], bwd_s=cfg["bwd_s"])
    plan = Plan(forward=[range(*r) for r in cfg["plan"][0]], backward=[range(*r) for r in cfg["plan"][1]])
    with RoundPipe(layers, devices=["cpu"] * WORKERS, plan=plan, num_microbatches=m,
                   process_group=dist.group.WORLD) as model:
        opt = Adam(model.parameters(), lr=1e-5)
        for _ in range(2):   # warm-up: first-call planning dry run, allocations
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        cpu = time.process_time()
        with model.record_trace() as trace:
            for _ in range(n):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=asynchronous)
        cpu = (time.process_time() - cpu) / n
    ends = iteration_ends(trace)
    return (ends[-2] - ends[1]) / (n - 3), cpu


def rank_main(cfg: dict) -> None:
    """One rank: the ping (W > 1), then both schedules; rank 0 writes the seconds to cfg["out"]."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        world = dist.get_world_size()
        small, big = ping(cfg["ping_bytes"], cfg["ping_repeat"]) if world > 1 else (0.0, 0.0)
        result = {"ping_small_s": small, "ping_big_s": big}
        for schedule in SCHEDULES:
            result[schedule] = train(cfg, asynchronous=schedule == "roundpipe-async")
        if dist.get_rank() == 0:
            Path(cfg["out"]).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the driver
def launch(cfg: dict, world: int, timeout: float = 600, script: str | None = None) -> dict | list[dict]:
    """Runs `world` ranks of this file on loopback and returns rank 0's result; with `script` (a rank program
    that torch.saves its result at cfg["out"] + ".<rank>", as roundpipe/bench/shard_memory.py) every rank's."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(cfg, out=os.path.join(tmp, "rank" if script else "rank0.json"))
        argv = [script, json.dumps(cfg)] if script else [__file__, "--rank-config", json.dumps(cfg)]
        procs, errs = run_ranks(argv, world, timeout)
        outs = [f"{cfg['out']}.{r}" for r in range(world)] if script else [cfg["out"]]
        if any(p.returncode for p in procs) or not all(os.path.exists(o) for o in outs):
            bad = next((r for r, p in enumerate(procs) if p.returncode), 0)
            raise RuntimeError(f"{world} ranks: rank {bad} exited with {procs[bad].returncode}:\n{errs[bad][-3000:]}")
        return [torch.load(o) for o in outs] if script else json.loads(Path(cfg["out"]).read_text())


def shard_memory(hidden: int = 768, layers: int = 4, steps: int = 3, rounds: int = 3) -> tuple[list[dict], str]:
    """Rows of per-rank host memory with and without shard_optimizer (2 ranks, synchronous and asynchronous
    steps): the host peak (the median of `rounds` runs, interleaved) and the accounted bytes per parameter,
    the optimizer share sharding removes (the expected saving) and the measured one."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be >= 1")
    script = str(Path(__file__).resolve().parents[1] / "roundpipe" / "bench" / "shard_memory.py")
    rows = []
    for asynchronous in (False, True):
        cfg = dict(hidden=hidden, layers=layers, steps=steps, asynchronous=asynchronous)
        runs = [[launch(dict(cfg, shard=s), 2, script=script) for s in (False, True)] for _ in range(rounds)]
        for rank in range(2):
            f, s = runs[0][0][rank], runs[0][1][rank]
            n = f["params"]
            peak = [statistics.median(r[k][rank]["host_peak"] for r in runs) / n for k in (0, 1)]
            rows.append({"step": "async" if asynchronous else "sync", "rank": rank, "params": n,
                         "peak B/param": peak[0], "sharded peak B/param": peak[1],
                         "peak range": " / ".join(f"{min(r[k][rank]['host_peak'] for r in runs) / n:.1f}-"
                                                  f"{max(r[k][rank]['host_peak'] for r in runs) / n:.1f}"
                                                  for k in (0, 1)),
                         "accounted B/param": f["accounted"] / n, "sharded accounted B/param": s["accounted"] / n,
                         "arena peak B/param": max(r[0][rank]["arena_peak_reserved"] for r in runs) / n,
                         "sharded arena peak B/param": max(r[1][rank]["arena_peak_reserved"] for r in runs) / n,
                         "expected saving B/param": (f["optimizer_state"] - s["optimizer_state"]) / n,
                         "measured saving B/param": peak[0] - peak[1]})
    note = (f"2 gloo ranks on loopback, the tiny decoder at hidden {hidden} x {layers} layers, bf16 compute, "
            f"roundpipe.optim.AdamW, {steps} steps, 2 CPU workers per rank, glibc's default malloc settings; peak: "
            "the largest RSS - the workers' live ledger bytes sampled together (roundpipe/bench/rss.py HostPeak) - "
            f"code pages, over the process before the model was built (its fp32 weights are the masters), the "
            f"median of {rounds} runs (range: unsharded / sharded); accounted: memory_stats()['host'] when the last "
            "call's gradients landed (masters, optimizer state, the host arena's reserve), of the first run; arena "
            "peak: the arena's largest reserve over the runs; expected saving: the optimizer state sharding "
            "removes from the rank; measured saving: the difference of the median peaks")
    return rows, note


def link(world: int, nbytes: int, small: float, big: float) -> tuple[float, float]:
    """(bandwidth GB/s, latency us per ring step) of the ring model through the two ping times."""
    steps = 2 * (world - 1)
    return steps / world * nbytes / max(big - small, 1e-9) / 1e9, small / steps * 1e6


def best(runs: list[dict]) -> dict:
    """Per quantity, the fastest of the rounds (other jobs on the machine only ever add time)."""
    out = {k: min(r[k] for r in runs) for k in ("ping_small_s", "ping_big_s")}
    for schedule in SCHEDULES:
        out[schedule] = min((r[schedule] for r in runs), key=lambda tc: tc[0])
    return out


def measure(ranks: list[int], layers: int = 8, width: int = 1024, fwd_ms: float = 8.0, bwd_ms: float = 16.0,
            microbatches: int = WORKERS + 1, iterations: int = 10, rounds: int = 2,
            ping_repeat: int = 10) -> tuple[list[dict], str]:
    """Rows (one per schedule and rank count, measured beside simulated) and a note on the setup."""
    if not ranks or ranks[0] != 1:
        raise ValueError(f"ranks={ranks!r} must start with 1 (the baseline of the scaling)")
    if iterations < 4:
        raise ValueError(f"iterations={iterations!r} must be >= 4 (the steady-state window skips 3)")
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be >= 1")
    f, b = calibrate(width, fwd_ms / 1e3, bwd_ms / 1e3)
    costs = Costs.uniform(layers - 1, fwd=f, bwd=b, head_fwd=f, head_bwd=b)   # the last layer plays the head
    plan = partition_plan(costs.planner_costs(), WORKERS, microbatches)
    grad = 4 * (width * width + width)   # fp32 gradient bytes per layer
    buckets = AllReduce.uniform(2, layers - 1, grad, grad, bandwidth_gbps=1.0).buckets()
    ping_bytes = max(len(bk) for bk in buckets) * grad
    cfg = dict(layers=layers, width=width, fwd_s=fwd_ms / 1e3, bwd_s=bwd_ms / 1e3, microbatches=microbatches,
               iterations=iterations, ping_bytes=ping_bytes, ping_repeat=ping_repeat,
               plan=[[(r.start, r.stop) for r in plan.forward], [(r.start, r.stop) for r in plan.backward]])
    load = os.getloadavg()[0]
    runs = [[launch(cfg, world) for world in ranks] for _ in range(rounds)]   # rounds interleave the rank counts
    load = (load, os.getloadavg()[0])
    rows, base = [], {}
    for world, got in zip(ranks, map(best, zip(*runs))):
        bw, lat = link(world, ping_bytes, got["ping_small_s"], got["ping_big_s"]) if world > 1 else (1e6, 0.0)
        ar = AllReduce.uniform(world, layers - 1, grad, grad, bandwidth_gbps=bw, latency_us=lat)
        for schedule in SCHEDULES:
            sim = data_parallel(schedule, costs, WORKERS, microbatches, ar, microbatch_size=ROWS, partition=plan)
            t, cpu = got[schedule]
            t1 = base.setdefault(schedule, t)
            scaling = world * t1 / t   # W x T(1) / T(W), as sim.scaling
            rows.append({"schedule": schedule, "ranks": world,
                         "ping GB/s": bw if world > 1 else "-", "ping us/step": lat if world > 1 else "-",
                         "ring ms": 1e3 * ar.time(), "cpu limit ms": 1e3 * world * cpu / (os.cpu_count() or 1),
                         "meas ms/it": 1e3 * t, "sim ms/it": 1e3 * sim.iteration, "meas/sim": t / sim.iteration,
                         "meas samples/s": world * microbatches * ROWS / t, "sim samples/s": sim.samples_per_s,
                         "meas scaling": scaling, "sim scaling": sim.scaling,
                         "meas eff %": 100 * scaling / world, "sim eff %": 100 * sim.efficiency,
                         "meas exposed ms": 1e3 * (t - t1), "sim exposed ms": 1e3 * sim.exposed})
    note = (f"{layers} sleep layers of {fwd_ms} ms forward / {bwd_ms} ms backward with a {width}x{width} Linear "
            f"({grad / 1e6:.1f} MB fp32 gradient each, {len(buckets)} buckets of at most {ping_bytes / 1e6:.1f} MB), "
            f"measured as {f * 1e3:.3f} / {b * 1e3:.3f} ms per microbatch of {ROWS} rows in plain PyTorch (the "
            f"simulator's costs); {WORKERS} CPU workers per rank, {microbatches} microbatches per rank (weak "
            f"scaling), plan {plan}; steady state over {iterations - 3} iterations, the fastest of {rounds} "
            f"round(s); gloo on loopback, ranks are processes on this {os.cpu_count()}-core machine (load average "
            f"{load[0]:.1f} before, {load[1]:.1f} after)")
    return rows, note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--ranks", default=None, help="rank counts, the first 1 (default 1,2,4; --quick 1,2)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--fwd-ms", type=float, default=8.0)
    p.add_argument("--bwd-ms", type=float, default=16.0)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="runs of every rank count, interleaved; the fastest counts")
    p.add_argument("--memory", action="store_true",
                   help="only the optimizer-sharding memory rows (ddp_shard_memory): 2 ranks, per-rank host peak "
                        "with and without shard_optimizer, synchronous and asynchronous")
    p.add_argument("--rank-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return 0
    if args.memory:
        rows, note = shard_memory(rounds=1 if args.quick else args.rounds)
        report = Report("ddp_shard_memory")
        for row in rows:
            report.add(**row)
        report.note(note)
        report.finish(args.out, save=not args.no_save)
        return 0
    ranks = args.ranks or ("1,2" if args.quick else "1,2,4")
    rows, note = measure([int(w) for w in ranks.split(",")], layers=args.layers, width=args.width,
                         fwd_ms=args.fwd_ms, bwd_ms=args.bwd_ms, iterations=5 if args.quick else args.iterations,
                         rounds=1 if args.quick else args.rounds, ping_repeat=3 if args.quick else 10)
    report = Report("ddp")
    for row in rows:
        report.add(**row)
    report.note(note)
    report.note("ping: a 4-byte and a largest-bucket gloo all_reduce with the ranks otherwise idle, fitted to the "
                "ring model (bandwidth per rank, latency per ring step): the loopback's limit, fed to the simulator")
    report.note("eff % = scaling / ranks (100% = the reduction costs nothing); exposed = ms per iteration over one "
                "rank's; ring ms = the gradient buckets at the ping's bandwidth; cpu limit = ranks x CPU seconds of "
                "one rank's process per iteration (copies, optimizer, bookkeeping, gloo) / cores: no iteration on "
                "this machine can be shorter")
    report.note("the ranks share this machine's cores: the all-reduce competes with the other ranks' threads, and "
                "the sleeps emulate device compute only; the optimizer step is real CPU work the simulator omits")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
