"""Training with the optimizer state on NVMe against the same model in RAM, in one run.

A stack of Linear+Tanh layers trained with rp.optim.AdamW (or AdamW8bit) on CPU workers,
twice per step mode: all state in RAM, and with `offload_dir=` and a `host_memory` that
leaves room for a quarter of the optimizer state (the state is 3x what fits beside the
masters, upload copies, gradients and the ring).  With --compute bf16 (fp32 masters, bf16
upload copies: masters that can move) the `host_memory` leaves room for a quarter of the
masters instead (phase 2: all the state and 3/4 of the masters on disk).  Each configuration runs in its own
child process so that its peak RSS (ru_maxrss) is its own; the row also carries the RSS
of the child before it built the model (interpreter + torch: the fixed costs) and the
arena's reservation.  Committed rows: bench/results/nvme_train.jsonl.

    python bench/nvme_train.py [--quick] [--dir /nvme/scratch] [--optimizer AdamW8bit] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402

COLUMNS = ["optimizer", "compute", "mode", "placement", "params", "state_MB", "on_disk_MB", "masters_on_disk_MB",
           "host_memory_MB", "step_ms",
           "x RAM", "peak_rss_MB", "rss_saved_MB", "base_rss_MB", "budget+fixed_MB"]


def _reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS of this process (VmHWM; Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    """VmHWM (since the last reset), else ru_maxrss (since the process began)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(args) -> dict:
    """One configuration: build, warm up, time `steps` call+step pairs; prints a JSON row."""
    import roundpipe as rp
    base = _current_rss_mb()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)]
    make = {"AdamW": rp.optim.AdamW, "AdamW8bit": rp.optim.AdamW8bit}[args.optimizer]
    offload = {}
    if args.placement == "disk":
        offload = {"offload_dir": args.dir, "host_memory": args.host_memory}
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.compute]
    with rp.RoundPipe(layers, devices=["cpu"], num_microbatches=2, compute_dtype=dtype, **offload) as model:
        opt = make(model.parameters(), lr=1e-4)
        times = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                _reset_peak_rss()   # the peak of training, not of building the model
            t0 = time.perf_counter()
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=args.mode == "async")
            if args.mode == "sync":
                model.synchronize()
            times.append(time.perf_counter() - t0)
        model.synchronize()
        host = model.memory_stats(opt)["host"]
        peak = _peak_rss_mb()
    return {"step_s": statistics.median(times[args.warmup:]), "peak_rss_MB": peak, "base_rss_MB": base,
            "host": host, "params": sum(p.numel() for p in model.parameters())}


def run_child(args, placement: str, mode: str, host_memory: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--placement", placement, "--mode", mode, "--width",
           str(args.width), "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--optimizer", args.optimizer, "--dir", args.dir, "--compute", args.compute]
    if host_memory is not None:
        cmd += ["--host-memory", str(host_memory)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def state_bytes_per_param(optimizer: str) -> float:
    return 8.0 if optimizer == "AdamW" else 2.0 + 8 / 256


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--dir", default=None, help="offload folder (default: the temp folder)")
    parser.add_argument("--optimizer", default="AdamW", choices=["AdamW", "AdamW8bit"])
    parser.add_argument("--compute", default="fp32", choices=["fp32", "bf16"],
                        help="compute dtype: fp32 (masters are their upload copies: only state moves) or bf16")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--placement", default="ram", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="async", help=argparse.SUPPRESS)
    parser.add_argument("--host-memory", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.width = args.width or (1024 if args.quick else 2048)
    args.layers = args.layers or 8
    args.steps = args.steps or (4 if args.quick else 8)
    args.dir = args.dir or tempfile.gettempdir()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    report = Report("nvme_train", columns=COLUMNS, device="cpu")
    numel = args.layers * (args.width * args.width + args.width)
    per_layer = state_bytes_per_param(args.optimizer) * numel / args.layers
    state = per_layer * args.layers
    item = 4 if args.compute == "fp32" else 2
    if args.compute == "fp32":   # masters are their own upload copies; gradients 2 x item a parameter
        fixed = numel * (4 + 2 * item)
        ring = 3 * (int(per_layer) + 2 * 4096)
        host_memory = int(fixed + ring + state / 4)   # a quarter of the state fits: the state is ~3x what fits beside
    else:   # upload copies and gradients stay; all state and 3/4 of the masters go to disk (phase 2)
        fixed = numel * (item + 2 * item)
        ring = 3 * (int(per_layer) + 4 * numel // args.layers + 4 * 4096)
        host_memory = int(fixed + ring + 4 * numel / 4)
    for mode in ("async", "sync"):
        ram = run_child(args, "ram", mode, None)
        disk = run_child(args, "disk", mode, host_memory)
        for placement, r in (("ram", ram), ("disk", disk)):
            h = r["host"]
            report.add(optimizer=args.optimizer, compute=args.compute, mode=mode, placement=placement,
                       params=r["params"], state_MB=state / 2**20,
                       on_disk_MB=h.get("optimizer_state_on_disk", 0) / 2**20,
                       masters_on_disk_MB=h.get("masters_on_disk", 0) / 2**20,
                       host_memory_MB=host_memory / 2**20 if placement == "disk" else None,
                       step_ms=r["step_s"] * 1e3, **{"x RAM": r["step_s"] / ram["step_s"]},
                       peak_rss_MB=r["peak_rss_MB"], rss_saved_MB=ram["peak_rss_MB"] - r["peak_rss_MB"],
                       base_rss_MB=r["base_rss_MB"],
                       **{"budget+fixed_MB": (host_memory / 2**20 + r["base_rss_MB"]
                                              + h.get("arena_reserved", 0) / 2**20 - h.get("arena_in_use", 0) / 2**20)
                          if placement == "disk" else None})
    report.note(f"folder {args.dir}; {args.layers} x Linear({args.width}) + Tanh, batch {args.batch}, 2 microbatches, "
                f"1 CPU worker, torch threads {torch.get_num_threads()}; median of {args.steps} call+step pairs after "
                f"{args.warmup}, peak RSS (VmHWM) over those; budget+fixed = host_memory + RSS before the model + "
                f"the arena's unused reservation; the CPU workers' own memory (stage weights, activations, gradient accumulators: device memory on a GPU box) is host RAM "
                f"here and comes on top")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
