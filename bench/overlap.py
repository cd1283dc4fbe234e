"""The engine's schedule measured against the simulator's, on layers whose compute is a sleep.

Each layer sleeps `--fwd-ms` in its forward and `--bwd-ms` in its backward
(roundpipe.models.sleep; a sleep releases the GIL, so CPU workers run side by side
like GPUs, and the arithmetic of the 8-wide layers is negligible).  The same costs
go to the simulator (the last layer plays the LM head: in the fused stage, never
recomputed), and both run the same plan on 1, 2 and 4 workers:

- "roundpipe": a synchronous step after each call (the pipeline drains every
  iteration); "roundpipe-async": the asynchronous step, so iteration t+1's forwards
  run while iteration t's last backward stages drain (the continuous pipeline).
- per iteration: seconds between the ends of iterations 2 and n-1, divided by n-3
  (the simulator's steady-state window for roundpipe-async; for the synchronous
  schedule the simulator's one-iteration makespan), measured from the engine's
  compute-only trace (`RoundPipe.record_trace`: waits are not events);
- bubble %: idle / (window x workers), by roundpipe.sim.metrics.bubbles, the same
  code on the recorded and the simulated trace;
- "% of limit": the physical limit is every worker computing all the time, total
  compute / workers per iteration; measured and simulated iteration times as a
  percent of it (100% is no bubble at all);
- "meas/sim": measured over simulated time per iteration (1.00: the engine
  delivers the simulator's schedule; the target is within 10% at 4 workers).

    python bench/overlap.py [--quick] [--png DIR] [--no-save]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.engine.model import RoundPipe  # noqa: E402
from roundpipe.models.sleep import sleep_layers  # noqa: E402
from roundpipe.optim import Adam  # noqa: E402
from roundpipe.planner.partition import plan as partition_plan  # noqa: E402
from roundpipe.sim import Costs, bubbles, simulate  # noqa: E402
from roundpipe.sim.roundpipe import default_round_size  # noqa: E402
from roundpipe.trace import Trace  # noqa: E402


def iteration_ends(trace: Trace) -> list[float]:
    ends: dict[int, float] = {}
    for e in trace.events:
        if e.cat == "copy":
            continue
        i = e.args["iteration"]
        ends[i] = max(ends.get(i, e.end), e.end)
    return [ends[i] for i in sorted(ends)]


def calibrate(fwd_s: float, bwd_s: float, rows: int, repeat: int = 30) -> tuple[float, float]:
    """What one sleep layer really takes on this machine (a sleep overshoots; Python and autograd
    add their part): mean forward and backward seconds of a microbatch, plain PyTorch."""
    layer = sleep_layers(1, fwd_s=fwd_s, bwd_s=bwd_s)[0]
    x = torch.randn(rows, 8, requires_grad=True)
    fwd = bwd = 0.0
    for i in range(repeat + 2):
        t0 = time.perf_counter()
        out = layer(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        if i >= 2:
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return fwd / repeat, bwd / repeat


def measure(layers, plan, workers: int, microbatches: int, asynchronous: bool, iterations: int):
    """(seconds per iteration, bubbles, trace) of the engine over the steady-state window."""
    x, y = torch.randn(microbatches * 2, 8), torch.randn(microbatches * 2, 8)
    with RoundPipe(layers, devices=["cpu"] * workers, plan=plan, num_microbatches=microbatches) as model:
        opt = Adam(model.parameters(), lr=1e-4)
        for _ in range(2):   # warm-up: first-call planning dry run, allocations
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        with model.record_trace() as trace:
            for _ in range(iterations):
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=asynchronous)
    ends = iteration_ends(trace)
    window = (ends[1], ends[-2])
    return (window[1] - window[0]) / (iterations - 3), bubbles(trace, window), trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--fwd-ms", type=float, default=4.0)
    p.add_argument("--bwd-ms", type=float, default=8.0)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--png", default=None, help="folder for measured and simulated timelines at the most workers")
    args = p.parse_args(argv)
    iterations = 6 if args.quick else args.iterations
    L = args.layers
    f, b = calibrate(args.fwd_ms / 1e3, args.bwd_ms / 1e3, rows=2)
    costs = Costs.uniform(L - 1, fwd=f, bwd=b, head_fwd=f, head_bwd=b)   # the last layer plays the head
    report = Report("overlap")
    report.note(f"{L} sleep layers of {args.fwd_ms} ms forward, {args.bwd_ms} ms backward, measured as "
                f"{f * 1e3:.3f} / {b * 1e3:.3f} ms per microbatch of 2 rows in plain PyTorch (the simulator's "
                f"costs); CPU workers; steady state over {iterations - 3} iterations; same plan in engine and "
                "simulator; throughput in microbatches/s (M grows with the workers: N + 1 per round)")
    base: dict[str, tuple[float, float]] = {}
    counts = [int(w) for w in args.workers.split(",")]
    for n in counts:
        m = default_round_size(n)
        plan = partition_plan(costs.planner_costs(), n, m)
        for schedule in ("roundpipe", "roundpipe-async"):
            asynchronous = schedule == "roundpipe-async"
            sim = simulate(schedule, costs, n, m, partition=plan)
            # the physical limit: one iteration's compute under this plan, spread over every worker
            limit = sum(t.duration for t in sim.run.schedule.tasks if t.iteration == 0) / n
            t, bub, trace = measure(sleep_layers(L, fwd_s=args.fwd_ms / 1e3, bwd_s=args.bwd_ms / 1e3), plan, n, m,
                                    asynchronous, iterations)
            base.setdefault(schedule, (m / t, m / sim.makespan))
            r1, s1 = base[schedule]
            report.add(schedule=schedule, workers=n, microbatches=m, plan=str(plan),
                       **{"meas ms/it": t * 1e3, "sim ms/it": sim.makespan * 1e3, "meas/sim": t / sim.makespan,
                          "meas % of limit": 100 * limit / t, "sim % of limit": 100 * limit / sim.makespan,
                          "meas bubble %": 100 * bub.ratio, "sim bubble %": 100 * sim.bubbles.ratio,
                          "meas speedup": m / t / r1, "sim speedup": m / sim.makespan / s1})
            if args.png and n == counts[-1]:
                from roundpipe.sim.timeline import draw

                out = Path(args.png)
                out.mkdir(parents=True, exist_ok=True)
                draw(trace, out / f"overlap-{schedule}-{n}w-measured.png",
                     title=f"{schedule}, {n} CPU workers, measured (bubble {100 * bub.ratio:.1f}%)")
                draw(sim.trace(), out / f"overlap-{schedule}-{n}w-simulated.png",
                     title=f"{schedule}, {n} workers, simulated (bubble {100 * sim.bubbles.ratio:.1f}%)")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
