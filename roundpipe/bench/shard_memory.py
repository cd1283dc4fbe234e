"""One rank of the optimizer-sharding memory measurement (bench/ddp.py --memory, tests/engine/test_shard_memory.py).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m roundpipe.bench.shard_memory CONFIG_JSON

Each rank trains the tiny decoder (config: hidden, layers, steps, asynchronous, shard, and seq: tokens
in each of the batch's 2 sequences, default 32) with bf16 compute and roundpipe.optim.AdamW over 2 CPU
workers (capped at WORKER_CAP: a GPU's memory modelled) on gloo, and saves with torch.save at
config["out"] + f".{rank}": the parameter count, the optimizer state's bytes, the host bytes
memory_stats accounts when the last call's gradients have landed (masters, optimizer state, the
host arena's reserve; roundpipe.bench.rss.accounted_host_bytes), the arena's peak reserve, and
the host peak (RSS - the workers' live ledger bytes, sampled together: roundpipe.bench.rss.HostPeak)
over the process before the model was built.
"""
from __future__ import annotations

import json
import sys

WORKER_CAP = 4 << 30   # each CPU worker's device_memory: room for any stage of the measured sizes


def run(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import roundpipe as rp
    from roundpipe.bench.rss import HostPeak, accounted_host_bytes, rss, rss_file
    from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    seq = cfg.get("seq", 32)
    x, y = torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))
    base, base_file = rss(), rss_file()
    workers: list = []
    with HostPeak(lambda: sum(w.ledger.live_bytes() for w in workers)) as sampler:
        layers = build_layers(DecoderConfig(hidden=cfg["hidden"], layers=cfg["layers"], heads=cfg.get("heads", 12)),
                              seed=0)
        # capped workers model a GPU's memory: the layer compute's own tensors are worker ("device") memory too
        # (their ledgers count them), and freed worker buffers go back to the system at once instead of staying
        # in the threads' heaps, where the host peak would count them (roundpipe/offload/arena.py)
        with rp.RoundPipe(layers, devices=["cpu"] * 2, compute_dtype=torch.bfloat16, process_group=dist.group.WORLD,
                          shard_optimizer=cfg["shard"], device_memory=WORKER_CAP) as model:
            workers.extend(model.workers)
            opt = rp.optim.AdamW(model.parameters(), lr=1e-4)
            for i in range(cfg["steps"]):
                model.forward_backward(x, labels=y, loss_fn=loss_fn)
                if i == cfg["steps"] - 1:   # the last call's gradients landed, the optimizer state exists
                    host = model.memory_stats(opt)["host"]
                model.step(opt, asynchronous=cfg["asynchronous"])
            model.synchronize()
            arena_peak = model.host.arena.stats().peak_reserved_bytes if model.host.arena is not None else None
            params = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"rank": rank, "params": params, "optimizer_state": host["optimizer_state"], "host": host,
            "accounted": accounted_host_bytes(host), "arena_peak_reserved": arena_peak,
            "host_peak": sampler.peak - base - (rss_file() - base_file)}


def main(argv: list[str]) -> int:
    import torch
    if len(argv) != 1:
        raise ValueError(f"expected one argument, a JSON config, got {argv!r}")
    cfg = json.loads(argv[0])
    out = run(cfg)
    torch.save(out, f"{cfg['out']}.{out['rank']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
