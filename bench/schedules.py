"""Predicted bubbles and speedups of pipeline schedules for three real model shapes.

For layer costs shaped like Qwen3-1.7B (28 layers), Llama-3.1-8B (32) and
Qwen3-32B (64) on 8 GPUs with 16 microbatches, simulates GPipe, 1F1B,
interleaved 1F1B and looped BFS (v = 2) with the balanced weight-bound partition,
and RoundPipe synchronous and asynchronous with the partition roundpipe.planner
picks, and reports each schedule's bubble ratio (split into fill / switch / drain
/ steady), exposed communication, and the predicted speedup of RoundPipe sync and
async over it.  Rows marked "(sim-tuned)" use the best of the planner's candidate
partitions by simulated time (roundpipe.sim.tune) instead of the objective's
pick, to show what the closed-form objective leaves on the table.  Nothing is
measured on hardware: this is roundpipe.sim.

Cost assumptions (all stated, all per microbatch of one sequence of --seq tokens;
only their ratios matter for bubbles, the absolute scale sets comm vs compute):
- shapes from roundpipe/shapes.py (the published configs); decoder layer
  forward = (2 x layer params + 2 x seq x q_dim) FLOPs per token
  (matmuls + causal attention) at RATE = 100 TFLOP/s (an RTX 4090's ~165 dense
  bf16 peak at ~60%); backward-only = 2 x forward; recompute is added by the
  simulator's rules;
- LM head forward = 2 x hidden x vocab FLOPs per token at RATE plus the loss's
  memory traffic, 8 bytes per logit at BW = 0.9 TB/s; head backward = 2 x the head
  matmul + the same loss traffic (this gives head/layer forward ratios of 6.9x,
  2.6x and 1.7x for the three models: a large vocabulary relative to the width
  makes the head heavy in small models);
- communication per hop between two GPUs: the bf16 activation (seq x hidden x 2
  bytes) down to host and up again over PCIe 4.0 at 22 GB/s each way;
- planner memory budget 24 GB (RTX 4090), bf16 weights, activations 34 x seq x
  hidden bytes per layer (Korthikanti et al. 2022, without attention scores).

    python bench/schedules.py                       # all three models, rows to ./roundpipe-bench-results/
    python bench/schedules.py --out bench/results   # add the rows to the committed ones
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.planner import LayerCost, partition  # noqa: E402
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, QWEN3_32B, DecoderShape  # noqa: E402
from roundpipe.sim import Costs, simulate, sizes_from_plan  # noqa: E402
from roundpipe.sim.tune import best_partition  # noqa: E402

RATE = 100e12     # FLOP/s
BW = 0.9e12       # GPU memory bytes/s, for the cross-entropy's logit traffic
PCIE = 22e9       # bytes/s per direction, pinned, PCIe 4.0 x16
BUDGET = 24e9     # bytes per GPU


def shape_costs(shape: DecoderShape, seq: int) -> tuple[Costs, list[LayerCost]]:
    """Simulator costs and the planner's per-layer costs (layers + head) for one microbatch."""
    layer = shape.layer_parameters()
    fwd = (2 * layer + 2 * seq * shape.q_dim) * seq / RATE
    head_mm = 2 * shape.hidden * shape.vocab * seq / RATE
    loss = 8 * seq * shape.vocab / BW
    comm = 2 * seq * shape.hidden * 2 / PCIE
    costs = Costs.uniform(shape.layers, fwd, 2 * fwd, head_mm + loss, 2 * head_mm + loss, comm)
    act = 34 * seq * shape.hidden
    planner = [LayerCost(fwd, 3 * fwd, 2 * layer, act) for _ in range(shape.layers)]
    planner.append(LayerCost(costs.head_fwd, costs.head_fwd + costs.head_bwd, 2 * shape.hidden * shape.vocab,
                             6 * seq * shape.vocab))
    return costs, planner


SHAPES = {s.key: s for s in (QWEN3_1_7B, LLAMA_3_1_8B, QWEN3_32B)}   # roundpipe/shapes.py
BASELINES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/schedules.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per microbatch")
    parser.add_argument("--iterations", type=int, default=10, help="overlapping iterations for roundpipe-async")
    parser.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=True,
                        help="also simulate every greedy candidate partition and report the best")
    add_common_args(parser)
    args = parser.parse_args(argv)
    N, M = args.gpus, args.microbatches
    report = Report("schedules", columns=["model", "schedule", "partition", "iter ms", "bubble %", "fill",
                                          "switch", "drain", "steady", "exp comm %", "RP sync x", "RP async x"])
    for key in args.models.split(","):
        if key not in SHAPES:
            parser.error(f"--models: unknown model {key!r}; choose from {sorted(SHAPES)}")
        shape = SHAPES[key]
        costs, planner_costs = shape_costs(shape, args.seq)
        start = time.perf_counter()
        best = partition(planner_costs, N, M, memory_budget=BUDGET)
        plan_s = time.perf_counter() - start
        rp_sizes = sizes_from_plan(best.plan, costs)
        results = {s: simulate(s, costs, N, M) for s in BASELINES}
        results["roundpipe"] = simulate("roundpipe", costs, N, M, partition=rp_sizes)
        results["roundpipe-async"] = simulate("roundpipe-async", costs, N, M, partition=rp_sizes,
                                              iterations=args.iterations)
        if args.tuned:
            for schedule in ("roundpipe", "roundpipe-async"):
                results[schedule + " (sim-tuned)"] = best_partition(
                    costs, N, M, schedule, BUDGET, args.iterations, layer_costs=planner_costs)[1]
        sync, asyn = results["roundpipe"].makespan, results["roundpipe-async"].makespan
        for name, r in results.items():
            s = r.summary()
            part = r.partition if isinstance(r.partition, list) else "|".join(
                ",".join(map(str, x)) for x in r.partition)
            report.add(model=shape.name, schedule=name, partition=",".join(map(str, part)) if isinstance(part, list)
                       else part, **{"iter ms": s["makespan_ms"], "bubble %": s["bubble_ratio"], "fill": s["fill"],
                                     "switch": s["switch"], "drain": s["drain"], "steady": s["steady"],
                                     "exp comm %": s["exposed_comm"], "RP sync x": r.makespan / sync,
                                     "RP async x": r.makespan / asyn},
                       gpus=N, microbatches=M, seq=args.seq, plan_seconds=plan_s,
                       head_over_layer_fwd=costs.head_fwd / costs.fwd[0], comm_ms=costs.comm * 1e3)
        report.note(f"{shape.name}: layer fwd {costs.fwd[0] * 1e3:.2f} ms, head fwd/bwd "
                    f"{costs.head_fwd * 1e3:.2f}/{costs.head_bwd * 1e3:.2f} ms "
                    f"({costs.head_fwd / costs.fwd[0]:.1f}x a layer), comm {costs.comm * 1e3:.2f} ms/hop; "
                    f"planner {plan_s * 1e3:.0f} ms -> {best.plan}")
    report.note("'(sim-tuned)': the best of the planner's greedy candidate partitions by simulated time, "
                "not the planner's pick; the speedup columns compare with the planner's pick")
    report.note("simulated (roundpipe.sim), not measured; cost assumptions in the module docstring. "
                "'RP sync x' = this schedule's time per iteration / RoundPipe sync's (>1: RoundPipe faster)")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
