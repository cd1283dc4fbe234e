"""Each training loop a user drives, with a RoundPipe inside against the same loop over plain PyTorch (issue 52).

RoundPipe is an nn.Module and keeps PyTorch's contract that p.grad is final when backward() returns,
so it trains from the loops users already have.  This program times those loops side by side in one
process, over the same small model, the same batches and the same torch AdamW:

    loop                     roundpipe                                       plain (the baseline)
    torch loop               out = rp.RoundPipe(layers, devices=["cpu"])(x);  out = nn.Sequential(*layers)(x);
                             loss.backward(); opt.step(); opt.zero_grad()      the same four lines
    torch loop, 2 workers    the same, devices=["cpu"] * 2                    plain torch loop
    forward_backward + step  model.forward_backward(x, labels=y, loss_fn=..); plain torch loop
                             model.step(opt)   (roundpipe's own loop)
    Lightning Trainer.fit    a LightningModule holding the RoundPipe         the same LightningModule holding
                                                                             the nn.Sequential
    Accelerate               Accelerator(cpu=True), prepare, backward,       the same over the nn.Sequential
                             with the RoundPipe

No loop calls synchronize(): the optimizer reads p.grad right after backward() returns, as in plain
PyTorch (tests/engine/test_parent_module.py shows these loops train alike).  The model is an MLP of
--depth Linear(width, width) + GELU blocks and a Linear head (width 512, depth 8: 2.4M parameters,
9.5 MB fp32), MSE loss on random batches of --batch rows, fp32.

Timing: every provider (each loop, roundpipe and plain) runs once untimed, then once per repeat, in an order reversed
every other repeat; a run is --warmup steps (not timed) then --steps timed steps, its steps/s the
timed steps over their wall time.  Lightning's runs are timed between its on_train_batch_end hooks,
so Trainer construction and fit() setup are outside the timed window (its per-step bookkeeping and
data loading are inside, for both sides alike).  The table quotes the median over repeats of each
side and their ratio (roundpipe / plain, above 1: roundpipe faster); the rows keep every repeat.

    python bench/loops.py [--quick] [--steps N] [--repeats N] [--warmup N] [--threads N (default 1)]
                          [--width W] [--depth D] [--batch B] [--out bench/results] [--no-save]

On a machine shared with other jobs, say the load (/proc/loadavg is read before and after and
stored with the rows).  CPU workers only: a GPU's numbers are not measured by this program.
"""
from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import roundpipe as rp  # noqa: E402
from roundpipe.bench.runner import Report, add_common_args  # noqa: E402

LR = 1e-4

# (table row, roundpipe provider, plain provider)
LOOPS = [
    ("torch loop", "rp torch loop", "plain torch loop"),
    ("torch loop, 2 CPU workers", "rp torch loop x2", "plain torch loop"),
    ("forward_backward + step", "rp forward_backward", "plain torch loop"),
    ("Lightning Trainer.fit", "rp lightning", "plain lightning"),
    ("Accelerate", "rp accelerate", "plain accelerate"),
]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def make_layers(width: int, depth: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)] + [nn.Linear(width, width)]


def make_batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(n)]


# ---- providers: each is built once and then run(batches) -> steps/s of the timed steps

class TorchLoop:
    """out = model(x); loss.backward(); opt.step(); opt.zero_grad() over a Sequential or a RoundPipe."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, x, y) -> None:
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


class ForwardBackward:
    """roundpipe's own loop: loss = model.forward_backward(x, labels=y, loss_fn=...); model.step(opt)."""

    def __init__(self, model: rp.RoundPipe):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(self, x, y) -> None:
        self.model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        self.model.step(self.opt)


class AccelerateLoop:
    """Accelerate's loop: prepare(model, opt); accelerator.backward(loss); opt.step(); opt.zero_grad()."""

    def __init__(self, accelerator, model: nn.Module):
        self.acc = accelerator
        self.model, self.opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def step(self, x, y) -> None:
        self.acc.backward(F.mse_loss(self.model(x), y))
        self.opt.step()
        self.opt.zero_grad()


def time_steps(step: Callable, batches: list, warmup: int) -> float:
    """steps/s of the batches after the first `warmup` (those run untimed)."""
    for x, y in batches[:warmup]:
        step(x, y)
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        step(x, y)
    return (len(batches) - warmup) / (time.perf_counter() - t0)


class LightningFit:
    """Trainer.fit of a LightningModule holding `net`; timed between its on_train_batch_end hooks."""

    def __init__(self, net: nn.Module):
        import lightning as L

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = net

            def training_step(self, batch, _):
                x, y = batch
                return F.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=LR)

        self.module = Module()

    def run(self, batches: list, warmup: int) -> float:
        import lightning as L
        from torch.utils.data import DataLoader

        ends: list[float] = []

        class Clock(L.Callback):
            def on_train_batch_end(self, *_):
                ends.append(time.perf_counter())

        trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False, callbacks=[Clock()],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # Lightning's advice on DataLoader workers
            trainer.fit(self.module, DataLoader(batches, batch_size=None))
        # the interval from the end of the last warm-up step to the end of the last step
        return (len(ends) - warmup) / (ends[-1] - ends[warmup - 1])


