"""`roundpipe plan`: questions of the planner.  `max-seq-len`: the longest sequence a Hugging Face model trains
with under a memory cap; `max-resolution`: the largest image or video a diffusion transformer trains with.

    roundpipe plan max-seq-len --hf-config qwen3-1.7b --device-memory 24GiB --workers 8
    roundpipe plan max-seq-len --hf-config ./my-model/config.json --hf-config llama-3.1-8b --device-memory 22GiB

Prints, per config, the longest sequence (batch 1) for which the planner accepts every layer under
the cap (roundpipe/hf/context.py: the engine's own dry run and partitioner, no GPU needed) and the
bytes of the layer that binds: weights, gradients, saved activations (of which attention), with the
LM-head loss's workspace beside.  `--details` adds the per-part table of every layer kind.

Why a subcommand and not a `--max-seq-len` flag: a flag of that name reads as a setting (HF's
`max_seq_length` sets the truncation length); `plan max-seq-len` names the question asked, and
`roundpipe plan` can take further questions of the planner the same way.

`roundpipe plan max-resolution`: the same question of a diffusion transformer (Flux, SD3, Wan; roundpipe/
diffusers/context.py): the largest square image (multiples of 16 px) per image model, and the most
frames (4k + 1) at 480p and 720p per video model, that train under the cap (default 24 GiB):

    roundpipe plan max-resolution                                  # flux-dev, sd3.5-large, sd3.5-medium, wan2.1-14b
    roundpipe plan max-resolution --model flux-dev --lora --device-memory 22GiB --details
    roundpipe plan max-resolution --model wan2.1-14b --video-size 480x832 --video-size 720x1280

Every answer is the planner's prediction (a meta-device dry run of the layers rp.diffusers.wrap cuts, no
GPU), unmeasured on a GPU; each model takes 10-40 s on 2 cores (a few dry runs of 2 s each).
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

    from roundpipe.diffusers.shapes import SHAPES as DIT_SHAPES
    d = sub.add_parser("max-resolution", help="the largest image (or most video frames) a diffusion transformer "
                                              "trains with under a device-memory cap")
    d.add_argument("--model", action="append", metavar="SHAPE_OR_CONFIG",
                   help=f"a built-in shape ({', '.join(DIT_SHAPES)}) or a diffusers transformer config.json "
                        "(with _class_name); repeat for several (default: every built-in shape)")
    d.add_argument("--device-memory", type=parse_bytes, default=24 << 30, metavar="SIZE",
                   help="the per-worker cap, as RoundPipe(device_memory=...) (default 24GiB)")
    d.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 16 on the attention projections) "
                                                       "over the frozen transformer (default: full fine-tuning)")
    d.add_argument("--batch", type=_positive_int, default=1, help="samples per microbatch (default 1)")
    d.add_argument("--workers", type=_positive_int, default=1, help="worker count the plan is made for (default 1)")
    d.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (default bf16, as on GPU workers)")
    d.add_argument("--video-size", action="append", type=_video_size, metavar="HxW",
                   help="a video model's frame size in pixels, for its most frames (default 480x832 and 720x1280)")
    d.add_argument("--details", action="store_true", help="per-part bytes of each layer kind, per answer")
    return p


VIDEO_SIZES = ((480, 832), (720, 1280))   # Wan2.1's 480p and 720p


def _video_size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", text)
    if not m or int(m.group(1)) < 16 or int(m.group(2)) < 16 or int(m.group(1)) % 16 or int(m.group(2)) % 16:
        raise argparse.ArgumentTypeError(f"{text!r} must be HEIGHTxWIDTH in pixels, multiples of 16 (e.g. 480x832)")
    return int(m.group(1)), int(m.group(2))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.question == "max-resolution":
        return max_resolution(args)
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
    print(f"device memory {_gib(args.device_memory)} GiB per worker ({args.device_memory:,} bytes), "
          f"{args.workers} worker(s), {args.dtype}, recompute={args.recompute}, batch 1; GiB per part at the max length "
          "(a prediction of the planner's memory model, partition_for_cap's stage limit):")
    return _print_table(rows, 3, [f for _, f in fits] if args.details else [])


def _print_table(rows: list[tuple], left: int, details: list) -> int:
    """The rows aligned (the first `left` columns to the left, the rest to the right), then each of `details`'
    own table; the command's exit status."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for f in details:
        print()
        print(f.table())
    return 0


def max_resolution(args) -> int:
    """`roundpipe plan max-resolution`: per image model its largest square image, per video model its most
    frames at each --video-size, under the cap; one row each, then --details' tables."""
    from roundpipe.commands.train_loops import DTYPES as TORCH_DTYPES  # imports torch: after parsing
    from roundpipe.diffusers.context import load_shape, max_frames
    from roundpipe.diffusers.context import max_resolution as fit_resolution
    from roundpipe.diffusers.shapes import SHAPES as DIT_SHAPES
    dtype = TORCH_DTYPES[args.dtype]
    common = dict(device_memory=args.device_memory, batch=args.batch, dtype=dtype, lora=args.lora, workers=args.workers)
    fits = []
    for model in args.model or list(DIT_SHAPES):
        try:
            shape = load_shape(model)
            if shape.kind == "video":
                fits += [(model, max_frames(shape, height=h, width=w, **common)) for h, w in args.video_size or VIDEO_SIZES]
            else:
                fits.append((model, fit_resolution(shape, **common)))
        except (ValueError, TypeError) as e:
            print(f"roundpipe plan: --model {model!r}: {e}", file=sys.stderr)
            return 2
    head = ("model", "question", "largest that trains", "latent tokens", "binding layer", "weights", "gradients",
            "activations", "(attention)", "refused at")
    rows = [head]
    for m, f in fits:
        b = f.binding
        question = "resolution" if f.question == "resolution" else f"frames at {f.width}x{f.height}"
        answer = f"{f.width}x{f.height}" if f.question == "resolution" else f"{f.frames} frames"
        limit = " (model's limit)" if f.at_search_limit else ""
        rows.append((m, question, answer + limit, f"{f.tokens:,}", b.name, _gib(b.weights), _gib(b.gradients),
                     _gib(b.activations), _gib(b.attention), f.refused or "-"))
    what = "LoRA (rank 16, attention projections)" if args.lora else "full fine-tuning"
    print(f"device memory {_gib(args.device_memory)} GiB per worker ({args.device_memory:,} bytes), {what}, "
          f"{args.workers} worker(s), {args.dtype}, batch {args.batch}; GiB per part at the answer. PREDICTED by the "
          "planner's memory model (meta-device dry run of rp.diffusers.wrap's layers), UNMEASURED ON GPU; the VAE "
          "and text encoders are not counted (not on the workers):")
    return _print_table(rows, 5, [f for _, f in fits] if args.details else [])


if __name__ == "__main__":
    sys.exit(main())
