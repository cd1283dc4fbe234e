"""Memory: device bytes per worker against the plan's floor, and host bytes per parameter.

For the `roundpipe train` default model and a ~200M-parameter decoder ("base"),
each provider runs a few training steps in a fresh subprocess (so peak RSS is its
own):

    torch             plain PyTorch: fp32 model, torch.optim.AdamW, one device
    roundpipe sync    2 CPU workers, bf16 compute, roundpipe.optim.AdamW, synchronous step
    roundpipe async   the same with the asynchronous step

and reports host bytes per parameter from peak RSS over the process before the
model was built (the model's own fp32 weights are added back: they are the
masters), beside DeepSpeed ZeRO-Offload's documented 16-18 bytes per parameter
and the engine's own accounting (`RoundPipe.memory_stats`).  Device rows give each
worker's peak ledger bytes (weights, activations, gradients) against the floor the
pre-call check uses (a stage's weights, the prefetched next stage's, its
gradients; roundpipe/engine/device_memory.py): on CPU workers the "device" is host memory,
so those bytes are inside the RSS too.

    python bench/memory.py [--quick] [--out DIR_OR_FILE] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from roundpipe.bench.runner import Report, add_common_args

DEEPSPEED_DOCUMENTED = "16-18"   # ZeRO-Offload paper / docs: fp32 master + Adam states + fp16 params/grads

_CHILD = r'''
import json, os, resource, sys
import torch, torch.nn.functional as F
from roundpipe.models.tiny_decoder import build_layers, loss_fn
from roundpipe.commands.train import TrainConfig
size, provider, steps, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg = TrainConfig(size=size, devices=["cpu"], seq_len=seq, batch_size=batch).resolved()
mcfg = cfg.model_config()
torch.manual_seed(0)
x = torch.randint(0, 256, (batch, seq)); y = torch.randint(0, 256, (batch, seq))
base = rss()
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
        for _ in range(steps):
            model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.step(opt, asynchronous=provider.endswith("async"))
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
        out["accounted"] = {k: v / params for k, v in stats["host"].items()}
out["host_bytes_per_param"] = (rss() - base) / params
print("RESULT " + json.dumps(out))
'''


def run_child(size: str, provider: str, steps: int, batch: int, seq: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, size, provider, str(steps), str(batch), str(seq)],
                          capture_output=True, text=True, timeout=3000)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{provider} on {size} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/memory.py", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    args = parser.parse_args(argv)
    sizes = [("tiny", 3, 16, 128)] + ([] if args.quick else [("base", 2, 2, 64)])
    report = Report("memory", columns=["model", "provider", "params", "host B/param", "vs torch",
                                       "engine-accounted B/param", "worker", "device peak", "floor",
                                       "peak / floor"], device="cpu")
    for size, steps, batch, seq in sizes:
        results = {p: run_child(size, p, steps, batch, seq) for p in ("torch", "roundpipe sync", "roundpipe async")}
        ref = results["torch"]["host_bytes_per_param"]
        for provider, r in results.items():
            per_param = r["host_bytes_per_param"]
            accounted = sum(v for k, v in r.get("accounted", {}).items() if not k.startswith("arena"))
            report.add(model=size, provider=provider, params=r["params"], **{
                "host B/param": per_param, "vs torch": per_param / ref,
                "engine-accounted B/param": accounted if "accounted" in r else None})
            for name, w in r.get("workers", {}).items():
                report.add(model=size, provider=provider, worker=name, **{
                    "device peak": w["peak_total"], "floor": w["floor"],
                    "peak / floor": w["peak_total"] / w["floor"] if w["floor"] else None})
    report.note(f"DeepSpeed ZeRO-Offload documents {DEEPSPEED_DOCUMENTED} host bytes per parameter; host B/param "
                "is peak RSS over the process before the model, per parameter (the fp32 model itself included); "
                "on CPU workers the device peak is host memory inside that RSS")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
