"""Memory: host bytes per parameter by peak RSS, split into worker-held and host, and device bytes per worker.

For the `roundpipe train` default model and a ~200M-parameter decoder ("base"),
each provider runs a few training steps in a fresh subprocess (so peak RSS is its
own):

    torch             plain PyTorch: fp32 model, torch.optim.AdamW, one device
    roundpipe sync    2 CPU workers, bf16 compute, roundpipe.optim.AdamW, synchronous step
    roundpipe async   the same with the asynchronous step
    ... mmap 1 MiB    (base only) the same with glibc's mmap threshold fixed at 1 MiB
                      (MALLOC_MMAP_THRESHOLD_): freed buffers of 1 MiB and more go back
                      to the system at once instead of staying in the threads' malloc heaps

Columns, all per parameter:

    RSS          peak RSS over the process before the model was built (the model's
                 fp32 weights are added back: they are the masters)
    worker-held  the sum of the CPU workers' ledger peaks (weights, activations,
                 gradients): on CPU workers the "device" is host memory inside the
                 RSS; on GPUs it would not be (the sum of peaks is an upper bound of
                 what the workers held at any one moment)
    host         RSS minus worker-held: what the host side costs
    accounted    the engine's own count (`RoundPipe.memory_stats`) when the last
                 call's gradients have landed: fp32 masters, optimizer state, the
                 host arena's reserve (upload copies, gradient landings, staging, and
                 the unused rest of its chunks) and any gradient outside it
    malloc free  bytes glibc keeps free in its heaps at the end (mallinfo2 fordblks
                 growth): mostly CPU workers' released "device" buffers, reused by
                 the next stage run, counted by nobody
    code pages   file-backed RSS growth (library code paged in by the first call)

beside plain PyTorch and DeepSpeed ZeRO-Offload's documented 16-18 bytes per
parameter.  Device rows give each worker's peak ledger bytes against the floor the
pre-call check predicts (a stage's weights, the prefetched next stage's, its
gradients; roundpipe/engine/device_memory.py); activations come on top of it.

The device-side table (`memory_device`) gives each CPU worker's peak against the plan's
predicted peak and the cap, for Linear stacks of depth 12-96 and the tiny decoder at
128-512 tokens.

The slope table (`memory_slope`, `--providers ...`) gives host bytes per added parameter by
optimizer and master dtype (AdamW / AdamW8bit, fp32 / bf16 masters, fp32 compute whose
masters are their own upload copies) beside plain PyTorch: the least-squares slope of the host
peak over decoder depths 2, 4 and 6 (width 1024, 12.6M parameters a layer).  The runs set
MALLOC_PERTURB_ (roundpipe.bench.rss.SLOPE_ENV), so that the host arena's reserve is resident
as a page-locked one would be: without it the arena's last 64 MiB chunk, reserved but rarely
reached, was paged in at 4-8 layers and not at 2-3, a fixed 61 MiB step that the two-depth
slope of 2026-11-26 (2 -> 6) read as 1.4 bytes per added parameter (AdamW8bit: 11.47 measured
against 10.03 accounted; the same runs with MALLOC_PERTURB_: 10.33).

The peak table (`memory_peak`, `--peak`) gives the raw peak RSS per added parameter, nothing subtracted
(the process's VmHWM, what `free` and the OOM killer see), beside the accounted bytes' slope: AdamW8bit with
fp32 and bf16 masters on Linear(1024, 1024) stacks of 24 and 48 layers, 2 CPU workers capped at 24 MiB,
glibc's default settings.  Issue 41 measured 13.4 / 11.7 there against 10.0 / 6.0 accounted: the plain
arena's last 64 MiB chunk paged in at one depth and not the other, and the CPU workers' freed buffers
kept in their threads' glibc heaps (roundpipe/offload/arena.py PLAIN_CHUNK_BYTES, fix_mmap_threshold).

    python bench/memory.py [--quick] [--device-only] [--out DIR_OR_FILE] [--no-save]
    python bench/memory.py --providers torch adamw adamw8bit "adamw8bit bf16-master" --out bench/results
    python bench/memory.py --peak [--asynchronous] [--depths 24 48] --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from roundpipe.bench.rss import SLOPE_ENV, accounted_host_bytes
from roundpipe.bench.runner import Report, add_common_args

DEEPSPEED_DOCUMENTED = (16, 18)   # ZeRO-Offload paper / docs: fp32 master + Adam states + fp16 params/grads
MMAP_THRESHOLD = 1 << 20

_CHILD = r'''
import ctypes, json, os, sys
import torch, torch.nn.functional as F
from roundpipe.models.tiny_decoder import build_layers, loss_fn
from roundpipe.commands.train import TrainConfig
size, provider, steps, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from roundpipe.bench.rss import peak_rss, rss_file
def malloc_free():
    try:
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                      "fordblks keepcost".split()]
        f = ctypes.CDLL("libc.so.6").mallinfo2
        f.restype = MallInfo2
        return f().fordblks
    except (OSError, AttributeError):   # not glibc, or glibc < 2.33
        return None
cfg = TrainConfig(size=size, devices=["cpu"], seq_len=seq, batch_size=batch).resolved()
mcfg = cfg.model_config()
torch.manual_seed(0)
x = torch.randint(0, 256, (batch, seq)); y = torch.randint(0, 256, (batch, seq))
base, base_file, base_free = peak_rss(), rss_file(), malloc_free()
layers = build_layers(mcfg, seed=0)
params = sum(p.numel() for l in layers for p in l.parameters())
out = {"params": params}
if provider == "torch":
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
else:
    import roundpipe as rp
    with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-4)
        for i in range(steps):
            model.forward_backward(x, labels=y, loss_fn=loss_fn)
            if i == steps - 1:   # the last call's gradients landed, the optimizer state exists: the most the host holds
                host = model.memory_stats(opt)["host"]
            model.step(opt, asynchronous="async" in provider)
        model.synchronize()
        stats = model.memory_stats(opt)
        from roundpipe.engine.device_memory import layer_bytes
        weights, grads = layer_bytes(model.host)
        tasks = model.dispatcher.schedule(model.plan, True, model.num_microbatches or model.round_size,
                                          model.round_size).tasks
        # the rotation moves stages between workers from call to call: one floor for all of them
        floor = max((sum(weights[l] for l in t.layers) + (sum(weights[l] for l in ts[i + 1].layers)
                     if i + 1 < len(ts) else 0) + (sum(grads[l] for l in t.layers) if t.kind != "F" else 0)
                     for ts in tasks.values() for i, t in enumerate(ts)), default=0)
        out["workers"] = {n: {"peak": s["peak"], "peak_total": s["peak_total"], "floor": floor}
                          for n, s in stats["workers"].items()}
        out["host"] = host
out["rss"] = peak_rss() - base
out["code_pages"] = rss_file() - base_file
free = malloc_free()
out["malloc_free"] = free - base_free if free is not None and base_free is not None else None
print("RESULT " + json.dumps(out))
'''


def run_child(size: str, provider: str, steps: int, batch: int, seq: int) -> dict:
    env = dict(os.environ)
    if "mmap" in provider:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run([sys.executable, "-c", _CHILD, size, provider, str(steps), str(batch), str(seq)],
                          capture_output=True, text=True, timeout=3000, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{provider} on {size} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


# Host bytes per added parameter (the slope between two decoder depths, fixed costs left out), per optimizer and
# master dtype: provider -> (optimizer, master dtype, compute dtype); "torch" is plain PyTorch in the same run.
SLOPE_PROVIDERS = {
    "torch": ("torch AdamW", "float32", "float32"),
    "adamw": ("AdamW", "float32", "bfloat16"),
    "adamw fp32-compute": ("AdamW", "float32", "float32"),
    "adamw8bit": ("AdamW8bit", "float32", "bfloat16"),
    "adamw8bit bf16-master": ("AdamW8bit", "bfloat16", "bfloat16"),
    "adamw bf16-master": ("AdamW", "bfloat16", "bfloat16"),
}

_SLOPE_CHILD = r'''
import json, sys
import torch
import roundpipe as rp
from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn
optim, master, compute, depth = sys.argv[1], getattr(torch, sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])
from roundpipe.bench.rss import HostPeak, peak_rss as peak, rss, rss_file
torch.manual_seed(0)
x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
base, base_file, base_now = peak(), rss_file(), rss()
workers = []   # the CPU workers once wrapped: their live ledger bytes are not host memory
with HostPeak(lambda: sum(w.ledger.live_bytes() for w in workers)) as sampler:
    layers = build_layers(DecoderConfig(hidden=1024, layers=depth, heads=16), seed=0)
    n = sum(p.numel() for l in layers for p in l.parameters())
    out = {"params": n, "held": 0, "host": None}
    if optim == "torch AdamW":
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(3):
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    else:
        kw = {} if master == torch.float32 else {"master_dtype": master}
        with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=compute, **kw) as model:
            for w in model.workers:   # the ledger counts the layer compute's own tensors too (autograd's saved
                w.records_workspace = True   # tensors, parameter gradients as written): worker memory, not host
            workers.extend(model.workers)
            opt = getattr(rp.optim, optim)(model.parameters(), lr=1e-4)
            for i in range(3):
                model.forward_backward(x, labels=y, loss_fn=loss_fn)
                if i == 2:
                    out["host"] = model.memory_stats(opt)["host"]
                model.step(opt, asynchronous=False)
            model.synchronize()
            out["held"] = sum(s["peak_total"] for s in model.memory_stats()["workers"].values())
out["rss"], out["code"], out["host_peak"] = peak() - base, rss_file() - base_file, sampler.peak - base_now
print("RESULT " + json.dumps(out))
'''


def slope_run(provider: str, depth: int) -> dict:
    optim, master, compute = SLOPE_PROVIDERS[provider]
    env = {**os.environ, **SLOPE_ENV}   # released worker buffers returned at once, reserved memory resident
    proc = subprocess.run([sys.executable, "-c", _SLOPE_CHILD, optim, master, compute, str(depth)],
                          capture_output=True, text=True, timeout=3000, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{provider} at depth {depth} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """The slope of the least-squares line through (x, y) points (two or more distinct x)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def slope_rows(providers: list[str], depths: tuple[int, ...]) -> Report:
    """Host bytes per added parameter: the least-squares slope of host bytes against parameters over decoders of
    width 1024 at `depths`, synchronous steps on 2 CPU workers, host = the peak over time of RSS - the workers'
    live ledger bytes (HostPeak) - code pages, with the arena's reserve resident (SLOPE_ENV); beside it the older
    peak RSS - the sum of the workers' ledger peaks - code pages, and the engine's accounted bytes (memory_stats)
    the same way."""
    report = Report("memory_slope", columns=["provider", "optimizer", "master", "compute", "params",
                                             "host peak B/added param", "RSS B/added param",
                                             "accounted B/added param", "host vs torch"], device="cpu")
    runs = {p: [slope_run(p, d) for d in depths] for p in providers}
    host = lambda r: r["rss"] - r["held"] - r["code"]
    sampled = lambda r: r["host_peak"] - r["code"]
    slope = lambda rs, f: least_squares_slope([(r["params"], f(r)) for r in rs])
    ref = slope(runs["torch"], sampled) if "torch" in runs else None
    for p, rs in runs.items():
        optim, master, compute = SLOPE_PROVIDERS[p]
        peak = slope(rs, sampled)
        acc = slope(rs, lambda r: accounted_host_bytes(r["host"])) if rs[0]["host"] else None
        report.add(provider=p, optimizer=optim, master=master, compute=compute,
                   params="-".join(str(r["params"]) for r in rs),
                   **{"host peak B/added param": peak, "RSS B/added param": slope(rs, host),
                      "accounted B/added param": acc, "host vs torch": peak / ref if ref else None})
    report.note(f"decoders hidden 1024, depths {', '.join(map(str, depths))} (least-squares slope), 3 synchronous "
                "steps, batch 2 x 64, 2 CPU workers, MALLOC_MMAP_THRESHOLD_=1 MiB and MALLOC_PERTURB_ (reserved "
                "memory resident, as page-locked memory is); host peak: the largest RSS - the workers' live ledger "
                "bytes sampled together every 0.2 ms (roundpipe/bench/rss.py HostPeak) - code pages; RSS: peak RSS - "
                "the sum of the workers' ledger peaks - code pages, which subtracts bytes no two workers held at "
                "once and so overstates the slope; accounted: memory_stats()['host'] after the last call's gradients "
                "landed (masters counted once where they are their own upload copies); goals (issue 29): AdamW8bit "
                "<= 10.5 with fp32 masters, <= 6.5 with bf16 masters")
    return report


