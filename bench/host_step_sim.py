"""Host optimizer step per iteration: the Trainer's old path against the fused per-layer step (simulated).

Llama-3.1-8B-shaped full fine-tuning on 8 RTX 4090-class GPUs, the asynchronous and
synchronous RoundPipe schedules of roundpipe.sim with the host step of
roundpipe.sim.hoststep, three policies:

    old path     "whole" synchronous: one torch AdamW over every parameter after the
                 last layer's gradients arrived, the GPUs idle meanwhile (today's
                 rp.hf.Trainer route for the Trainer's own optimizer, issue 30)
    per-layer    the fused step of each layer as soon as its backward stage's gradients
                 have landed, under the rest of the backward; the next iteration's
                 first forward stage waits for layer 0's (the embedding's) step
    async        the same per-layer steps, one step stale: iteration t's step runs
                 under iteration t + 1 and shows only when longer than it

and, per row, the step's exposed seconds per iteration (the iteration time with the
step minus the same schedule's with an instantaneous step) and the iteration time.
Simulated, not measured on any GPU.

Host rates (params/s, all cores of the host on one step), read from the committed
rows of bench/results/cpu_optim.jsonl: optimizer adamw, params 50M, the two runs of
2026-11-25 (commits ba970ed and 530641c, a 2-core AMD EPYC VM, 2 threads, AVX-512),
mean of the two runs' Mparam/s:
- fused:  "(c) roundpipe bf16 [avx512]": fp32 master + m + v, bf16 gradients in, the
          bf16 upload copy out, one pass (28 bytes a parameter)
- torch:  "(a) torch seq bf16": bf16 gradient -> float, unscale, AdamW(fused=True),
          weight.to(bf16): what the old path does (roundpipe.engine.step.optimizer_step,
          "torch optimizer": one optimizer.step() over the fp32 p.grad, then the upload
          copies); "(b') torch fused fp32" (AdamW(fused=True) alone, no casts) is printed
          as the old path's lower bound
Host scaling: the steps are memory-bound (the VM's best STREAM-style probe in those
runs: 40-45 GB/s; the fused step moved 33-38 GB/s), so a host with more cores steps
faster by its memory bandwidth, not by its core count: every rate is multiplied by
--host-scale (default 1 and 4: the VM as measured, and a host with 4x its bandwidth,
~170 GB/s, e.g. an 8-channel DDR4-3200 server of 16+ cores, as 8-GPU boxes have).  The
same factor for torch's sequence assumes it stays memory-bound too (~50 bytes a
parameter in separate passes, per the project's design notes).  Unmeasured on such a host.

Model (Llama-3.1-8B, roundpipe/shapes.py): 32 decoder layers, hidden 4096, 32 query / 8 KV heads of 128,
intermediate 14336, vocab 128256, untied LM head; 218.1 M parameters a layer, 525.3 M
each for the embedding and the head, 8.03 B in all, every one trained and stepped.  The
embedding is a layer of its own (no compute; its gradient lands with the last backward
stage, so the per-layer synchronous step ends with its 525 M parameters).

GPUs and links (flags): --tflops 165 (RTX 4090 dense bf16, fp32 accumulation) x --mfu 0.6;
per token and layer forward 2 x params + 2 x seq x 4096 FLOPs (causal attention), backward
2 x forward, full recomputation added by the simulator; LM head 2 x 4096 x 128256 FLOPs a
token each way + 8 bytes a logit at 0.9 TB/s.  PCIe --pcie-gbps 22 (4.0 x16, pinned) per
GPU: every slot uploads its layers' bf16 weights and its microbatches' activations
(roundpipe.sim.uploads), a hop between GPUs costs the activation over that link; gradient
downloads are not modelled.  Batch: rounds of N + 1 = 9 microbatches an iteration, each
--mb-seqs sequences of --seq 2048 tokens (default 1 and 4: 18,432 and 73,728 tokens an
iteration).  Partition: the planner's (roundpipe.planner.partition) under a 22 GB budget.

    python bench/host_step_sim.py [--out bench/results] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.planner import LayerCost, partition  # noqa: E402
from roundpipe.shapes import LLAMA_3_1_8B, DecoderShape  # noqa: E402
from roundpipe.sim import Costs, HostStep, Uploads, host_step, sizes_from_plan  # noqa: E402

GPU_BW = 0.9e12          # RTX 4090 device-memory bytes/s (1.008 TB/s spec), for the loss's logit traffic
BUDGET = 22e9            # bytes a GPU gives the planner (24 GB less the CUDA context)
RATE_ROWS = {"fused": "(c) roundpipe bf16 [avx512]", "torch": "(a) torch seq bf16",
             "torch fp32 only": "(b') torch fused fp32"}
POLICIES = (   # row label, rate row, HostStep policy, schedule
    ("old: whole torch AdamW, sync", "torch", "whole", "roundpipe"),
    ("old, torch fused fp32 only (bound)", "torch fp32 only", "whole", "roundpipe"),
    ("per-layer fused, sync", "fused", "per-layer", "roundpipe"),
    ("per-layer fused, async", "fused", "per-layer", "roundpipe-async"),
)


def layer_params(m: DecoderShape) -> tuple[int, int, int]:
    """Parameters of the embedding layer, a decoder layer and the head layer (final norm + LM head)."""
    return m.vocab * m.hidden, m.layer_parameters(), m.vocab * m.hidden + m.hidden


def measured_rates(path: Path) -> tuple[dict[str, float], list[str]]:
    """Mean params/s of each RATE_ROWS provider over the adamw 50M rows of cpu_optim.jsonl, and the runs used."""
    found: dict[str, list[float]] = {k: [] for k in RATE_ROWS}
    runs = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("optimizer") != "adamw" or r.get("params") != "50M":
            continue
        for key, provider in RATE_ROWS.items():
            if r["provider"] == provider:
                found[key].append(r["Mparam/s"] * 1e6)
                run = f"{r['commit']} {r['date']} ({r['device']}, {r['cpu_threads']} threads)"
                if run not in runs:
                    runs.append(run)
    missing = [RATE_ROWS[k] for k, v in found.items() if not v]
    if missing:
        raise SystemExit(f"{path}: no adamw 50M rows for {missing}")
    return {k: sum(v) / len(v) for k, v in found.items()}, runs


def model(m: DecoderShape, tokens: int, seq: int, flops: float, gbps: float) -> tuple[Costs, Uploads, list[LayerCost]]:
    """Simulator costs (embedding + decoder layers, head), uploads and the planner's view, one microbatch."""
    embedding, layer, head = layer_params(m)
    fwd = tokens * (2 * layer + 2 * seq * m.q_dim) / flops
    head_mm = 2 * m.hidden * m.vocab * tokens / flops
    loss = 8 * tokens * m.vocab / GPU_BW
    act = 2 * tokens * m.hidden
    costs = Costs((0.0,) + (fwd,) * m.layers, (0.0,) + (2 * fwd,) * m.layers, head_mm + loss, 2 * head_mm + loss,
                  comm=act / (gbps * 1e9))
    uploads = Uploads((2.0 * embedding,) + (2.0 * layer,) * m.layers, gbps, 2.0 * head, act)
    planner = [LayerCost(0.0, 0.0, 2 * embedding, act, 4 * embedding)]
    planner += [LayerCost(fwd, 3 * fwd, 2 * layer, 34 * tokens * m.hidden, 4 * layer) for _ in range(m.layers)]
    planner.append(LayerCost(head_mm + loss, 2 * (head_mm + loss), 2 * head, (1 << 30) + 4 * act, 4 * head))
    return costs, uploads, planner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/host_step_sim.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pcie-gbps", type=float, default=22.0, help="host -> device GB/s per GPU")
    parser.add_argument("--tflops", type=float, default=165.0, help="dense bf16 peak TFLOP/s")
    parser.add_argument("--mfu", type=float, default=0.6, help="fraction of the peak the layers reach")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb-seqs", default="1,4", help="sequences per microbatch, comma-separated")
    parser.add_argument("--host-scale", default="1,4", help="host rate multipliers over the measured VM's")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--rates", default=str(ROOT / "bench/results/cpu_optim.jsonl"),
                        help="cpu_optim rows to take the AdamW rates from")
    add_common_args(parser)
    args = parser.parse_args(argv)
    m, N = LLAMA_3_1_8B, args.gpus
    rates, runs = measured_rates(Path(args.rates))
    report = Report("host_step_sim", columns=["policy", "host x", "tokens/iter", "step s", "no-step iter s",
                                              "iter s", "exposed s", "exposed %", "tokens/s", "vs old"])
    for mb in (int(x) for x in args.mb_seqs.split(",")):
        tokens = mb * args.seq
        costs, uploads, planner = model(m, tokens, args.seq, args.tflops * 1e12 * args.mfu, args.pcie_gbps)
        fwd, bwd = sizes_from_plan(partition(planner, N, N + 1, memory_budget=BUDGET).plan, costs)
        embedding, layer, head = layer_params(m)
        params = (float(embedding),) + (float(layer),) * m.layers + (float(head),)
        for scale in (float(x) for x in args.host_scale.split(",")):
            old = None
            for label, rate_key, policy, schedule in POLICIES:
                step = HostStep(params, rates[rate_key] * scale, policy)
                r = host_step(schedule, costs, N, N + 1, step, partition=(fwd, bwd), iterations=args.iterations,
                              uploads=uploads)
                old = r.iteration if old is None else old
                report.add(policy=label, schedule=schedule, **{
                    "host x": scale, "tokens/iter": (N + 1) * tokens, "step s": r.step,
                    "no-step iter s": r.baseline, "iter s": r.iteration, "exposed s": r.exposed,
                    "exposed %": 100 * r.exposed / r.iteration, "tokens/s": (N + 1) * tokens / r.iteration,
                    "vs old": old / r.iteration}, rate_params_s=rates[rate_key] * scale, rate_row=RATE_ROWS[rate_key],
                    partition=f"{','.join(map(str, fwd))}|{','.join(map(str, bwd))}", gpus=N, microbatches=N + 1,
                    seq=args.seq, mb_seqs=mb, tflops=args.tflops, mfu=args.mfu, pcie_gbps=args.pcie_gbps,
                    simulated=True)
    report.note(f"SIMULATED (roundpipe.sim with roundpipe.sim.hoststep and weight uploads), unmeasured on any GPU; "
                f"Llama-3.1-8B shape, {m.parameters() / 1e9:.2f} B parameters stepped, {N} GPUs at {args.tflops:g} TFLOP/s x "
                f"MFU {args.mfu:g}, PCIe {args.pcie_gbps:g} GB/s per GPU, {N + 1} microbatches an iteration")
    report.note("host rates (params/s at host x 1, mean of the adamw 50M rows of " + "; ".join(runs) + "): "
                + ", ".join(f"{RATE_ROWS[k]} {v / 1e6:.0f} M" for k, v in rates.items())
                + "; host x k multiplies every rate by k (memory-bound steps on a host with k x the VM's bandwidth)")
    report.note("exposed = iteration with the step - the same schedule with an instantaneous step; vs old = the "
                "old path's iteration time over the row's, same host and batch")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
