"""What each GPU-path change of issue 38 is expected to gain on one GPU (simulated, unmeasured on GPU).

One H100 or H200, one worker, the engine's default of N + 1 = 2 microbatches an iteration;
roundpipe.sim's RoundPipe schedule with weight uploads and the per-layer host step, changed by
roundpipe.sim.gains:

    today          every backward stage but the fused one recomputes; every slot uploads its weights
    (a) no recomp  backward stages whose activations (all microbatches) fit beside the working set keep
                   them: no recompute, no re-upload of their input
    (b) resident   a prefix of layers whose bf16 weights (2 B/param; a frozen base as stored) stays on the
                   GPU; updated weights go up once an iteration, a frozen base once in the run.  Every
                   prefix is tried: the other layers are planned under the cap less the prefix's bytes
                   (their working set, twice the largest stage, within it), and the prefix with the
                   shortest simulated iteration is the row's
    (b) engine     the engine's resident weights with the host step (roundpipe.sim.gains): today's plan
                   unchanged, and the largest prefix whose bytes (trained layers at 2 B/param; a frozen
                   base as stored: bf16 2, NF4 packed 0.516 B/param) beside each stage and the one it
                   prefetches keep the predicted peak under the cap (the engine's rule, not the simulated
                   time).  That peak counts the whole prefetched stage (this file's working set, above the
                   engine's, which counts its weights and next input only), so the engine's 5% headroom
                   is not applied on top.  A trained layer goes up once an iteration instead of twice; a
                   frozen base once in the run; the step stays on the host
    (b) + dev step the same with the prefix's state on the GPU (fp32 AdamW: 16 B/param = fp32 master 4 +
                   m, v 8 + bf16 weights 2 + gradient 2; 8-bit AdamW with bf16 masters: 6): no upload, no
                   host step for them, a device step instead
    (c) reuse      each recompute saves a causal-mask build (mb_seqs x seq^2 bytes at HBM speed) and one
                   host sync (--sync-us)
    (d) layer      the planner's layer-grain plan (partition(..., layer_grain=True)); per-layer saved
                   inputs uploaded for a recompute
    all            every change: plan (default or layer-grain), resident prefix and its kind chosen by
                   the simulated iteration time as in (b), (a) in the room the working set leaves, (c)

against plain PyTorch (model, fp32 gradients and AdamW state on the GPU, no recompute, no transfer)
where it fits the cap: 16 B/param + every layer's saved activations + 10 B a logit (LoRA: the frozen
base as stored + 16 B an adapter parameter).

LoRA workloads (Llama-3.1-8B, rank 16 on q, k, v, o, gate, up, down: 1.31 M adapter parameters a layer,
fp32 AdamW on the host): the base (embedding, layers, final norm + LM head) is frozen, bf16 or NF4
(the decoder layers' seven projections; 0.5 B + 1/64 B absmax + double-quantization statistics a
weight, roundpipe/quant/format.py; norms, embedding and head stay bf16).  Per layer and token, forward
2 x (base + adapters) + 2 x seq x q_dim FLOPs, backward 2 x base (the input gradient only) + 4 x
adapters + 4 x seq x q_dim; the head's backward is its input gradient (2 x hidden x vocab).  An NF4
layer is dequantized once a stage run (forward slot; backward slot's recompute or fused stage):
1.48 ps a weight on the H200 (docs/quantization.md: 348 us for 8192 x 28672), scaled by HBM bandwidth
for the H100, charged to its forward as dequant / microbatches; the planner holds the dequantized bf16
layer beside the packed one.  The adapters' bf16 copy (2 B/param) is uploaded with its layer and is the
only part of a resident layer that goes up after the first iteration.

Costs (per microbatch): a decoder layer's forward 2 x params + 2 x seq x q_dim FLOPs a token (causal
attention), backward 2 x forward, recompute one more forward; the LM head 2 x hidden x vocab FLOPs a
token each way + 8 bytes a logit at the HBM bandwidth; FLOPs at --tflops (dense bf16 spec: 989 for
the H100 SXM and the H200) x --mfu (0.40: the H200's plain-PyTorch run of the 0.8B reached 0.38 of it
by this count).  PCIe --pcie-gbps 55 (H2D pinned, measured on the H200, bench/results/gpu-2026-11-26;
assumed the same on an H100, also gen5).  Device steps at 0.7 x HBM (3.35 / 4.8 TB/s) moving the
bytes a parameter the CPU rows say the same step moves (AdamW 28, AdamW8bit 16).  Activations saved
for a backward: 34 x hidden bytes a token and layer; one microbatch's stage input 2 x hidden bytes a
token.  Gradient downloads are not modelled (the other PCIe direction).

Host step: the fused per-layer step, rates from bench/results/cpu_optim.jsonl ("(c) roundpipe bf16
[avx512]", params 50M, every run's row, mean; adamw for fp32 state, adamw8bit for 8-bit state) on a
2-thread VM, scaled to a 16-core host as rate x 16 / 2, capped at --host-gbs (100 GB/s, a stated
bound for a 16-core server's DRAM, unmeasured) / the row's bytes a parameter.

    python bench/gpu_gains_sim.py [--out bench/results] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402
from roundpipe.models.tiny_decoder import PRESETS  # noqa: E402
from roundpipe.planner import LayerCost  # noqa: E402
from roundpipe.planner.costs import backward_memory, forward_memory  # noqa: E402
from roundpipe.planner.partition import LayerTooLarge, partition_for_cap  # noqa: E402
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, DecoderShape  # noqa: E402
from roundpipe.sim import Costs, HostStep, Uploads, sizes_from_plan  # noqa: E402
from roundpipe.sim.gains import GpuPath, plain_time, resident_prefix, simulate_path  # noqa: E402

GiB = 1 << 30
DEVICES = {"H100": {"hbm": 3.35e12, "card": 80e9}, "H200": {"hbm": 4.8e12, "card": 141e9}}
HBM_EFFICIENCY = 0.7
MICROBATCHES = 2                 # one worker: N + 1
ACT_PER_TOKEN_HIDDEN = 34        # bytes saved for a layer's backward, per token and hidden unit
LOGIT_BYTES = 10                 # bf16 logits, their fp32 copy and gradient (plain PyTorch's loss)
STATE_BYTES = {"fp32": 16.0, "8bit": 6.0}         # device bytes a parameter for a device step (module docstring)
RATE_OPTIMIZER = {"fp32": "adamw", "8bit": "adamw8bit"}
RATE_PROVIDER = "(c) roundpipe bf16 [avx512]"
MEASURED = {"sync": 0.67, "async": 0.83}          # 0.8B decoder on the H200 against plain PyTorch (docs/benchmarks.md)
CFG = PRESETS["0.8b"]
DECODER_08B = DecoderShape("0.8b decoder", CFG.hidden, CFG.intermediate, CFG.layers, CFG.vocab_size, CFG.heads,
                           CFG.heads, CFG.head_dim)


@dataclass(frozen=True)
class Workload:
    name: str
    shape: DecoderShape
    batch: int
    seq: int
    state: str                   # "fp32" or "8bit" (AdamW8bit, bf16 masters)
    cap: float | None            # device bytes; None: the whole card
    base: str | None = None      # None: full fine-tuning; "bf16" or "nf4": LoRA over a frozen base stored so


WORKLOADS = (Workload("0.8b decoder", DECODER_08B, 32, 1024, "fp32", None),
             Workload("qwen3-1.7b", QWEN3_1_7B, 4, 2048, "fp32", 24 * GiB),
             Workload("qwen3-1.7b", QWEN3_1_7B, 4, 2048, "fp32", None),
             Workload("llama-3.1-8b", LLAMA_3_1_8B, 4, 2048, "8bit", 24 * GiB),
             Workload("llama-3.1-8b lora", LLAMA_3_1_8B, 4, 2048, "fp32", 24 * GiB, "bf16"),
             Workload("llama-3.1-8b lora", LLAMA_3_1_8B, 4, 2048, "fp32", None, "bf16"),
             Workload("llama-3.1-8b qlora", LLAMA_3_1_8B, 4, 2048, "fp32", 24 * GiB, "nf4"),
             Workload("llama-3.1-8b qlora", LLAMA_3_1_8B, 4, 2048, "fp32", None, "nf4"))
ENGINE_ROW = "(b) resident, host step (engine)"
LORA_RANK = 16                   # on q, k, v, o, gate, up, down
# docs/quantization.md, H200: NF4 (double quantization) -> bf16 of 8192 x 28672 in 348 us
H200_DEQUANT_S_PER_WEIGHT = 348e-6 / (8192 * 28672)


def lora_params(m: DecoderShape, rank: int = LORA_RANK) -> int:
    """LoRA A and B of a layer's seven projections: rank x (inputs + outputs) each."""
    h, q, kv, i = m.hidden, m.q_dim, m.kv_dim, m.intermediate
    return rank * (2 * (h + q) + 2 * (h + kv) + 3 * (h + i))


