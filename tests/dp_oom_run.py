"""One rank of the data-parallel out-of-memory test (gloo on loopback; started by tests/ranks.py).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dp_oom_run.py CONFIG_JSON

Rank 1's second training call fails with cuBLAS's out-of-memory RuntimeError raised in a layer; like an
automatic batch-size search (accelerate's find_executable_batch_size) the rank catches it and retries the call
with half its batch.  Each rank saves what it saw at config["out"] + f".{rank}".
"""
from __future__ import annotations

import datetime
import json
import sys

import dp_run
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp

CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
ARMED = {"on": False}   # the next forward of OomOnce raises, once (workers run copies of the layer)


class OomOnce(nn.Module):
    def forward(self, x):
        if ARMED["on"]:
            ARMED["on"] = False
            raise RuntimeError(CUBLAS)
        return x


def run(rank: int, group, out: dict) -> None:
    """Three training calls and steps; out["seen"] gets the out-of-memory error the rank caught."""
    layers = dp_run.layers()
    layers.insert(1, OomOnce())
    model = rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=2, process_group=group)
    opt = rp.optim.AdamW(list(model.parameters()), lr=1e-2)
    with model:
        for step in range(3):
            x, y = dp_run.batch(step, 8)
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            ARMED["on"] = step == 1 and rank == 1
            try:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            except RuntimeError as e:
                if "ALLOC_FAILED" not in str(e):
                    raise
                out["seen"].append({"error": str(e), "notes": getattr(e, "__notes__", [])})
                model.forward_backward(x[:2], labels=y[:2], loss_fn=F.mse_loss)   # the retry
            model.step(opt)


def main() -> None:
    import torch.distributed as dist
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("timeout", 20)))
    rank = dist.get_rank()
    result: dict = {"seen": []}
    try:
        run(rank, dist.group.WORLD, result)
        torch.save(result, cfg["out"] + f".{rank}")
    except Exception as e:   # the test reads what each rank saw
        torch.save(dict(result, error=f"{type(e).__name__}: {e}", notes=getattr(e, "__notes__", []),
                        cause=repr(e.__cause__)), cfg["out"] + f".{rank}")
        raise   # the rank ends: its connections close, the other rank's collective fails at once


if __name__ == "__main__":
    main()
