"""A training run for the checkpoint tests, importable by them and runnable as a separate process.

    python tests/checkpoint_run.py CONFIG_JSON   # loads config["load"], trains on, writes config["out"]
    python tests/checkpoint_run.py --serve       # the same for each CONFIG_JSON line on stdin, answering
                                                 # one line each: "ok" or the traceback as a JSON string

The data of step i depend on i only, so a run resumed at step k sees what the uninterrupted
one saw; dropout draws from the caller's generator (saved in the checkpoint), so the
masks do too.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp

WIDTH = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layers() -> list[nn.Module]:
    torch.manual_seed(7)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.2)) for _ in range(4)] + \
        [nn.Linear(WIDTH, 4)]


def batch(i: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i * 10 + accum)
    return torch.randn(12, WIDTH, generator=g), torch.randint(0, 4, (12,), generator=g)


def build(cfg: dict):
    dtype = DTYPES[cfg.get("dtype", "float32")]
    scaling = rp.LossScale(init_scale=2.0 ** 10, growth_interval=2) if dtype == torch.float16 else None
    model = rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3,
                         precision=rp.Precision(dtype, loss_scale=scaling),
                         compensation=rp.StalenessCompensation(predict=0.5) if cfg.get("compensation") else None,
                         master_dtype=DTYPES[cfg.get("master", "float32")])
    params = list(model.parameters())
    if cfg.get("optimizer", "rp") == "rp":
        opt = rp.optim.AdamW(params, lr=3e-3, weight_decay=0.05)
    elif cfg["optimizer"] == "adamw8bit":   # 8-bit states on the 16x16 and 16x4 weights, fp32 ones on the biases
        opt = rp.optim.AdamW8bit(params, lr=3e-3, weight_decay=0.05, min_8bit_size=64)
    else:
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def train(cfg: dict, model, opt, sched, start: int, stop: int) -> list[float]:
    """Steps start..stop-1, each `accum` calls; saves after step cfg["save_at"] if given."""
    losses = []
    for i in range(start, stop):
        for a in range(cfg.get("accum", 1)):
            x, y = batch(i, a)
            losses.append(float(model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)))
        model.step(opt, asynchronous=cfg["asynchronous"], lr_scheduler=sched, max_grad_norm=cfg.get("clip", 0.5))
        if cfg.get("save_at") == i + 1:
            model.save_checkpoint(cfg["path"], opt, sched)
    return losses


def masters(model) -> dict[str, torch.Tensor]:
    model.synchronize()
    return {k: v.clone() for k, v in model.state_dict().items()}


def main(cfg: dict) -> None:
    torch.manual_seed(123)   # overwritten by the checkpoint's RNG state: it must not matter
    model, opt, sched = build(cfg)
    with model:
        model.load_checkpoint(cfg["load"], opt, sched)
        losses = train(cfg, model, opt, sched, cfg["save_at"], cfg["steps"])
        torch.save({"masters": masters(model), "losses": losses, "lr": sched.get_last_lr(),
                    "scale": model.loss_scale}, cfg["out"])


def serve() -> None:
    """One process for many resumes (tests/engine/test_checkpoint.py): it starts Python and imports torch once,
    and still never holds the state of the run that saved the checkpoint it loads."""
    import contextlib
    import traceback

    answers = sys.stdout
    for line in sys.stdin:
        try:
            with contextlib.redirect_stdout(sys.stderr):   # stdout carries the answers only
                main(json.loads(line))
            answer = "ok"
        except Exception:   # noqa: BLE001 - any failure goes back to the test that sent the config
            answer = json.dumps(traceback.format_exc())
        print(answer, file=answers, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        main(json.loads(sys.argv[1]))
