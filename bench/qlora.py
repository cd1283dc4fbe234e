"""QLoRA on CPU workers: a bf16 frozen base against an NF4 base (issue 28), side by side in one run.

The same Llama-shaped decoder (random weights, widths multiples of 64) with the same PEFT
LoRA adapter (rank 16 on every decoder Linear, fp32 masters) is wrapped twice on two CPU
workers with bf16 compute:

    bf16 base   the frozen base weights stay bf16: 2 bytes per weight in host memory and
                per upload (the frozen master is its own upload copy)
    nf4 base    rp.hf.wrap(quantize="nf4"): bitsandbytes' NF4 with double-quantized absmax,
                packed constant buffers in the arena, uploaded packed, dequantized on the
                worker once per stage run and kept for all its microbatches and products
                (roundpipe/quant/keep.py): once per stage that holds the layer
    nf4 per product   the same model with the keep bypassed: every product dequantizes
                afresh (forward, recompute and backward of every microbatch), which is
                what the engine did before the keep; the baseline of the change

Columns:

    base B/param      host bytes per frozen base weight: memory_stats()["host"]
                      constant_buffers / quantized_numel for nf4; the frozen decoder
                      Linear weights' bytes per weight for bf16 (they are the masters)
    host state MB     memory_stats()["host"]: masters + upload copies + constant buffers +
                      buffers + gradients (what the training state holds, arena slack apart)
    upload MB/iter    param_up copy bytes of one training call (record_trace)
    tokens/s          median over the timed steps (forward_backward + synchronous step); the
                      variants' steps are interleaved (bf16, per product, nf4, bf16, ...)
    tokens/s best     over the fastest timed step (a shared VM's load spikes make medians noisy)
    dequant ms/iter   the CPU dequantization's cost: dequantizing every 4-bit weight once
                      (median), times the dequantizations one iteration made per weight
                      (counted in the traced step)

Ratios (nf4 / bf16) are printed under the table.  On CPU workers uploads are memory
copies, so tokens/s says what the CPU dequantization costs, not what PCIe would save.

    python bench/qlora.py [--quick] [--out DIR_OR_FILE] [--no-save]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import roundpipe as rp  # noqa: E402
from roundpipe.bench.runner import Report, add_common_args, median_time  # noqa: E402
from roundpipe.quant import DequantKeep, QuantLinear, dequantize  # noqa: E402
from roundpipe.quant import linear as quant_linear  # noqa: E402

SHAPES = {   # hidden, intermediate, layers, heads, kv heads, vocab
    "quick": (512, 1408, 4, 8, 4, 2048),
    "full": (1024, 2816, 8, 16, 8, 4096),
}


def build(shape, seed: int = 0):
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, layers, heads, kv, vocab = shape
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                               tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     lora_dropout=0.0))


def base_bytes_per_param(model, host: dict) -> float:
    if host["quantized_numel"]:
        return host["constant_buffers"] / host["quantized_numel"]
    frozen = [m.weight for m in model.hf_model.modules()
              if type(m) is torch.nn.Linear and not m.weight.requires_grad and m.weight.shape[0] != host["vocab"]]
    return sum(w.nbytes for w in frozen) / sum(w.numel() for w in frozen)


@contextlib.contextmanager
def per_product(enabled: bool):
    """With `enabled`: the keep bypassed, so every product dequantizes afresh (the engine before the keep)."""
    get = DequantKeep.get
    if enabled:
        DequantKeep.get = lambda self, key, make: make()
    try:
        yield
    finally:
        DequantKeep.get = get


@contextlib.contextmanager
def counting_dequantize(calls: list[int]):
    """Counts QuantLinear's dequantizations (calls[0]) while entered."""
    original = quant_linear.dequantize

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    quant_linear.dequantize = counted
    try:
        yield
    finally:
        quant_linear.dequantize = original


