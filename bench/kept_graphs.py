"""Kept graphs against recompute, on CPU workers under a device cap, beside plain PyTorch.

A backward stage on its forward stage's worker keeps that forward's graph instead of recomputing it where
the planner predicts the round's graphs fit the cap (docs/planner.md, "Kept graphs").  This runs the same
model, plan, cap and batches three ways, interleaved round by round so that load from other processes hits
each alike:

    plain         plain PyTorch: the whole batch, forward and backward, no recompute (the physical limit
                  of this work on this CPU: nothing is recomputed and nothing is copied)
    recompute     RoundPipe with every backward stage recomputing (the kept-graph choice switched off in
                  this process: `Schedule.keepable` returns none), as before kept graphs
    kept graphs   RoundPipe as it is: the stages the planner keeps

Columns: median ms per training call (forward_backward + synchronize, no optimizer step), tokens/s, the
ratio to plain PyTorch ("% of limit") and kept graphs against recompute; the kept stages; the worker's
peak device bytes against the plan's prediction and the cap; the recompute spans the last call's trace
shows.  Gradients of the two RoundPipe providers are compared bitwise after the first call.

    python bench/kept_graphs.py [--quick] [--workers N] [--out DIR_OR_FILE] [--no-save]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

import roundpipe as rp
from roundpipe.bench.runner import Report, add_common_args
from roundpipe.engine.calls.dispatcher import Schedule
from roundpipe.models.tiny_decoder import DecoderConfig, build_layers, loss_fn

CAP = 1 << 30   # room for every keepable stage's graphs at these sizes; it also makes CPU workers enforce a cap


@contextlib.contextmanager
def recomputing():
    """The planner keeps no graph in this block (schedules built in it keep that choice)."""
    keepable = Schedule.keepable
    Schedule.keepable = lambda self, quantized=None: []
    try:
        yield
    finally:
        Schedule.keepable = keepable


def plan_for(num_layers: int) -> rp.Plan:
    """Two forward stages and two-layer backward stages: every backward stage but the lowest lies in one
    forward stage, so on one worker all of them but [0-1] can keep their graph."""
    half = 2 * ((num_layers - 2) // 4)   # on a backward stage's boundary
    backward = [range(num_layers - 2, num_layers)] + [range(s, s + 2) for s in range(num_layers - 4, -1, -2)]
    return rp.Plan(forward=[range(0, half), range(half, num_layers - 2)], backward=backward)


def measure(hidden: int = 256, blocks: int = 6, rows: int = 8, seq: int = 256, workers: int = 1, rounds: int = 5,
            steps: int = 3) -> tuple[list[dict], str]:
    cfg = DecoderConfig(hidden=hidden, layers=blocks, heads=max(1, hidden // 64))
    layers = build_layers(cfg, seed=0)
    plan = plan_for(len(layers))
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (rows, seq), generator=gen) for _ in range(2))
    kw = dict(devices=["cpu"] * workers, device_memory=CAP, plan=plan, num_microbatches=2 * workers,
              resident_layers=0, compute_dtype=torch.float32)
    plain = nn.Sequential(*build_layers(cfg, seed=0))
    with recomputing():
        old = rp.RoundPipe(build_layers(cfg, seed=0), **kw)
        old.forward_backward(x, labels=y, loss_fn=loss_fn)   # its schedule is built and checked here
        old.synchronize()   # before the other call: CPU matmuls round by how many threads they get
    new = rp.RoundPipe(build_layers(cfg, seed=0), **kw)
    new.forward_backward(x, labels=y, loss_fn=loss_fn)
    new.synchronize()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(old.parameters(), new.parameters()))

    def rp_call(model):
        def run():
            model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.synchronize()
        return run

    def plain_call():
        loss_fn(plain(x), y).backward()

    providers = {"plain": plain_call, "recompute": rp_call(old), "kept graphs": rp_call(new)}
    times: dict[str, list[float]] = {name: [] for name in providers}
    for fn in providers.values():
        fn()   # warm-up
    for _ in range(rounds):
        for name, fn in providers.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    with new.record_trace() as trace_new:
        rp_call(new)()
    with old.record_trace() as trace_old:
        rp_call(old)()
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    tokens = rows * seq
    rows_out = []
    for name in providers:
        row = {"provider": name, "ms": ms[name], "tokens/s": tokens / ms[name] * 1000,
               "% of limit": 100 * ms["plain"] / ms[name], "vs recompute": ms["recompute"] / ms[name]}
        model = {"recompute": old, "kept graphs": new}.get(name)
        if model is not None:
            sched = model.dispatcher.schedule(plan, True, 2 * workers, model.round_size)
            stats = model.memory_stats()["workers"]
            trace = trace_new if model is new else trace_old
            kept = [plan.backward[j] for j in sorted(sched.kept)]
            row.update({"kept": ",".join(f"{r.start}-{r.stop - 1}" for r in kept) or "-",
                        "recomputed stages": len({e.args["stage"] for e in trace.events
                                                  if e.cat != "copy" and e.args.get("part") == "recompute"}),
                        "peak MiB": max(s["peak_total"] for s in stats.values()) / 2**20,
                        "predicted MiB": max(s.get("predicted_peak", 0) for s in stats.values()) / 2**20})
        rows_out.append(row)
    old.close()
    new.close()
    note = (f"tiny decoder hidden {hidden}, {blocks} blocks ({len(layers)} layers), {rows} x {seq} tokens, "
            f"{workers} CPU worker(s), {2 * workers} microbatches, fp32, plan {plan}, cap {CAP >> 20} MiB; "
            f"medians of {rounds} x {steps} calls, providers interleaved; gradients bitwise equal: {same}; "
            f"{torch.get_num_threads()} torch threads")
    return rows_out, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/kept_graphs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1, help="CPU workers (1 or 2 keep graphs with this plan)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    size = dict(hidden=64, blocks=4, seq=64, rounds=1, steps=2) if args.quick else {}
    rows, note = measure(workers=args.workers, **size)
    report = Report("kept_graphs", columns=["provider", "ms", "tokens/s", "% of limit", "vs recompute", "kept",
                                            "recomputed stages", "peak MiB", "predicted MiB"], device="cpu")
    for row in rows:
        report.add(**row)
    report.note(note)
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
