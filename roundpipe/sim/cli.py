"""`roundpipe simulate`: one schedule from uniform layer costs, printed or as JSON.

    roundpipe simulate --schedule 1f1b --gpus 4 --microbatches 8 --layers 16 \\
        --fwd 1 --bwd 2 --head-fwd 4 --head-bwd 8 --comm 0.1 --json
    roundpipe simulate --schedule roundpipe --gpus 4 --microbatches 8 --layers 16 \\
        --partition "8,8|0,4,4,4,4" --png rp.png --trace rp.json
    roundpipe simulate --schedule roundpipe-async --gpus 8 --microbatches 16 --layers 32 \
        --fwd 1 --bwd 2 --ranks 4 --allreduce-gbps 20 --allreduce-latency-us 10 --grad-mb-per-layer 800

    roundpipe simulate --schedule zb-h1 --gpus 4 --microbatches 8 --layers 4 \
        --fwd 1 --bwd 2 --w-fraction 0.5 --no-recompute      # F = B = W = 1, the Zero Bubble paper's model

Times are milliseconds per microbatch.  --w-fraction splits every backward into B
(input gradient) and W (weight gradient, that share of it) for the split schedules
(zb-h1, zb-h2, zb-v, roundpipe-zb); the others run B and W together as before.
"span bubble" is the Zero Bubble paper's bubble rate (longest worker span over its
work: a worker's own fill and drain do not count).  --partition gives stage sizes in layers:
"3,3,4" for the static schedules, "forward...|backward..." for RoundPipe, where the
backward list starts with the fused stage and may start with 0 (a fused stage
holding only the LM head and loss).  Without it the static schedules use the
balanced partition and RoundPipe the planner's.

--ranks W > 1 (RoundPipe only) simulates W data-parallel ranks, each with --gpus
workers and --microbatches microbatches, averaging fp32 gradients by bucketed ring
all-reduce (roundpipe.sim.allreduce); it needs --allreduce-gbps and
--grad-mb-per-layer, and prints the iteration time with the reduction, the
reduction's time and exposed part, and samples/s against one rank.
"""
from __future__ import annotations

import argparse
import json
import sys

from roundpipe.sim.allreduce import MIB, AllReduce
from roundpipe.sim.costs import Costs
from roundpipe.sim.scaling import data_parallel
from roundpipe.sim.simulate import SCHEDULES, simulate