# Raw peak RSS per added parameter (issue 41): the process's own peak (VmHWM), nothing subtracted, as `free` and
# the OOM killer see it, against the engine's accounted bytes; provider -> master dtype.
PEAK_PROVIDERS = {"adamw8bit": "float32", "adamw8bit bf16-master": "bfloat16"}

_PEAK_CHILD = r'''
import json, sys
import torch, torch.nn.functional as F
from torch import nn
import roundpipe as rp
from roundpipe.bench.rss import accounted_host_bytes, rss
master, depth, asynchronous = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "async"
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
torch.manual_seed(0)
layers = [nn.Linear(1024, 1024) for _ in range(depth)]
n = sum(p.numel() for l in layers for p in l.parameters())
x, y = torch.randn(16, 1024), torch.randn(16, 1024)
with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16, master_dtype=master,
                  device_memory=24 << 20) as model:
    opt = rp.optim.AdamW8bit(model.parameters(), lr=1e-4)
    for i in range(4):
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        if i == 3:   # the last call's gradients landed, the optimizer state exists: the most the host holds
            host = model.memory_stats(opt)["host"]
        model.step(opt, asynchronous=asynchronous)
    model.synchronize()
    rest = rss()
print("RESULT " + json.dumps({"params": n, "peak": hwm(), "rest": rest, "accounted": accounted_host_bytes(host)}))
'''


