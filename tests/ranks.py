"""Test support: a script run as `world` ranks with torchrun's environment (gloo over loopback)."""
import json
import os
import socket
import subprocess
import sys

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, cfg: dict, world: int, tmp_path, timeout: float = 240) -> list:
    """Runs `python script json(cfg)` on `world` ranks, each with RANK, LOCAL_RANK, WORLD_SIZE and the
    rendezvous address; returns what each rank saved with torch.save at cfg["out"] + ".<rank>"."""
    cfg = dict(cfg, out=str(tmp_path / "rank"))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, json.dumps(cfg)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(world)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    finally:
        for p in procs:
            p.kill()
    results = []
    for r in range(world):
        path = tmp_path / f"rank.{r}"
        assert path.exists(), f"rank {r} wrote nothing:\n{errs[r][-3000:]}"
        results.append(torch.load(path))
    return results
