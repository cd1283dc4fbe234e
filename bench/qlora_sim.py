"""Predicted tokens/s of LoRA on Qwen3-235B-A22B on 8 RTX 4090-class GPUs: bf16 base against NF4 base.

Simulated, not measured (roundpipe.sim with its weight uploads, roundpipe.sim.uploads):
every slot uploads its layers' bytes over PCIe while the GPU computes the slot before
it, and the asynchronous RoundPipe schedule runs rounds of N + 1 = 9 microbatches.  The
published RoundPipe reports 1,820 tokens/s for this run (8x RTX 4090, seq 2048); it is
printed beside, not run here.

Model (the published config, roundpipe/shapes.py): 94 decoder layers, hidden 4096, 64 query / 4 KV heads of 128,
128 experts of intermediate 1536 per layer, 8 routed per token, vocab 151,936, untied
head.  Per layer 2.488 B parameters (attention 71.3 M, experts 2.416 B, router 0.5 M),
222.8 M active per token; 235.1 B in all, 21.5 B active with the head.  The embedding is a
layer of its own (uploaded, no compute), the final norm + LM head the fused stage's head.

Assumptions (all flags or constants below):
- PCIe: --pcie-gbps (22) host -> device per GPU, pinned (PCIe 4.0 x16); with --host-gbps
  the GPUs share that much in all (a switch uplink, host memory), each its fair share.
- Every expert of a layer crosses PCIe on every pass that needs the layer (its forward
  slot and its backward slot, each round): the routing is known only on the GPU, and a
  2,048-token microbatch routes ~128 tokens to each expert, so all are used anyway.
- Upload bytes per base weight: bf16 2; NF4 with double quantization 0.5 + 1/64 + 4/16384
  (+ 1 KiB a tensor) = 0.516.  Quantized: q/k/v/o and the experts' gate/up/down; the router,
  norms, embedding and LM head stay bf16.  LoRA r16 on q/k/v/o (its bf16 upload copy
  travels too; 0.54 M parameters a layer).  transformers 5 stores Qwen3-MoE experts as
  fused 3-D tensors; `quantize=` stores them 4-bit per expert (roundpipe.quant.QuantExperts),
  so the NF4 rows are what the engine quantizes.
- Compute: bf16 dense at --tflops (165, an RTX 4090's spec with fp32 accumulation) x --mfu
  (0.4: the experts' GEMMs are small, ~128 tokens each); per token and layer, forward
  2 x active + 2 x seq x 8192 (causal attention) FLOPs; backward only the input gradient
  of the frozen base (2 x active) + 2 x the attention forward + LoRA's weight gradient;
  full recomputation (the simulator adds it).  LM head: 2 x 4096 x 151,936 FLOPs a token
  forward, the same backward (input gradient only), + 8 bytes a logit at 0.9 TB/s.
- Activations: one microbatch's stage input (tokens x 4096 x 2 bytes) rides the same link
  into every slot (and the gradient into every backward slot); downloads are not modelled.
- Dequantization on the GPU: unmeasured on an RTX 4090.  The H200 measurement
  (docs/quantization.md: 348 us for 8192 x 28672 NF4 -> bf16, against 237 us for a bf16
  clone, i.e. 3.97 TB/s) scaled by device-memory copy bandwidth, 3.97 -> 0.9 TB/s: 6.5 ps
  a weight, 16 ms for a layer's 2.49 B.  Three variants:
      per product     what the engine did before roundpipe/quant/keep.py: the whole layer
                      dequantized for every product, i.e. forward, recompute and backward of
                      every microbatch (all 128 experts)
      per stage run   what the engine does now: dequantized once per slot (stage run) and kept
                      for its microbatches and products (the dequantized layer is held on the
                      GPU beside the packed one: in the planner's weight bytes, which makes
                      stages of one layer here)
      free         unbuilt bound: a fused dequant-matmul whose dequantization hides under it
- Memory: the planner's budget --budget-gb (22: a 24 GB card less the CUDA context), a stage
  within half of it; activations 34 x tokens x hidden + the experts' intermediates.  The
  partition is the best of the planner's greedy candidates by simulated time.

    python bench/qlora_sim.py [--out bench/results] [--no-save]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.planner import LayerCost  # noqa: E402
from roundpipe.shapes import QWEN3_235B_A22B, DecoderShape  # noqa: E402
from roundpipe.sim import Costs, Uploads, simulate, sizes_from_plan  # noqa: E402
from roundpipe.sim.tune import candidate_plans  # noqa: E402

PUBLISHED = 1820.0          # tokens/s, the published RoundPipe, 8x RTX 4090, Qwen3-235B-A22B LoRA, seq 2048
GPU_BW = 0.9e12             # RTX 4090 device-memory copy bytes/s (1.008 TB/s spec), assumed
# docs/quantization.md, H200: NF4 (double quant) -> bf16 of 8192 x 28672 in 348 us; bf16 clone 237 us
H200_DEQUANT_S_PER_WEIGHT = 348e-6 / (8192 * 28672)
H200_CLONE_BW = 2 * 2 * 8192 * 28672 / 237e-6
DEQUANT_S_PER_WEIGHT = H200_DEQUANT_S_PER_WEIGHT * H200_CLONE_BW / GPU_BW
DEQUANT = ("per product", "per stage run", "free")


LORA_RANK = 16              # LoRA on q/k/v/o


def small_params(m: DecoderShape) -> int:
    """A layer's router and norms (bf16 in both bases): what is neither attention nor experts."""
    return m.layer_parameters() - sum(m.attention_numels()) - m.experts * m.expert_parameters()