def peak_run(provider: str, depth: int, asynchronous: bool) -> dict:
    # glibc's defaults, as a user's process has them: no MALLOC_ variable from the caller's environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, PEAK_PROVIDERS[provider], str(depth),
                           "async" if asynchronous else "sync"], capture_output=True, text=True, timeout=3000, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{provider} at depth {depth} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def peak_rows(depths: tuple[int, ...], asynchronous: bool) -> Report:
    """Raw peak RSS per added parameter (the least-squares slope of VmHWM over Linear(1024, 1024) stacks at
    `depths`, each run in a fresh process, nothing subtracted) beside the accounted bytes' slope, AdamW8bit
    with fp32 and bf16 masters, bf16 compute, 2 CPU workers capped at 24 MiB (issue 41)."""
    step = "async" if asynchronous else "sync"
    report = Report("memory_peak", columns=["provider", "master", "step", "layers", "params",
                                            "peak RSS B/added param", "accounted B/added param",
                                            "peak - accounted", "peak / accounted", "at rest B/added param"],
                    device="cpu")
    for p, master in PEAK_PROVIDERS.items():
        rs = [peak_run(p, d, asynchronous) for d in depths]
        slope = lambda k: least_squares_slope([(r["params"], r[k]) for r in rs])
        peak, acc = slope("peak"), slope("accounted")
        report.add(provider=p, master=master, step=step, layers="-".join(map(str, depths)),
                   params="-".join(str(r["params"]) for r in rs),
                   **{"peak RSS B/added param": peak, "accounted B/added param": acc, "peak - accounted": peak - acc,
                      "peak / accounted": peak / acc, "at rest B/added param": slope("rest")})
    report.note(f"Linear(1024, 1024) stacks of {', '.join(map(str, depths))} layers, each in a fresh process, 4 "
                f"{step} steps of rp AdamW8bit (batch 16), bf16 compute, 2 CPU workers with device_memory=24 MiB, "
                "glibc's defaults (no MALLOC_ variable); peak RSS: the process's VmHWM, nothing subtracted (the fp32 "
                "model built before wrapping, the workers' buffers, code pages, all in); accounted: "
                "accounted_host_bytes(memory_stats()['host']) once the last call's gradients landed; at rest: RSS "
                "after synchronize(); each the least-squares slope against the parameter count")
    return report


