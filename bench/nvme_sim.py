"""Where a GPU box's step becomes disk-bound: training with state on NVMe against training in RAM (simulated).

The state tier (`RoundPipe(offload_dir=, host_memory=)`, roundpipe.offload.state_tier)
reads an offloaded layer's bytes before its per-layer host step and writes them
behind; roundpipe.sim.disk gives the drive a worker of its own, so the reads ahead and
writes behind overlap the rest of the step, the backward still running and (one step
stale) the next call, as in the engine.  Per row: the same schedule with every byte in
RAM, and with the layers that do not fit on a drive of --disk-gbps (read = write,
unless --write-ratio); the ratio is the cost of the tier, and "disk s" the drive's
seconds a step (every on-disk byte read once and written once).

What goes to disk (Disk.first_fit, the tier's placement): "state 100%": every layer's
AdamW state (8 B/param: exp_avg, exp_avg_sq in fp32); "state 50%": host_memory holds
half of the state beside the rest, first fit from layer 0; "state+masters": the AdamW
state and the fp32 masters of every layer (12 B/param, phase 2 of the tier).

GPUs, links, host rates and batches as bench/host_step_sim.py (its model, planner
partition and measured fused AdamW rate; host x --host-scale, default 4: an 8-GPU box's
~170 GB/s host memory); the schedule is "roundpipe-async" (one step stale, the engine's
default) and "roundpipe" (synchronous).  Batch: --batch-seqs sequences of --seq tokens an
iteration in microbatches of --mb-seqs, rounded up to whole rounds of N + 1.
Simulated, not measured on any GPU or drive.

    python bench/nvme_sim.py [--out bench/results] [--no-save]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from host_step_sim import BUDGET, Llama, measured_rates, model  # noqa: E402

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.planner import partition  # noqa: E402
from roundpipe.sim import Disk, HostStep, host_step, sizes_from_plan  # noqa: E402

MODELS = {"Llama-3.1-8B": Llama(),
          "Llama-3.1-70B": Llama(layers=80, hidden=8192, inter=28672, q_heads=64, kv_heads=8)}
PLACEMENTS = (   # label, bytes a parameter on disk when offloaded, fraction of the state kept in RAM
    ("state 100%", 8.0, 0.0),
    ("state 50%", 8.0, 0.5),
    ("state+masters", 12.0, 0.0),
)
SCHEDULES = ("roundpipe-async", "roundpipe")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/nvme_sim.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default="1,8")
    parser.add_argument("--disk-gbps", default="3.5,7,14", help="drive read GB/s, comma-separated")
    parser.add_argument("--write-ratio", type=float, default=1.0, help="write GB/s = read GB/s x this")
    parser.add_argument("--pcie-gbps", type=float, default=22.0)
    parser.add_argument("--tflops", type=float, default=165.0)
    parser.add_argument("--mfu", type=float, default=0.6)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb-seqs", type=int, default=4)
    parser.add_argument("--batch-seqs", type=int, default=64)
    parser.add_argument("--host-scale", type=float, default=4.0)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--rates", default=str(ROOT / "bench/results/cpu_optim.jsonl"))
    add_common_args(parser)
    args = parser.parse_args(argv)
    rates, runs = measured_rates(Path(args.rates))
    rate = rates["fused"] * args.host_scale
    report = Report("nvme_sim", columns=["model", "GPUs", "schedule", "on disk", "disk GB", "disk GB/s", "RAM iter s",
                                         "tier iter s", "x RAM", "disk s", "tokens/s"])
    tokens = args.mb_seqs * args.seq
    for name in args.models.split(","):
        m = MODELS[name]
        costs, uploads, planner = model(m, tokens, args.seq, args.tflops * 1e12 * args.mfu, args.pcie_gbps)
        params = (float(m.embedding),) + (float(m.layer_params),) * m.layers + (float(m.head),)
        for N in (int(g) for g in args.gpus.split(",")):
            rounds = math.ceil(args.batch_seqs / args.mb_seqs / (N + 1))
            M = rounds * (N + 1)
            fwd, bwd = sizes_from_plan(partition(planner, N, M, memory_budget=BUDGET).plan, costs)
            kw = dict(partition=(fwd, bwd), iterations=args.iterations, uploads=uploads)
            for schedule in SCHEDULES:
                ram = host_step(schedule, costs, N, M, HostStep(params, rate), **kw)
                for label, per_param, kept in PLACEMENTS:
                    state = [8.0 * p for p in params]
                    budget = kept * sum(state) + 3 * per_param * max(params) if kept else None
                    for gbps in (float(x) for x in args.disk_gbps.split(",")):
                        disk = Disk.first_fit([per_param * p for p in params], budget, gbps, gbps * args.write_ratio)
                        r = host_step(schedule, costs, N, M, HostStep(params, rate, disk=disk), **kw)
                        report.add(model=name, GPUs=N, schedule=schedule, **{
                            "on disk": label, "disk GB": disk.bytes / 1e9, "disk GB/s": gbps,
                            "RAM iter s": ram.iteration, "tier iter s": r.iteration,
                            "x RAM": r.iteration / ram.iteration, "disk s": disk.time(),
                            "tokens/s": M * tokens / r.iteration},
                            write_gbps=gbps * args.write_ratio, step_s=ram.step, microbatches=M, mb_seqs=args.mb_seqs,
                            seq=args.seq, host_rate_params_s=rate, tflops=args.tflops, mfu=args.mfu,
                            pcie_gbps=args.pcie_gbps, partition=f"{','.join(map(str, fwd))}|{','.join(map(str, bwd))}",
                            simulated=True)
    report.note(f"SIMULATED (roundpipe.sim: host step, weight uploads and roundpipe.sim.disk), unmeasured on any GPU "
                f"or drive; {args.tflops:g} TFLOP/s x MFU {args.mfu:g} per GPU, PCIe {args.pcie_gbps:g} GB/s per GPU, "
                f"{args.batch_seqs} x {args.seq} tokens an iteration (rounded up to whole rounds) in microbatches of "
                f"{args.mb_seqs}; drive write = read x {args.write_ratio:g}, reads and writes share it")
    report.note(f"host step: fused AdamW at {rate / 1e6:.0f} M params/s (x{args.host_scale:g} the mean of the adamw "
                f"50M rows of " + "; ".join(runs) + "); on disk: 'state 100%' every layer's AdamW state (8 B/param), "
                "'state 50%' half of it kept in RAM first fit from layer 0, 'state+masters' state and fp32 masters "
                "(12 B/param)")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