def lora_params(m: DecoderShape, rank: int = LORA_RANK) -> int:
    """LoRA A and B of q, k, v and o in one layer."""
    return rank * ((m.hidden + m.q_dim) * 2 + (m.hidden + m.kv_dim) * 2)


def nf4_bytes(numel: int) -> int:
    """Packed bytes + double-quantized statistics of one tensor (roundpipe/quant/format.py)."""
    blocks = math.ceil(numel / 64)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4


def layer_upload_bytes(m: DecoderShape, base: str) -> float:
    """One decoder layer's upload: base weights, router + norms (bf16), LoRA's bf16 upload copy."""
    if base == "bf16":
        weights = 2 * (sum(m.attention_numels()) + m.experts * m.expert_parameters())
    else:   # experts as 3 fused tensors [E, 2I, H] (gate/up) and [E, H, I] (down), quantized whole
        weights = (sum(nf4_bytes(n) for n in m.attention_numels())
                   + nf4_bytes(m.experts * 2 * m.hidden * m.expert_intermediate)
                   + nf4_bytes(m.experts * m.hidden * m.expert_intermediate))
    return weights + 2 * small_params(m) + 2 * lora_params(m)


def model(m: DecoderShape, base: str, dequant: str, tokens: int, seq: int, rate: float, gbps: float,
          host_gbps: float | None, budget: float, round_size: int) -> tuple[Costs, Uploads, list[LayerCost], float]:
    """Simulator costs (embedding + decoder layers, head), uploads, the planner's view, the memory budget."""
    q, active, lora = m.q_dim, m.layer_parameters(active=True), lora_params(m)
    base_weights = sum(m.attention_numels()) + m.experts * m.expert_parameters()
    fwd = tokens * (2 * active + 2 * seq * q + 2 * lora) / rate
    bwd = tokens * (2 * active + 4 * seq * q + 4 * lora) / rate
    deq_layer = DEQUANT_S_PER_WEIGHT * base_weights
    if base == "nf4" and dequant == "per product":   # forward, recompute, backward: each dequantizes
        fwd, bwd = fwd + deq_layer, bwd + deq_layer
    elif base == "nf4" and dequant == "per stage run":   # once a slot, spread over its microbatches
        fwd += deq_layer / round_size
    head_mm = 2 * m.hidden * m.vocab * tokens / rate
    loss = 8 * tokens * m.vocab / GPU_BW
    act = tokens * m.hidden * 2
    costs = Costs((0.0,) + (fwd,) * m.layers, (0.0,) + (bwd,) * m.layers, head_mm + loss, head_mm + loss,
                  comm=act / (gbps * 1e9))
    layer = layer_upload_bytes(m, base)
    head_bytes = 2 * (m.vocab * m.hidden + m.hidden)
    uploads = Uploads((2.0 * m.vocab * m.hidden,) + (layer,) * m.layers, gbps, head_bytes, act, host_gbps)
    # the planner's view: per-microbatch times no shorter than the slot's upload shared by its microbatches
    bw = uploads.bandwidth(8)
    saved = 34 * tokens * m.hidden + tokens * m.experts_per_token * 3 * m.expert_intermediate * 2
    held = layer + (2 * base_weights if dequant == "per stage run" and base == "nf4" else 0)
    lora_grads = 4 * lora
    planner = [LayerCost(0.0, 0.0, int(2 * m.vocab * m.hidden), act, 0)]
    planner += [LayerCost(max(fwd, layer / bw / round_size), max(fwd + bwd, layer / bw / round_size), int(held),
                          int(saved), lora_grads) for _ in range(m.layers)]
    # the fused linear + cross-entropy holds a logits chunk of at most 1 GiB and dh (roundpipe.kernels)
    planner.append(LayerCost(head_mm + loss, 2 * (head_mm + loss), int(head_bytes), (1 << 30) + 4 * act, 0))
    if base == "nf4" and dequant == "per product":   # the largest transient: the experts' gate/up, dequantized
        budget -= 2 * (2 * m.experts * 2 * m.hidden * m.expert_intermediate)
    return costs, uploads, planner, budget