def build_providers(width: int, depth: int) -> tuple[dict, list]:
    """name -> run(batches, warmup) -> steps/s; and the RoundPipes to close."""
    import accelerate

    base = make_layers(width, depth)
    fresh = lambda: copy.deepcopy(base)   # every provider starts from the same weights
    pipes = []

    def pipe(n: int) -> rp.RoundPipe:
        pipes.append(rp.RoundPipe(fresh(), devices=["cpu"] * n))
        return pipes[-1]

    acc = accelerate.Accelerator(cpu=True)
    loops = {
        "plain torch loop": TorchLoop(nn.Sequential(*fresh())),
        "rp torch loop": TorchLoop(pipe(1)),
        "rp torch loop x2": TorchLoop(pipe(2)),
        "rp forward_backward": ForwardBackward(pipe(1)),
        "plain accelerate": AccelerateLoop(acc, nn.Sequential(*fresh())),
        "rp accelerate": AccelerateLoop(acc, pipe(1)),
    }
    runs = {name: (lambda batches, warmup, s=loop.step: time_steps(s, batches, warmup)) for name, loop in loops.items()}
    runs["plain lightning"] = LightningFit(nn.Sequential(*fresh())).run
    runs["rp lightning"] = LightningFit(pipe(1)).run
    return runs, pipes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/loops.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; 6 with --quick)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them in every run (>= 1)")
    parser.add_argument("--repeats", type=int, default=None, help="alternating repeats, median reported "
                        "(default 5; 2 with --quick)")
    parser.add_argument("--width", type=int, default=512, help="features of every Linear")
    parser.add_argument("--depth", type=int, default=8, help="Linear+GELU blocks before the Linear head")
    parser.add_argument("--batch", type=int, default=128, help="rows per step")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads, 0: torch's default (1 by "
                        "default: on the loaded 2-core VM 2 threads spin-waiting on each other read steps of 1.2 s "
                        "among ones of 17 ms, against 28-79 ms with 1)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (6 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 5)
    for name, value in (("steps", steps), ("warmup", args.warmup), ("repeats", repeats), ("width", args.width),
                        ("depth", args.depth), ("batch", args.batch)):
        if value < 1:
            parser.error(f"--{name}={value} must be >= 1")
    if args.threads < 0:
        parser.error(f"--threads={args.threads} must be >= 0 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    import lightning  # noqa: F401   (it sets its loggers to INFO on import: quieted after it)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)   # "GPU available: False ..." on every fit

    load_before = loadavg()
    t_start = time.perf_counter()
    runs, pipes = build_providers(args.width, args.depth)
    batches = make_batches(args.warmup + steps, args.batch, args.width)
    order = list(runs)
    seen: dict[str, list[float]] = {name: [] for name in order}
    try:
        for name in order:   # one untimed run each first: the planner's first measurements, lazy allocations
            runs[name](batches, args.warmup)
        for r in range(repeats):
            for name in order if r % 2 == 0 else order[::-1]:
                seen[name].append(runs[name](batches, args.warmup))
                print(f"repeat {r + 1}/{repeats} {name}: {seen[name][-1]:.2f} steps/s  (load {loadavg()})",
                      file=sys.stderr, flush=True)
    finally:
        for p in pipes:
            p.close()
    load_after = loadavg()
    params = sum(p.numel() for layer in make_layers(args.width, args.depth) for p in layer.parameters())

    report = Report("loops", columns=["loop", "roundpipe steps/s", "plain steps/s", "roundpipe ms/step",
                                      "plain ms/step", "roundpipe/plain"], device="cpu")
    for loop, mine, theirs in LOOPS:
        a, b = statistics.median(seen[mine]), statistics.median(seen[theirs])
        report.add(loop=loop, **{
            "roundpipe steps/s": a, "plain steps/s": b, "roundpipe ms/step": 1e3 / a, "plain ms/step": 1e3 / b,
            "roundpipe/plain": a / b, "roundpipe samples/s": a * args.batch, "plain samples/s": b * args.batch,
            "roundpipe provider": mine, "plain provider": theirs,
            "roundpipe steps/s per repeat": seen[mine], "plain steps/s per repeat": seen[theirs]},
            machine="2-core CPU VM shared with other jobs, CPU workers; unmeasured on GPU",
            loadavg_before=load_before, loadavg_after=load_after, repeats=repeats, steps=steps,
            warmup=args.warmup, batch=args.batch, width=args.width, depth=args.depth, params=params,
            torch_threads=torch.get_num_threads())
    report.note(f"MLP {args.depth} x Linear({args.width}, {args.width})+GELU + Linear head, {params / 1e6:.2f}M "
                f"params fp32, batch {args.batch}, MSE, torch AdamW lr {LR}; one untimed run each, then the median of "
                f"{repeats} alternating repeats "
                f"of {steps} timed steps after {args.warmup} warm-up steps; torch threads {torch.get_num_threads()}; "
                f"RoundPipe on CPU workers (1 unless said), default options, no synchronize(); "
                f"load average {load_before} before, {load_after} after; "
                f"wall {time.perf_counter() - t_start:.0f} s; unmeasured on GPU")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