def nf4_bytes(numel: int) -> int:
    """One tensor packed as NF4 with double-quantized absmax (roundpipe/quant/format.py): the 4-bit values,
    an 8-bit absmax a block of 64, an fp32 statistic a block of 256 absmax, the 256-entry code, the offset."""
    blocks = math.ceil(numel / 64)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4


def host_rates(path: Path) -> dict[str, tuple[float, float, list[str]]]:
    """optimizer -> (mean params/s, bytes a parameter, runs) of RATE_PROVIDER's 50M rows."""
    out = {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for opt in RATE_OPTIMIZER.values():
        mine = [r for r in rows if r.get("optimizer") == opt and r.get("params") == "50M" and r["provider"] == RATE_PROVIDER]
        if not mine:
            raise SystemExit(f"{path}: no {opt} 50M rows of {RATE_PROVIDER!r}")
        runs = sorted({f"{r['commit']} {r['date'][:10]}" for r in mine})
        out[opt] = (sum(r["Mparam/s"] for r in mine) * 1e6 / len(mine), sum(r["B/param"] for r in mine) / len(mine),
                    runs)
    return out


class Model:
    """One workload on one device: simulator costs, uploads, the planner's view, parameters per layer."""

    def __init__(self, w: Workload, device: dict, flops: float, gbps: float):
        m, self.w = w.shape, w
        tokens = w.batch * w.seq // MICROBATCHES
        self.tokens, self.seq_per_mb = tokens, w.batch // MICROBATCHES
        hbm = device["hbm"] * HBM_EFFICIENCY
        embed, layer = m.vocab * m.hidden, m.layer_parameters()
        head = m.vocab * m.hidden + m.hidden    # the final norm + LM head (tied: its gradient still lands here)
        fwd = tokens * (2 * layer + 2 * w.seq * m.q_dim) / flops
        head_mm = 2 * m.hidden * m.vocab * tokens / flops
        loss = 8 * tokens * m.vocab / device["hbm"]
        act = 2 * tokens * m.hidden
        saved = ACT_PER_TOKEN_HIDDEN * tokens * m.hidden
        self.params = (float(embed),) + (float(layer),) * m.layers + (float(head),)
        self.saved = [0.0] + [float(saved)] * m.layers
        if w.base is None:
            self.costs = Costs((0.0,) + (fwd,) * m.layers, (0.0,) + (2 * fwd,) * m.layers, head_mm + loss,
                               2 * head_mm + loss)
            self.uploads = Uploads((2.0 * embed,) + (2.0 * layer,) * m.layers, gbps, 2.0 * head, act)
            self.planner = [LayerCost(0.0, 0.0, 2 * embed, act, 4 * embed)]
            self.planner += [LayerCost(fwd, 3 * fwd, 2 * layer, saved, 4 * layer) for _ in range(m.layers)]
            self.planner.append(LayerCost(head_mm + loss, 2 * (head_mm + loss), 2 * head,
                                          LOGIT_BYTES * tokens * m.vocab + 4 * act, 4 * head))
            self.trained = self.params
            self.frozen = (0.0,) * len(self.params)
        else:
            self._lora(m, w.base, tokens, flops, device, gbps, embed, layer, head, head_mm, loss, act, saved)
        self.cap = w.cap if w.cap is not None else device["card"]
        self.hbm = hbm
        self._plans: dict = {}
        self.stages: dict = {}     # (layer_grain, budget) -> the plan's (layers, bytes) of each stage, in run order

    def _lora(self, m, base, tokens, flops, device, gbps, embed, layer, head, head_mm, loss, act, saved):
        """Costs, uploads and the planner's view of LoRA over a frozen `base` (module docstring)."""
        lora = lora_params(m)
        linear = [*m.attention_numels(), *[m.intermediate * m.hidden] * 3]
        norms = layer - sum(linear)
        stored = 2 * layer if base == "bf16" else sum(nf4_bytes(n) for n in linear) + 2 * norms
        fwd = tokens * (2 * (layer + lora) + 2 * self.w.seq * m.q_dim) / flops
        bwd = tokens * (2 * layer + 4 * lora + 4 * self.w.seq * m.q_dim) / flops
        held = stored + 2 * lora
        if base == "nf4":   # dequantized once a stage run, held beside the packed layer
            fwd += H200_DEQUANT_S_PER_WEIGHT * DEVICES["H200"]["hbm"] / device["hbm"] * sum(linear) / MICROBATCHES
            held += 2 * sum(linear)
        self.costs = Costs((0.0,) + (fwd,) * m.layers, (0.0,) + (bwd,) * m.layers, head_mm + loss, head_mm + loss)
        self.uploads = Uploads((2.0 * embed,) + (float(stored + 2 * lora),) * m.layers, gbps, 2.0 * head, act)
        self.planner = [LayerCost(0.0, 0.0, 2 * embed, act, 0)]
        self.planner += [LayerCost(fwd, fwd + bwd, held, saved, 4 * lora) for _ in range(m.layers)]
        self.planner.append(LayerCost(head_mm + loss, 2 * (head_mm + loss), 2 * head,
                                      LOGIT_BYTES * tokens * m.vocab + 4 * act, 0))
        self.trained = (0.0,) + (float(lora),) * m.layers + (0.0,)
        self.frozen = (2.0 * embed,) + (float(stored),) * m.layers + (2.0 * head,)

    def plan(self, layer_grain: bool, budget: float | None = None) -> tuple[list[int], list[int], float] | None:
        """The planner's stage sizes under `budget` (default: the cap) and the working set: twice the largest
        stage's bytes (the stage a worker runs and the next one it prefetches; a plan of one stage: its bytes,
        planner.partition.one_stage_fits); None where no plan fits."""
        budget = self.cap if budget is None else budget
        key = (layer_grain, budget)
        if key not in self._plans:
            try:
                p = partition_for_cap(self.planner, 1, MICROBATCHES, budget, prefetch=True,
                                      layer_grain=layer_grain).plan
            except LayerTooLarge:
                self._plans[key] = None
                return None
            stages = [forward_memory(self.planner, r) for r in p.forward]
            stages += [backward_memory(self.planner, r, fused=j == 0, layer_grain=layer_grain)
                       for j, r in enumerate(p.backward)]
            self.stages[key] = list(zip([*p.forward, *p.backward], stages))
            fwd, bwd = sizes_from_plan(p, self.costs)
            # a plan of one stage, run once a worker and iteration, has no neighbour to prefetch beside it
            self._plans[key] = (fwd, bwd, max(stages) if len(stages) == 1 else 2 * max(stages))
        return self._plans[key]

    def resident_sizes(self, per_param: float) -> list[float]:
        """Device bytes of each layer kept resident: a frozen base as stored, `per_param` a trained parameter."""
        return [f + per_param * p for f, p in zip(self.frozen, self.trained)]

    def resident_plans(self, per_param: float, layer_grain: bool = False):
        """(plan, resident layers) for every prefix of layers kept at `per_param` bytes a trained parameter
        (a frozen base as stored): the rest planned under the cap less the prefix, working set included (the
        residency the simulator ranks)."""
        sizes = self.resident_sizes(per_param)
        for r in range(len(sizes) + 1):
            budget = self.cap - sum(sizes[:r])
            if budget <= 0:
                break
            found = self.plan(layer_grain, budget)
            if found is not None and found[2] <= budget:
                yield found, r, budget - found[2]

    def kept(self, bwd: list[int], room: float) -> tuple[int, ...]:
        """Backward stages (B2 on) whose saved activations, every microbatch's, fit in `room`, in order."""
        out, top = [], self.costs.num_layers - bwd[0]
        for j, n in enumerate(bwd[1:], start=1):
            need = MICROBATCHES * sum(self.saved[top - n:top])
            top -= n
            if need > room:
                break
            out.append(j)
            room -= need
        return tuple(out)

    def plain(self) -> float | None:
        """Plain PyTorch's seconds per iteration, None where its state and activations exceed the cap."""
        P = sum(self.trained)
        m = self.w.shape
        need = sum(self.frozen) + 16 * P + MICROBATCHES * (sum(self.saved) + LOGIT_BYTES * self.tokens * m.vocab)
        if need > self.cap:
            return None
        return plain_time(self.costs, MICROBATCHES, 28 * P / self.hbm)


def run_case(model: Model, rate: float, step_bytes: float, reuse_s: float, lag: int, iterations: int) -> list[dict]:
    """Today, each change and all together for one workload, device and step mode."""
    w = model.w
    step = HostStep(model.trained, rate)
    device_s = [p * step_bytes / model.hbm for p in model.trained]
    sb = STATE_BYTES[w.state]

    def sim(fwd, bwd, path):
        return simulate_path(model.costs, MICROBATCHES, fwd, bwd, path, model.uploads, step, device_s,
                             iterations, lag, frozen_bytes=model.frozen)

    def fastest(options):
        """The (fwd, bwd, path, result) of the shortest simulated iteration among (fwd, bwd, path) options."""
        best = None
        for fwd, bwd, path in options:
            res = sim(fwd, bwd, path)
            if best is None or res.iteration < best[3].iteration:
                best = (fwd, bwd, path, res)
        return best

    fwd, bwd, ws = model.plan(False)
    room = model.cap - ws
    rows = [("today", fwd, bwd, GpuPath()),
            ("(a) no recompute where it fits", fwd, bwd, GpuPath(kept=model.kept(bwd, room))),
            ("(c) recompute reuses mask", fwd, bwd, GpuPath(reuse_s=reuse_s))]
    gf, gb, _ = model.plan(True)
    rows.append(("(d) layer-grain recompute", gf, gb, GpuPath(layer_grain=True)))
    out = [(label, f, b, path, sim(f, b, path)) for label, f, b, path in rows]
    for label, per in (("(b) resident weights", 2.0), ("(b) resident + device step", sb)):
        found = fastest((f, b, GpuPath(resident=r, device_step=per == sb and r > 0))
                        for (f, b, _), r, _ in model.resident_plans(per))
        out.insert(len(out) - 2, (label, *found))
    r = resident_prefix(model.stages[False, model.cap], model.resident_sizes(2.0), model.cap)
    out.insert(len(out) - 2, (ENGINE_ROW, fwd, bwd, GpuPath(resident=r), sim(fwd, bwd, GpuPath(resident=r))))
    found = fastest((f, b, GpuPath(model.kept(b, left), r, per == sb and r > 0, reuse_s, grain))
                    for grain in (False, True) for per in (2.0, sb)
                    for (f, b, _), r, left in model.resident_plans(per, grain))
    out.append(("all, chosen by simulated time", *found))
    return [dict(change=label, fwd=f, bwd=b, path=path, result=res) for label, f, b, path, res in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_gains_sim.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tflops", type=float, default=989.0, help="dense bf16 TFLOP/s (H100 SXM and H200 spec)")
    parser.add_argument("--mfu", type=float, default=0.40, help="fraction of --tflops the layers reach")
    parser.add_argument("--pcie-gbps", type=float, default=55.0, help="host -> device GB/s (measured on the H200)")
    parser.add_argument("--host-cores", type=int, default=16, help="host cores for the step (rates measured on 2)")
    parser.add_argument("--host-gbs", type=float, default=100.0, help="host DRAM GB/s bound on the step")
    parser.add_argument("--sync-us", type=float, default=50.0, help="seconds x 1e6 one host sync costs the GPU")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--rates", default=str(ROOT / "bench/results/cpu_optim.jsonl"))
    add_common_args(parser)
    args = parser.parse_args(argv)
    rates = host_rates(Path(args.rates))
    report = Report("gpu_gains_sim", columns=["device", "workload", "cap", "mode", "change", "iter s", "tokens/s",
                                              "vs today", "vs torch", "upload GB", "host step s", "exposed step s",
                                              "exposed %", "recompute s", "resident", "kept"])
    calibration = {}
    for dev_name, dev in DEVICES.items():
        for w in WORKLOADS:
            model = Model(w, dev, args.tflops * 1e12 * args.mfu, args.pcie_gbps)
            rate2, step_bytes, _ = rates[RATE_OPTIMIZER[w.state]]
            rate = min(rate2 * args.host_cores / 2, args.host_gbs * 1e9 / step_bytes)
            mask = model.seq_per_mb * w.seq ** 2 / model.hbm
            plain = model.plain()
            cap = "full card" if w.cap is None else f"{w.cap / GiB:g} GiB"
            tokens = w.batch * w.seq
            for mode, lag in (("sync", 1), ("async", 2)):
                rows = run_case(model, rate, step_bytes, mask + args.sync_us * 1e-6, lag, args.iterations)
                today = rows[0]["result"].iteration
                for row in rows:
                    res, path = row["result"], row["path"]
                    free = simulate_path(model.costs, MICROBATCHES, row["fwd"], row["bwd"], path, model.uploads,
                                         HostStep(tuple(0.0 for _ in model.params), rate),
                                         [p * step_bytes / model.hbm for p in model.trained], args.iterations, lag,
                                         frozen_bytes=model.frozen)
                    exposed = res.iteration - free.iteration
                    exposed = exposed if exposed > 1e-9 * res.iteration else 0.0   # same steady state
                    report.add(device=dev_name, workload=w.name, cap=cap, mode=mode, change=row["change"], **{
                        "iter s": res.iteration, "tokens/s": tokens / res.iteration, "vs today": today / res.iteration,
                        "vs torch": plain / res.iteration if plain else None, "upload GB": res.upload_bytes / 1e9,
                        "host step s": res.host_step, "exposed step s": exposed,
                        "exposed %": 100 * exposed / res.iteration, "recompute s": res.recompute,
                        "resident": f"{path.resident}/{len(model.params)}" + (" dev" if path.device_step else ""),
                        "kept": ",".join(f"B{j + 1}" for j in path.kept) or "-"},
                        plain_iter_s=plain, plain_tokens_s=tokens / plain if plain else None,
                        partition=f"{','.join(map(str, row['fwd']))}|{','.join(map(str, row['bwd']))}",
                        host_rate_params_s=rate, tflops=args.tflops, mfu=args.mfu, pcie_gbps=args.pcie_gbps,
                        host_gbs=args.host_gbs, host_cores=args.host_cores, batch=w.batch, seq=w.seq,
                        state=w.state, microbatches=MICROBATCHES, simulated="SIMULATED, unmeasured on GPU")
                if dev_name == "H200" and w.name == "0.8b decoder":
                    calibration[mode] = plain / today
    report.note("SIMULATED (roundpipe.sim + roundpipe.sim.gains), unmeasured on GPU: one GPU, one worker, "
                f"{MICROBATCHES} microbatches; {args.tflops:g} TFLOP/s x MFU {args.mfu:g}; PCIe {args.pcie_gbps:g} GB/s; "
                f"host step at min(2-core rate x {args.host_cores}/2, {args.host_gbs:g} GB/s / bytes a parameter)")
    report.note("host rates (" + RATE_PROVIDER + ", 50M, mean): " + "; ".join(
        f"{opt} {r / 1e6:.0f} Mparam/s at {b:.0f} B/param over {', '.join(runs)}" for opt, (r, b, runs) in rates.items()))
    report.note("calibration, 0.8b decoder on the H200 against plain PyTorch: simulated today "
                + ", ".join(f"{mode} {calibration[mode]:.2f}x (measured {MEASURED[mode]:.2f}x)" for mode in MEASURED))
    report.note("exposed step = iteration - the same path with an instantaneous host step; vs torch = plain "
                "PyTorch's simulated iteration over the row's (only where plain PyTorch fits the cap)")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
