"""`roundpipe plan max-seq-len`: the longest sequence a Hugging Face model trains with under a memory cap.

    roundpipe plan max-seq-len --hf-config qwen3-1.7b --device-memory 24GiB --workers 8
    roundpipe plan max-seq-len --hf-config ./my-model/config.json --hf-config llama-3.1-8b --device-memory 22GiB

Prints, per config, the longest sequence (batch 1) for which the planner accepts every layer under
the cap (roundpipe/hf/context.py: the engine's own dry run and partitioner, no GPU needed) and the
bytes of the layer that binds: weights, gradients, saved activations (of which attention), with the
LM-head loss's workspace beside.  `--details` adds the per-part table of every layer kind.

Why a subcommand and not a `--max-seq-len` flag: a flag of that name reads as a setting (HF's
`max_seq_length` sets the truncation length); `plan max-seq-len` names the question asked, and
`roundpipe plan` can take further questions of the planner the same way.
"""
from __future__ import annotations

import argparse
import re
import sys

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DTYPES = ("bf16", "fp16", "fp32")   # names of commands/train_loops.DTYPES (torch is imported later)


def parse_bytes(text: str) -> int:
    """'24GiB', '22.5 GiB', '24GB' or a plain byte count -> bytes (argparse names the flag on error)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in UNITS):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with a unit "
                                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; e.g. 24GiB)")
    n = int(float(m.group(1)) * UNITS[unit or "b"])
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return n


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roundpipe plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="question", required=True, metavar="QUESTION")
    q = sub.add_parser("max-seq-len", help="the longest sequence (batch 1) that trains under a device-memory cap")
    from roundpipe.hf.context import SHAPES
    q.add_argument("--hf-config", action="append", metavar="PATH_OR_SHAPE",
                   help=f"a config.json, a folder holding one, or a built-in shape ({', '.join(SHAPES)}); "
                        "repeat for several (default: every built-in shape)")
    q.add_argument("--device-memory", type=parse_bytes, required=True, metavar="SIZE",
                   help="the per-worker cap, as RoundPipe(device_memory=...): bytes or e.g. 24GiB, 22.5GiB, 24GB")
    q.add_argument("--workers", type=_positive_int, default=1, help="worker count the plan is made for (default 1)")
    q.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (default bf16, as on GPU workers)")
    q.add_argument("--recompute", choices=("stage", "layer"), default="stage",
                   help="RoundPipe's recompute= grain the plan is made for (default stage; layer grain lets backward "
                        "stages hold more layers, not longer sequences: a one-layer stage holds the same bytes)")
    q.add_argument("--details", action="store_true", help="per-part bytes of every layer kind, per config")
    return p


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from roundpipe.commands.train_loops import DTYPES as TORCH_DTYPES  # imports torch: after parsing
    from roundpipe.hf.context import SHAPES, max_seq_len
    dtype = TORCH_DTYPES[args.dtype]
    fits = []
    for config in args.hf_config or list(SHAPES):
        try:
            fits.append((config, max_seq_len(config, args.device_memory, args.workers, dtype, args.recompute)))
        except (ValueError, TypeError) as e:
            print(f"roundpipe plan: --hf-config {config!r}: {e}", file=sys.stderr)
            return 2
    head = ("config", "max seq len", "binding layer", "weights", "gradients", "activations", "(attention)",
            "LM-head workspace", "backward stages")
    rows = [head] + [(c, f"{f.seq_len:,}{'+' if f.at_search_limit else ''}", f.binding.name, _gib(f.binding.weights),
                      _gib(f.binding.gradients), _gib(f.binding.activations), _gib(f.binding.attention),
                      _gib(f.head_workspace), str(len(f.plan.backward))) for c, f in fits]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"device memory {_gib(args.device_memory)} GiB per worker ({args.device_memory:,} bytes), "
          f"{args.workers} worker(s), {args.dtype}, recompute={args.recompute}, batch 1; GiB per part at the max length "
          "(a prediction of the planner's memory model, partition_for_cap's stage limit):")
    for r in rows:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    if args.details:
        for _, f in fits:
            print()
            print(f.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
