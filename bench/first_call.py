"""The first training call against a steady one, each process fresh: what a new user waits for.

Each run is a fresh interpreter that builds a model, times its first training call and then the
median of three more (the steady call), and reports whether sympy and
torch.fx.experimental.symbolic_shapes were imported by then.  Providers, interleaved run by run:

- roundpipe: `RoundPipe(layers, devices=["cpu"])`, `forward_backward` + `synchronize`; the first
  call also plans from a dry run of the layers (roundpipe/engine/autoplan.py, memory_probe.py).
- torch: the same layers as an `nn.Sequential`, forward, loss, `backward()` (the plain loop).

Models: an 8-layer MLP (Linear 256x256 + GELU, 16 rows) and the `roundpipe train` default
tiny decoder (roundpipe/models/tiny_decoder.py, 16 x 128 bytes).  The table gives medians over
`--runs` processes of the first call, the steady call and their difference.  Target: the
first roundpipe call within +0.15 s of a steady one (issue 37: torch.autograd's check of
explicit output gradients imported sympy, 0.6 s, on the first call only).

    python bench/first_call.py [--runs 5] [--threads 1] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from roundpipe.bench.runner import Report, add_common_args

ROOT = Path(__file__).resolve().parents[1]

# One fresh interpreter: argv = case, provider, torch threads.  Prints one JSON line.
_CHILD = """
import json, statistics, sys, time
import torch
from torch import nn
case, provider, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if threads > 0:
    torch.set_num_threads(threads)
import roundpipe as rp

torch.manual_seed(0)
if case == "mlp":
    layers = [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]
    x, labels = torch.randn(16, 256), torch.randn(16, 256)
    loss_fn = lambda out, y: ((out - y) ** 2).mean()
else:
    from roundpipe.commands.train import TrainConfig
    from roundpipe.models.tiny_decoder import build_layers, loss_fn
    cfg = TrainConfig(devices=["cpu"]).resolved()
    layers = build_layers(cfg.model_config(), seed=0)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len))
    labels = torch.roll(x, -1, 1)

if provider == "roundpipe":
    model = rp.RoundPipe(layers, devices=["cpu"])
    def call():
        model.forward_backward(x, labels=labels, loss_fn=loss_fn)
        model.synchronize()
else:
    model = nn.Sequential(*layers)
    def call():
        loss_fn(model(x), labels).backward()

times = []
for _ in range(4):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
imported = [m for m in ("sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules]
if provider == "roundpipe":
    model.close()
print(json.dumps({"first": times[0], "steady": statistics.median(times[1:]), "imported": imported}))
"""


def measure(case: str, provider: str, threads: int) -> dict:
    child = subprocess.run([sys.executable, "-c", _CHILD, case, provider, str(threads)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"{case}/{provider} child failed:\n{child.stderr}")
    return json.loads(child.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/first_call.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per (model, provider) (default 5)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in each child; 0 keeps torch's default (default 1: on a "
                             "shared 2-core machine two spinning threads make every call noisy)")
    parser.add_argument("--models", default="mlp,decoder", help="comma-separated: mlp, decoder")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be >= 1")
    if args.threads < 0:
        parser.error(f"--threads={args.threads} must be >= 0")
    cases = [c for c in args.models.split(",") if c]
    for c in cases:
        if c not in ("mlp", "decoder"):
            parser.error(f"--models: {c!r} is not one of mlp, decoder")
    providers = ["roundpipe", "torch"]
    samples: dict[tuple[str, str], list[dict]] = {(c, p): [] for c in cases for p in providers}
    for _ in range(args.runs):   # interleaved, so a burst of load hits every provider alike
        for c in cases:
            for p in providers:
                samples[c, p].append(measure(c, p, args.threads))

    report = Report("first_call", columns=["model", "provider", "runs", "first call s", "steady call s",
                                           "difference s", "min difference s", "imports sympy"], device="cpu")
    names = {"mlp": "8-layer MLP 256, 16 rows", "decoder": "tiny decoder, 16 x 128"}
    for (c, p), rows in samples.items():
        first = statistics.median(r["first"] for r in rows)
        steady = statistics.median(r["steady"] for r in rows)
        report.add(model=names[c], provider=p, runs=len(rows), **{
            "first call s": first, "steady call s": steady, "difference s": first - steady,
            "min difference s": min(r["first"] - r["steady"] for r in rows),
            "imports sympy": f"{sum(bool(r['imported']) for r in rows)}/{len(rows)}"})
    report.note(f"fresh interpreter per run; torch threads {args.threads or 'default'}; medians over runs; "
                "steady = median of calls 2-4; target: roundpipe difference < 0.15 s")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
