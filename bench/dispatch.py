"""Engine overhead per stage-microbatch, and CPU-worker training throughput against PyTorch.

Three measurements, all on CPU workers so they run anywhere:

1. Overhead.  A model of near-zero-cost layers (y = x * w on a [M, 4] batch, one
   scalar weight each) makes a RoundPipe `forward_backward` (+ `synchronize`) all
   engine: dispatch, microbatch split, host copies of stage inputs, recompute
   bookkeeping, gradient accumulation, thread hand-offs.  The plain-PyTorch time of
   the same work (every microbatch through the layers, forward + backward, gradients
   accumulated) is subtracted and the rest divided by the number of stage-microbatch
   executions, (forward stages + backward stages) * microbatches.  Target: < 100 us.

       overhead = (t_roundpipe - t_torch) / ((S_fwd + S_bwd) * M)

2. Throughput.  The `roundpipe train` default model (tiny decoder, 16 x 128 bytes per
   step, AdamW) trained for a few steps by the plain PyTorch loop and by RoundPipe on
   1 and 2 CPU workers, sync and async step, and by the plain loop with one extra forward
   per step (what full recomputation costs anyway); tokens/s and the ratio to PyTorch from the
   median and from the best of the step times of interleaved rounds.  The async rows are
   repeated with `max_grad_norm=1.0`: global-norm clipping needs every gradient before the
   first layer's update, and the "+clip" rows show what that costs the overlap.

3. Start-up.  Each in a fresh interpreter (median of several): `import roundpipe` (lazy: no
   torch yet) and `import roundpipe` + `roundpipe.RoundPipe` (torch and the engine) against
   `import torch`, and the first `forward_backward` + `synchronize` of the default model on
   one CPU worker against the first plain forward+backward of its layers: medians, their
   difference, and the difference of the fastest runs (target: < 500 ms over torch).  The
   first call plans from a dry run of the layers on the first microbatch; the
   "torch._dynamo" column says whether anything imported it (1-3 s on 2 cores).

    python bench/dispatch.py [--quick] [--no-save]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from roundpipe.bench.runner import Report, add_common_args, median_time
from roundpipe.commands.data import ByteCorpus
from roundpipe.commands.train import TrainConfig
from roundpipe.commands.train_loops import RoundPipeEngine, TorchReference, lr_at, make_optimizer
from roundpipe.engine.model import RoundPipe
from roundpipe.models.tiny_decoder import build_layers, loss_fn
from roundpipe.planner.plan import Plan


class Scale(nn.Module):
    """y = x * w: one multiply, so the layer costs next to nothing and still has a gradient."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def mse(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (out - labels).pow(2).mean()


def torch_microbatches(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """The same work in plain PyTorch: each microbatch forward and backward, gradients accumulated."""
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm
        for layer in layers:
            h = layer(h)
        (mse(h, ym) * (len(xm) / len(x))).backward()


def overhead(report: Report, workers: int, num_layers: int, m: int, repeat: int, rounds: int) -> None:
    layers = [Scale() for _ in range(num_layers)]
    plain = copy.deepcopy(layers)
    x, y = torch.randn(m, 4), torch.randn(m, 4)
    # An explicit plan (one layer per backward stage, three per forward stage): the
    # default one is re-planned from measured times, which would change the count.
    plan = Plan.uniform(num_layers)
    stages = len(plan.forward) + len(plan.backward)
    with RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=m, plan=plan) as model:
        assert model.plan == plan

        def run():
            model.forward_backward(x, labels=y, loss_fn=mse)
            model.synchronize()

        # Interleaved rounds, median of each: a burst of load from another process then
        # shows up in one round of both timings instead of in one of them.
        t_torch, t_rp = [], []
        for _ in range(rounds):
            t_torch.append(median_time(lambda: torch_microbatches(plain, x, y, m), repeat=repeat))
            t_rp.append(median_time(run, warmup=3, repeat=repeat))
    t_torch, t_rp = statistics.median(t_torch), statistics.median(t_rp)
    executions = stages * m
    report.add(case=f"{num_layers} trivial layers, {workers} cpu workers, M={m}", provider="roundpipe",
               stages=stages, **{"stage-mb": executions, "ms": t_rp * 1e3, "torch ms": t_torch * 1e3,
                                 "us/stage-mb": (t_rp - t_torch) / executions * 1e6})