def _sizes(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--partition {what} {text!r} must be comma-separated layer counts, e.g. 3,3,4") from None


def parse_partition(text: str | None, schedule: str):
    if text is None:
        return None
    if schedule.startswith("roundpipe"):
        if text.count("|") != 1:
            raise ValueError(f"--partition={text!r}: RoundPipe needs 'forward sizes|backward sizes', "
                             "e.g. '8,8|0,4,4,4,4'")
        fwd, bwd = text.split("|")
        return _sizes(fwd, "forward list"), _sizes(bwd, "backward list")
    if "|" in text:
        raise ValueError(f"--partition={text!r}: {schedule} takes one list of stage sizes, e.g. 3,3,4")
    return _sizes(text, "list")


def _number(kind: type, minimum: float, strict: bool = False):
    """An argparse type: a `kind` >= minimum (> minimum if strict); argparse names the flag in its error."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an int' if kind is int else 'a number'}") from None
        if not (v > minimum if strict else v >= minimum):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {minimum:g}")
        return v
    return parse


# flag -> default of the data-parallel options that only mean something with --ranks > 1
_DP_FLAGS = {"--allreduce-gbps": None, "--allreduce-latency-us": 0.0, "--bucket-mb": 25.0,
             "--grad-mb-per-layer": None, "--head-grad-mb": 0.0, "--microbatch-size": 1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roundpipe simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=SCHEDULES, default="roundpipe")
    p.add_argument("--gpus", type=int, default=8, help="workers N")
    p.add_argument("--microbatches", type=int, default=16, help="microbatches M per iteration")
    p.add_argument("--layers", type=int, default=32, help="decoder layers L (the LM head is extra)")
    p.add_argument("--fwd", type=float, default=1.0, help="forward ms per layer and microbatch")
    p.add_argument("--bwd", type=float, default=2.0, help="backward-only ms per layer (recompute is added)")
    p.add_argument("--head-fwd", type=float, default=0.0, help="LM head + loss forward ms")
    p.add_argument("--head-bwd", type=float, default=0.0, help="LM head + loss backward ms")
    p.add_argument("--comm", type=float, default=0.0, help="ms per hop between two different GPUs")
    p.add_argument("--w-fraction", type=_number(float, 0), default=0.0,
                   help="weight-gradient share W of each backward (0..1) for zb-* and roundpipe-zb")
    p.add_argument("--no-recompute", action="store_true",
                   help="weight-bound schedules keep activations (no recompute in the backward)")
    p.add_argument("--partition", default=None, help='stage sizes: "3,3,4", or "fwd...|bwd..." for RoundPipe')
    p.add_argument("--chunks", type=int, default=2, help="stages per GPU for interleaved-1f1b / looped-bfs")
    p.add_argument("--iterations", type=int, default=6, help="overlapping iterations for roundpipe-async")
    p.add_argument("--round-size", type=int, default=None,
                   help="RoundPipe microbatches per round (default N + 1, as the engine)")
    dp = p.add_argument_group("data parallel (RoundPipe schedules)")
    dp.add_argument("--ranks", type=_number(int, 1), default=1, help="data-parallel ranks W (processes)")
    dp.add_argument("--allreduce-gbps", type=_number(float, 0, strict=True),
                    help="ring all-reduce bandwidth per rank, GB/s (required with --ranks > 1)")
    dp.add_argument("--allreduce-latency-us", type=_number(float, 0), help="latency per ring step, us (default 0)")
    dp.add_argument("--bucket-mb", type=_number(float, 0, strict=True), help="bucket size, MiB (default 25)")
    dp.add_argument("--grad-mb-per-layer", type=_number(float, 0),
                    help="fp32 gradient MiB per layer (required with --ranks > 1)")
    dp.add_argument("--head-grad-mb", type=_number(float, 0), help="fp32 gradient MiB of the LM head (default 0)")
    dp.add_argument("--microbatch-size", type=_number(int, 1), help="samples per microbatch, for samples/s (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object (times in ms, ratios in percent)")
    p.add_argument("--png", default=None, help="draw the timeline to this PNG file")
    p.add_argument("--trace", default=None, help="save the Chrome/Perfetto trace JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    allreduce = check_data_parallel(parser, args)
    try:
        ms = 1e-3
        costs = Costs.uniform(args.layers, args.fwd * ms, args.bwd * ms, args.head_fwd * ms, args.head_bwd * ms,
                              args.comm * ms, args.w_fraction, not args.no_recompute)
        kwargs = dict(partition=parse_partition(args.partition, args.schedule), chunks=args.chunks,
                      iterations=args.iterations, round_size=args.round_size)
        if allreduce is None:
            result, dp = simulate(args.schedule, costs, args.gpus, args.microbatches, **kwargs), None
        else:
            dp = data_parallel(args.schedule, costs, args.gpus, args.microbatches, allreduce,
                               microbatch_size=args.microbatch_size, **kwargs)
            result = dp.result
    except ValueError as exc:
        parser.error(str(exc))
    summary = {**result.summary(), "gpus": args.gpus, "microbatches": args.microbatches, "layers": args.layers}
    if dp is not None:
        summary["data_parallel"] = dp.summary()
    if args.trace:
        result.trace().save(args.trace)
    if args.png:
        from roundpipe.sim.timeline import draw

        draw(result.trace(), args.png, title=f"{args.schedule}: N={args.gpus}, M={args.microbatches}, "
                                              f"bubble {summary['bubble_ratio']:.1f}%")
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.schedule}: makespan {summary['makespan_ms']:.3f} ms, bubble {summary['bubble_ratio']:.2f}% "
              f"(fill {summary['fill']:.2f}, switch {summary['switch']:.2f}, drain {summary['drain']:.2f}, "
              f"steady {summary['steady']:.2f}), span bubble {summary['span_bubble']:.2f}%, "
              f"exposed comm {summary['exposed_comm']:.2f}%, partition {summary['partition']}")
        if dp is not None:
            d = summary["data_parallel"]
            print(f"data parallel: {d['ranks']} ranks, {d['iteration_ms']:.3f} ms per iteration (one rank alone "
                  f"{d['single_rank_ms']:.3f}), all-reduce {d['reduction_ms']:.3f} ms in {d['buckets']} buckets, "
                  f"exposed {d['exposed_ms']:.3f} ms; {d['samples_per_s']:.1f} samples/s, {d['scaling']:.2f}x "
                  f"one rank ({d['efficiency']:.1f}% efficiency)")
    sys.stdout.flush()
    return 0


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def check_data_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AllReduce | None:
    """The AllReduce the data-parallel flags describe (None for one rank), defaults filled into `args`;
    usage errors name the flag."""
    given = [f for f in _DP_FLAGS if getattr(args, _dest(f)) is not None]
    for flag, default in _DP_FLAGS.items():
        if flag not in given:
            setattr(args, _dest(flag), default)
    if args.ranks == 1:
        if given:
            parser.error(f"{given[0]} needs --ranks > 1 (data parallelism), got --ranks 1")
        return None
    if not args.schedule.startswith("roundpipe"):
        parser.error(f"--ranks {args.ranks}: data parallelism is modelled for the roundpipe and roundpipe-async "
                     f"schedules only, not --schedule {args.schedule}")
    for flag in ("--allreduce-gbps", "--grad-mb-per-layer"):
        if flag not in given:
            parser.error(f"--ranks {args.ranks} needs {flag}")
    if args.bucket_mb * MIB < 1:
        parser.error(f"--bucket-mb {args.bucket_mb} is under one byte")
    return AllReduce.uniform(args.ranks, args.layers, args.grad_mb_per_layer * MIB, args.head_grad_mb * MIB,
                             bandwidth_gbps=args.allreduce_gbps, latency_us=args.allreduce_latency_us,
                             bucket_bytes=int(args.bucket_mb * MIB))
