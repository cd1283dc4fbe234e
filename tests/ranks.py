"""Test support: a script run as `world` ranks with torchrun's environment (gloo over loopback)."""
import json

import torch

from roundpipe.testing import run_ranks


def launch(script: str, cfg: dict, world: int, tmp_path, timeout: float = 240) -> list:
    """Runs `python script json(cfg)` on `world` ranks (roundpipe.testing.run_ranks); returns what each
    rank saved with torch.save at cfg["out"] + ".<rank>"."""
    cfg = dict(cfg, out=str(tmp_path / "rank"))
    _, errs = run_ranks([script, json.dumps(cfg)], world, timeout)
    results = []
    for r in range(world):
        path = tmp_path / f"rank.{r}"
        assert path.exists(), f"rank {r} wrote nothing:\n{errs[r][-3000:]}"
        results.append(torch.load(path))
    return results
