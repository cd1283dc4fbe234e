"""`roundpipe simulate`: one schedule from uniform layer costs, printed or as JSON.

    roundpipe simulate --schedule 1f1b --gpus 4 --microbatches 8 --layers 16 \\
        --fwd 1 --bwd 2 --head-fwd 4 --head-bwd 8 --comm 0.1 --json
    roundpipe simulate --schedule roundpipe --gpus 4 --microbatches 8 --layers 16 \\
        --partition "8,8|0,4,4,4,4" --png rp.png --trace rp.json

Times are milliseconds per microbatch.  --partition gives stage sizes in layers:
"3,3,4" for the static schedules, "forward...|backward..." for RoundPipe, where the
backward list starts with the fused stage and may start with 0 (a fused stage
holding only the LM head and loss).  Without it the static schedules use the
balanced partition and RoundPipe the planner's.
"""
from __future__ import annotations

import argparse
import json
import sys

from roundpipe.sim.costs import Costs
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
    p.add_argument("--partition", default=None, help='stage sizes: "3,3,4", or "fwd...|bwd..." for RoundPipe')
    p.add_argument("--chunks", type=int, default=2, help="stages per GPU for interleaved-1f1b / looped-bfs")
    p.add_argument("--iterations", type=int, default=6, help="overlapping iterations for roundpipe-async")
    p.add_argument("--round-size", type=int, default=None,
                   help="RoundPipe microbatches per round (default N + 1, as the engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object (times in ms, ratios in percent)")
    p.add_argument("--png", default=None, help="draw the timeline to this PNG file")
    p.add_argument("--trace", default=None, help="save the Chrome/Perfetto trace JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        ms = 1e-3
        costs = Costs.uniform(args.layers, args.fwd * ms, args.bwd * ms, args.head_fwd * ms, args.head_bwd * ms,
                              args.comm * ms)
        result = simulate(args.schedule, costs, args.gpus, args.microbatches,
                          parse_partition(args.partition, args.schedule), chunks=args.chunks,
                          iterations=args.iterations, round_size=args.round_size)
    except ValueError as exc:
        parser.error(str(exc))
    summary = {**result.summary(), "gpus": args.gpus, "microbatches": args.microbatches, "layers": args.layers}
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
              f"steady {summary['steady']:.2f}), exposed comm {summary['exposed_comm']:.2f}%, "
              f"partition {summary['partition']}")
    sys.stdout.flush()
    return 0