class Variant:
    """One wrapped model of the comparison: set up (first call, traced call) now, timed step by step later, so
    that the variants' timed steps interleave and share whatever else the machine is doing."""

    def __init__(self, name: str, shape, quantize: str | None, batch: int, seq: int, keep: bool = True):
        self.name, self.keep, self.tokens, self.vocab = name, keep, batch * seq, shape[-1]
        ids = torch.randint(0, self.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = model = rp.hf.wrap(build(shape), devices=["cpu", "cpu"], compute_dtype=torch.bfloat16,
                                            quantize=quantize)
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step():
            model.forward_backward(input_ids=ids, labels=ids)
            model.step(opt, asynchronous=False)
        self.step, self.times, self.calls = step, [], [0]
        with per_product(not keep):
            step()   # the plan's first call (profiling) and the arena's growth
            with model.record_trace() as trace, counting_dequantize(self.calls):
                step()
        self.upload = sum(e.args["bytes"] for e in trace.events if e.cat == "copy" and e.worker.endswith("param_up"))

    def timed_step(self) -> None:
        with per_product(not self.keep):
            t0 = time.perf_counter()
            self.step()
            self.model.synchronize()
            self.times.append(time.perf_counter() - t0)

    def row(self) -> dict:
        model = self.model
        host = model.memory_stats()["host"]
        host["vocab"] = self.vocab
        state = sum(host[k] for k in ("masters", "upload_copies", "constant_buffers", "buffers", "grads",
                                      "grads_held", "grad_landing"))
        quantized = [m.quant_state for m in model.hf_model.modules() if isinstance(m, QuantLinear)]
        per_weight = self.calls[0] / len(quantized) if quantized else 0.0   # dequantizations a weight, an iteration
        dequant = (per_weight * median_time(lambda: [dequantize(s, torch.bfloat16) for s in quantized], warmup=1,
                                            repeat=3) if quantized else 0.0)
        row = {"base": self.name, "base B/param": base_bytes_per_param(model, host), "host state MB": state / 1e6,
               "upload MB/iter": self.upload / 1e6, "tokens/s": self.tokens / statistics.median(self.times),
               "tokens/s best": self.tokens / min(self.times),
               "dequant ms/iter": dequant * 1e3, "dequant/weight/iter": per_weight, "plan": repr(model.plan),
               "timed steps": len(self.times)}
        model.close()
        self.model = None
        gc.collect()
        return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args(argv)
    shape = SHAPES["quick" if args.quick else "full"]
    batch, seq, steps = (4, 128, 15) if args.quick else (8, 256, 9)
    hidden, inter, layers, heads, kv, vocab = shape
    report = Report("qlora", columns=["base", "base B/param", "host state MB", "upload MB/iter", "tokens/s",
                                      "tokens/s best", "dequant/weight/iter", "dequant ms/iter"])
    variants = (("bf16", None, True), ("nf4 per product", "nf4", False), ("nf4", "nf4", True))
    models = [Variant(name, shape, q, batch, seq, keep) for name, q, keep in variants]
    for _ in range(steps):   # interleaved: a load spike on the shared machine hits every variant alike
        for v in models:
            v.timed_step()
    rows = [report.add(**v.row()) for v in models]
    for row in rows:
        row.update(model=f"llama h{hidden} i{inter} L{layers} V{vocab}, LoRA r16 all-linear", batch=batch, seq=seq,
                   workers="cpu,cpu", compute="bf16")
    bf16, before, nf4 = rows
    report.note(f"Llama-shaped h{hidden} i{inter} L{layers} V{vocab}, LoRA r16 on every decoder Linear, "
                f"{batch} x {seq} tokens, 2 CPU workers, bf16 compute, synchronous AdamW")
    report.note("nf4 / bf16: base bytes/param {:.3f}, host state {:.3f}, upload bytes/iter {:.3f}, tokens/s {:.3f}".format(
        nf4["base B/param"] / bf16["base B/param"], nf4["host state MB"] / bf16["host state MB"],
        nf4["upload MB/iter"] / bf16["upload MB/iter"], nf4["tokens/s"] / bf16["tokens/s"]))
    report.note("nf4 once per stage run / per product: tokens/s {:.3f} (best {:.3f}), dequantizations {:.3f}".format(
        nf4["tokens/s"] / before["tokens/s"], nf4["tokens/s best"] / before["tokens/s best"],
        nf4["dequant/weight/iter"] / before["dequant/weight/iter"]))
    for row in (before, nf4):
        step_ms = batch * seq / row["tokens/s"] * 1e3
        report.note(f"CPU dequantization ({row['base']}): {row['dequant ms/iter']:.0f} ms of the iteration's "
                    f"{step_ms:.0f} ms ({row['dequant ms/iter'] / step_ms:.0%})")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