def device_rows(quick: bool) -> Report:
    """Device side: each CPU worker's ledger peak against the plan's predicted peak and the cap, for
    Linear(256) + Tanh stacks of depth 12-96 (512 rows, 3 MiB cap) and the tiny decoder at 8 x 128-512
    tokens (64 MiB cap), fp32 and bf16, 1 and 2 workers."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torch import nn

    import roundpipe as rp
    from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn

    report = Report("memory_device", columns=["model", "dtype", "workers", "microbatches", "worker", "cap",
                                              "predicted", "peak", "peak / predicted", "peak / cap"], device="cpu")
    cases = []
    for depth in ([12, 48] if quick else [12, 24, 48, 96]):
        gen = torch.Generator().manual_seed(0)
        cases.append((f"stack {depth} x Linear(256)", lambda d=depth: [nn.Sequential(nn.Linear(256, 256), nn.Tanh())
                                                                      for _ in range(d)],
                      torch.randn(512, 256, generator=gen), torch.randn(512, 256, generator=gen), F.mse_loss, 3 << 20))
    for seq in ([128] if quick else [128, 256, 512]):
        gen = torch.Generator().manual_seed(0)
        cases.append((f"tiny decoder 8 x {seq}", lambda: build_layers(DecoderConfig(hidden=128, layers=6, heads=4), seed=0),
                      torch.randint(0, 256, (8, seq), generator=gen), torch.randint(0, 256, (8, seq), generator=gen),
                      loss_fn, 64 << 20))
    for name, make, x, y, loss, cap in cases:
        for dtype in (torch.float32, torch.bfloat16):
            for workers, mbs in ((1, 2), (2, 4)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        with rp.RoundPipe(make(), devices=["cpu"] * workers, num_microbatches=mbs, device_memory=cap,
                                          compute_dtype=dtype) as model:
                            opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
                            for _ in range(2):
                                model.forward_backward(x, labels=y, loss_fn=loss)
                                model.step(opt, asynchronous=True)
                            stats = model.memory_stats()["workers"]
                    except ValueError as e:   # one layer's working set exceeds the cap: refused before any work
                        report.add(model=name, dtype=str(dtype).split(".")[-1], workers=workers, microbatches=mbs,
                                   worker=f"refused: {str(e)[:60]}", cap=cap)
                        continue
                for w, st in stats.items():
                    report.add(model=name, dtype=str(dtype).split(".")[-1], workers=workers, microbatches=mbs, worker=w,
                               cap=cap, predicted=st["predicted_peak"], peak=st["peak_total"],
                               **{"peak / predicted": st["peak_total"] / st["predicted_peak"],
                                  "peak / cap": st["peak_total"] / cap})
    report.note("CPU workers with the ledger's workspace tracking (on under a cap): peak = memory_stats()'s "
                "peak_total, predicted = its predicted_peak (roundpipe/planner/memory.py); unmeasured on GPU")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/memory.py", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device-only", action="store_true", help="only the device rows (peak vs prediction vs cap)")
    parser.add_argument("--providers", nargs="+", choices=sorted(SLOPE_PROVIDERS), default=None,
                        help="only the per-added-parameter rows (memory_slope) of these optimizer / master-dtype "
                             "providers, e.g. torch adamw adamw8bit 'adamw8bit bf16-master'")
    parser.add_argument("--depths", nargs="+", type=int, default=None,
                        help="decoder depths of the slope rows (default 2 4 6), Linear stack depths of the peak "
                             "rows (default 24 48); two or more distinct")
    parser.add_argument("--peak", action="store_true",
                        help="only the raw peak RSS rows (memory_peak): AdamW8bit on Linear(1024) stacks, fp32 and "
                             "bf16 masters, VmHWM per added parameter against the accounted bytes")
    parser.add_argument("--asynchronous", action="store_true", help="the peak rows with asynchronous steps")
    args = parser.parse_args(argv)
    if args.depths is not None and (len(set(args.depths)) < 2 or min(args.depths) < 1):
        parser.error(f"--depths {args.depths}: expected two or more distinct depths >= 1")
    if args.peak:
        peak_rows(tuple(args.depths or (24, 48)), args.asynchronous).finish(args.out, save=not args.no_save)
        return 0
    if args.providers:
        slope_rows(args.providers, tuple(args.depths or (2, 4, 6))).finish(args.out, save=not args.no_save)
        return 0
    device_rows(args.quick).finish(args.out, save=not args.no_save)
    if args.device_only:
        return 0
    sizes = [("tiny", 3, 16, 128)] + ([] if args.quick else [("base", 2, 2, 64)])
    ds_lo, ds_hi = DEEPSPEED_DOCUMENTED
    report = Report("memory", columns=["model", "provider", "params", "RSS B/param", "worker-held B/param",
                                       "host B/param", "accounted B/param", "malloc free B/param",
                                       "code pages B/param", "host vs torch", f"host vs DS {ds_hi}",
                                       "worker", "device peak", "floor", "peak / floor"], device="cpu")
    for size, steps, batch, seq in sizes:
        providers = ["torch", "roundpipe sync", "roundpipe async"]
        if size != "tiny":
            providers += ["roundpipe sync, mmap 1 MiB", "roundpipe async, mmap 1 MiB"]
        results = {p: run_child(size, p, steps, batch, seq) for p in providers}
        ref = results["torch"]["rss"] / results["torch"]["params"]
        for provider, r in results.items():
            n = r["params"]
            rss = r["rss"] / n
            held = sum(w["peak_total"] for w in r.get("workers", {}).values()) / n
            host = rss - held
            report.add(model=size, provider=provider, params=n, **{
                "RSS B/param": rss, "worker-held B/param": held if "workers" in r else None,
                "host B/param": host, "accounted B/param": accounted_host_bytes(r["host"]) / n if "host" in r else None,
                "malloc free B/param": r["malloc_free"] / n if r["malloc_free"] is not None else None,
                "code pages B/param": r["code_pages"] / n, "host vs torch": host / ref,
                f"host vs DS {ds_hi}": host / ds_hi})
            for name, w in r.get("workers", {}).items():
                report.add(model=size, provider=provider, worker=name, **{
                    "device peak": w["peak_total"], "floor": w["floor"],
                    "peak / floor": w["peak_total"] / w["floor"] if w["floor"] else None})
    report.note(f"DeepSpeed ZeRO-Offload documents {ds_lo}-{ds_hi} host bytes per parameter.  RSS: peak RSS over "
                "the process before the model, per parameter (the fp32 model itself included); worker-held: the sum "
                "of the CPU workers' ledger peaks, host memory here, device memory on GPUs; host = RSS - worker-held; "
                "accounted: memory_stats()['host'] once the last call's gradients landed (masters, optimizer state, "
                "arena reserve); 'mmap 1 MiB': glibc's MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB; floor: the pre-call "
                "check's stage + prefetched weights + gradients")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