class TorchRecompute(TorchReference):
    """The plain loop plus one extra no-grad forward per step: the work RoundPipe's full
    recomputation adds, so the ratio to this provider is the engine's own cost."""

    def forward_backward(self, x, *, labels, loss_fn):
        with torch.no_grad():
            self(x)
        return super().forward_backward(x, labels=labels, loss_fn=loss_fn)


def _step_periods(engine, corpus: ByteCorpus, cfg: TrainConfig, steps: int, asynchronous: bool,
                  max_grad_norm: float | None) -> list[float]:
    """Wall time between consecutive step ends, `steps` of them after two warmup steps.

    Periods rather than one total: the caller takes a median, so a step descheduled by
    another process on a shared machine does not move the result.  With the
    asynchronous step a period still contains the optimizer, which overlaps the next step.
    """
    optimizer = make_optimizer(engine.named_parameters(), cfg.lr, cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
    batches = corpus.batches(cfg.batch_size, cfg.seq_len, seed=0)
    ends = []
    for _step in range(steps + 2):
        x, y = next(batches)
        engine.forward_backward(x, labels=y, loss_fn=loss_fn)
        engine.step(optimizer, lr_scheduler=schedule, asynchronous=asynchronous, max_grad_norm=max_grad_norm)
        ends.append(time.perf_counter())
    engine.synchronize()
    return [b - a for a, b in zip(ends[1:], ends[2:])]


def throughput(report: Report, steps: int, rounds: int) -> None:
    """Providers interleaved over `rounds` rounds, rate from the median of all their step periods:
    load from other processes on a shared machine then hits every provider alike."""
    cfg = TrainConfig(devices=["cpu"], steps=steps).resolved()
    corpus = ByteCorpus.load()
    # name -> (engine factory, asynchronous step, max_grad_norm)
    providers = {"torch (1 device)": (lambda: TorchReference(build_layers(cfg.model_config(), seed=0), "cpu",
                                                               torch.float32), False, None),
                 "torch + recompute": (lambda: TorchRecompute(build_layers(cfg.model_config(), seed=0), "cpu",
                                                              torch.float32), False, None)}
    for workers in (1, 2):
        for asynchronous, clip in ((False, None), (True, None), (True, 1.0)):
            name = (f"roundpipe {workers} cpu worker{'s' * (workers > 1)} {'async' if asynchronous else 'sync'}"
                    f"{' +clip' if clip else ''}")
            providers[name] = (lambda w=workers: RoundPipeEngine(build_layers(cfg.model_config(), seed=0),
                                                                 ["cpu"] * w, None, None), asynchronous, clip)
    periods: dict[str, list[float]] = {name: [] for name in providers}
    for _ in range(rounds):
        for name, (make, asynchronous, clip) in providers.items():
            with make() as engine:
                periods[name] += _step_periods(engine, corpus, cfg, steps, asynchronous, clip)
    # Median and best step: on a 2-core machine shared with other jobs, a 2-thread OpenMP
    # step whose partner thread is descheduled was seen to take 40x its time (3.5 s
    # instead of 92 ms), so the best step is quoted too as the unloaded speed.
    tokens = cfg.batch_size * cfg.seq_len
    ref = periods["torch (1 device)"]
    case = f"tiny decoder {cfg.model_config().num_parameters() / 1e6:.2f}M, {cfg.batch_size}x{cfg.seq_len}"
    for name, values in periods.items():
        rate, best = tokens / statistics.median(values), tokens / min(values)
        report.add(case=case, provider=name, **{
            "tokens/s": rate, "vs torch": statistics.median(ref) / statistics.median(values),
            "best tokens/s": best, "best vs torch": min(ref) / min(values)})


# One fresh interpreter, timed from its first statement: `import torch` (provider torch) or
# `import roundpipe` and then `roundpipe.RoundPipe` (which loads torch and the engine), then the
# first forward+backward of the default model, plain or through RoundPipe; one JSON line.
_STARTUP_CHILD = """
import json, sys, time
provider = sys.argv[1]
t0 = time.perf_counter()
if provider == "torch":
    import torch
    t = {"import": time.perf_counter() - t0}
else:
    import roundpipe
    t = {"package": time.perf_counter() - t0}
    roundpipe.RoundPipe
    t["import"] = time.perf_counter() - t0
import torch
import roundpipe
from roundpipe.models.tiny_decoder import build_layers, loss_fn
from roundpipe.commands.train import TrainConfig
cfg = TrainConfig(devices=["cpu"]).resolved()
layers = build_layers(cfg.model_config(), seed=0)
x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
y = torch.roll(x, -1, 1)
if provider == "torch":
    t0 = time.perf_counter()
    h = x
    for layer in layers:
        h = layer(h)
    loss_fn(h, y).backward()
    t["first"] = time.perf_counter() - t0
else:
    with roundpipe.RoundPipe(layers, devices=cfg.devices) as model:
        t0 = time.perf_counter()
        model.forward_backward(x, labels=y, loss_fn=loss_fn)
        model.synchronize()
        t["first"] = time.perf_counter() - t0
print(json.dumps({**t, "dynamo": "torch._dynamo" in sys.modules}))
"""


def startup(report: Report, runs: int) -> None:
    """Import and first-call times, each in a fresh interpreter, providers interleaved (a burst of
    load from another process then hits both), medians of `runs`."""
    import roundpipe

    path = [str(Path(roundpipe.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    samples: dict[str, list[dict]] = {"torch": [], "roundpipe": []}
    for _ in range(runs):
        for provider, rows in samples.items():
            child = subprocess.run([sys.executable, "-c", _STARTUP_CHILD, provider], env=env, capture_output=True,
                                   text=True, timeout=600)
            if child.returncode != 0:
                raise RuntimeError(f"start-up child ({provider}) failed:\n{child.stderr}")
            rows.append(json.loads(child.stdout.splitlines()[-1]))
    med = lambda provider, key: statistics.median(r[key] for r in samples[provider]) * 1e3
    best = lambda provider, key: min(r[key] for r in samples[provider]) * 1e3
    cfg = TrainConfig(devices=["cpu"]).resolved()
    dynamo = "imported" if any(r["dynamo"] for r in samples["roundpipe"]) else "no"
    for case, key, extra in (
            ("import roundpipe (fresh process)", "package", {}),
            ("import roundpipe, roundpipe.RoundPipe (fresh process)", "import", {}),
            (f"first forward_backward, tiny decoder {cfg.batch_size}x{cfg.seq_len}, 1 cpu worker", "first",
             {"torch._dynamo": dynamo})):
        torch_key = "import" if key == "package" else key
        ms, torch_ms = med("roundpipe", key), med("torch", torch_key)
        report.add(case=case, provider="roundpipe", ms=ms, **{
            "torch ms": torch_ms, "over torch ms": ms - torch_ms,
            "best over torch ms": best("roundpipe", key) - best("torch", torch_key)}, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/dispatch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every provider (default: torch's own choice)")
    parser.add_argument("--throughput-only", action="store_true",
                        help="only the training-throughput rows (RoundPipe against plain PyTorch, interleaved)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    repeat = 5 if args.quick else 15

    report = Report("dispatch", columns=["case", "provider", "stages", "stage-mb", "ms", "torch ms", "us/stage-mb",
                                         "over torch ms", "best over torch ms", "torch._dynamo", "tokens/s",
                                         "vs torch", "best tokens/s", "best vs torch"], device="cpu")
    if not args.throughput_only:
        startup(report, runs=3 if args.quick else 7)
        for workers, num_layers, m in [(1, 16, 2), (2, 16, 3), (4, 16, 5), (2, 32, 8)][: 2 if args.quick else None]:
            overhead(report, workers, num_layers, m, repeat, rounds=1 if args.quick else 3)
    throughput(report, steps=6 if args.quick else 10, rounds=2 if args.quick else 5)
    report.note(f"{torch.get_num_threads()} torch threads; overhead target < 100 us per stage-microbatch; "
                "start-up rows: fresh interpreters, torch's default threads, target < 500 ms over torch")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