def run(m: DecoderShape, base: str, dequant: str, mb_seqs: int, args, workers: int = 8) -> dict:
    tokens = mb_seqs * args.seq
    round_size = workers + 1
    costs, uploads, planner, budget = model(m, base, dequant, tokens, args.seq, args.tflops * 1e12 * args.mfu,
                                            args.pcie_gbps, args.host_gbps, args.budget_gb * 1e9, round_size)
    best = None
    for plan in candidate_plans(planner, budget):
        r = simulate("roundpipe-async", costs, workers, round_size, sizes_from_plan(plan, costs),
                     iterations=args.iterations, uploads=uploads)
        if best is None or r.makespan < best[1].makespan:
            best = (plan, r)
    if best is None:
        raise SystemExit(f"{base} {dequant}: no partition fits --budget-gb {args.budget_gb}")
    plan, r = best
    per_gpu_link = r.upload_bytes / workers / uploads.bandwidth(workers)
    tps = round_size * tokens / r.makespan
    fwd, bwd = r.partition
    base_host = m.layers * (layer_upload_bytes(m, base) - 2 * lora_params(m)) + 2 * (2 * m.vocab * m.hidden + m.hidden)
    return {"base": base, "dequant": dequant if base == "nf4" else "-", "host base GB": base_host / 1e9,
            "PCIe GB/s": uploads.bandwidth(workers) / 1e9, "tokens/mb": tokens,
            "upload GB/iter": r.upload_bytes / 1e9, "iter s": r.makespan, "link busy %": 100 * per_gpu_link / r.makespan,
            "GPU busy %": 100 * (1 - r.bubbles.ratio), "tokens/s": tps, "vs published": tps / PUBLISHED,
            "stages": f"{len(fwd)}F+{len(bwd)}B", "layer upload GB": uploads.layer_bytes[1] / 1e9,
            "layer fwd ms": costs.fwd[1] * 1e3, "layer bwd ms": costs.bwd[1] * 1e3, "microbatches": round_size,
            "seq": args.seq, "gpus": workers, "tflops": args.tflops, "mfu": args.mfu,
            "host_gbps": args.host_gbps, "simulated": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/qlora_sim.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pcie-gbps", type=float, default=22.0, help="host -> device GB/s per GPU")
    parser.add_argument("--host-gbps", type=float, default=None, help="GB/s all GPUs share (default: none)")
    parser.add_argument("--shared-too", action=argparse.BooleanOptionalAction, default=True,
                        help="also the rows with pairs of GPUs sharing one x16 link (--host-gbps 4 x --pcie-gbps)")
    parser.add_argument("--tflops", type=float, default=165.0, help="dense bf16 peak TFLOP/s")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak the layers reach")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb-seqs", default="1,4", help="sequences per microbatch, comma-separated")
    parser.add_argument("--budget-gb", type=float, default=22.0)
    parser.add_argument("--iterations", type=int, default=6)
    add_common_args(parser)
    args = parser.parse_args(argv)
    m = QWEN3_235B_A22B
    report = Report("qlora_sim", columns=["base", "dequant", "host base GB", "PCIe GB/s", "tokens/mb", "upload GB/iter", "iter s",
                                          "link busy %", "GPU busy %", "tokens/s", "vs published", "stages"])
    links = [(args.pcie_gbps, args.host_gbps)]
    if args.shared_too and args.host_gbps is None:
        links.append((args.pcie_gbps, 4 * args.pcie_gbps))
    for gbps, host in links:
        args.pcie_gbps, args.host_gbps = gbps, host
        for mb in (int(x) for x in args.mb_seqs.split(",")):
            report.add(**run(m, "bf16", "-", mb, args))
            for dequant in DEQUANT:
                report.add(**run(m, "nf4", dequant, mb, args))
    report.note(f"SIMULATED (roundpipe.sim, roundpipe-async, rounds of 9 microbatches), unmeasured on any GPU; "
                f"Qwen3-235B-A22B shape: {m.parameters() / 1e9:.1f} B parameters, {m.layer_parameters() / 1e9:.3f} B a layer, "
                f"{m.layer_parameters(active=True) / 1e6:.1f} M active a layer; LoRA r{LORA_RANK} on q/k/v/o")
    report.note(f"8 GPUs at {args.tflops:g} TFLOP/s x MFU {args.mfu:g}; seq {args.seq}; PCIe {args.pcie_gbps:g} GB/s "
                f"per GPU (shared rows: 2 GPUs per x16 link); dequantization {DEQUANT_S_PER_WEIGHT * 1e12:.2f} ps a "
                f"weight (H200 measurement scaled by copy bandwidth, unmeasured on an RTX 4090)")
    report.note("host base GB: the frozen model in host memory (bf16 embedding and LM head in both); the LoRA "
                "masters, optimizer state and gradients add ~1 GB")
    report.note(f"published RoundPipe, 8x RTX 4090, seq 2048: {PUBLISHED:,.0f} tokens/s (not run here)")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
