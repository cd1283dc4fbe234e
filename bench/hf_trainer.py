"""rp.hf.Trainer against a hand-written forward_backward / step loop: what the Trainer costs.

The same ~30M-parameter Qwen3-shaped model (random weights, hidden 512, 8 layers, vocab 32,000),
the same batches (4 x 256 tokens, two accumulation steps), AdamW with clipping and a linear
schedule, 2 CPU workers, synchronous steps; each provider in a fresh model, interleaved over
rounds so load from other processes hits both alike.  Goal (issue 30): the Trainer within 1.05x
of the loop's time per optimizer step.

    python bench/hf_trainer.py [--quick] [--out DIR_OR_FILE] [--no-save]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

from roundpipe.bench.runner import Report, add_common_args


def _model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3", hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                               tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def _rows(n: int, seq: int, vocab: int = 32000) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": ids.clone()})
    return out


def run_trainer(steps: int, batch: int, accum: int, seq: int) -> list[float]:
    """Seconds per optimizer step of rp.hf.Trainer (the first step left out: planning and warm-up)."""
    from transformers import TrainerCallback, TrainingArguments

    import roundpipe as rp

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                                 max_steps=steps, learning_rate=1e-4, max_grad_norm=1.0, lr_scheduler_type="linear",
                                 logging_steps=10**9, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                                 dataloader_num_workers=0, optim="adamw_torch_fused")
        trainer = rp.hf.Trainer(model=_model(), args=args, train_dataset=_rows(steps * batch * accum, seq),
                                devices=["cpu", "cpu"], callbacks=[Clock()])
        trainer.train()
        trainer.rp_model.close()
    return times[1:]


def run_loop(steps: int, batch: int, accum: int, seq: int) -> list[float]:
    """Seconds per optimizer step of the hand loop: forward_backward per accumulation step, one step()."""
    import roundpipe as rp
    rows = _rows(steps * batch * accum, seq)
    times = []
    with rp.hf.wrap(_model(), devices=["cpu", "cpu"]) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
        for s in range(steps):
            t0 = time.perf_counter()
            for a in range(accum):
                part = rows[(s * accum + a) * batch:(s * accum + a + 1) * batch]
                ids = torch.stack([r["input_ids"] for r in part])
                model.forward_backward(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                                       num_items_in_batch=ids.numel() * accum)
            model.step(opt, lr_scheduler=sched, max_grad_norm=1.0, asynchronous=False)
            times.append(time.perf_counter() - t0)
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/hf_trainer.py", description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    args = parser.parse_args(argv)
    steps, rounds = (6, 1) if args.quick else (20, 3)
    batch, accum, seq = 4, 2, 256
    periods: dict[str, list[float]] = {"hand loop": [], "rp.hf.Trainer": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            periods["hand loop"] += run_loop(steps, batch, accum, seq)
            periods["rp.hf.Trainer"] += run_trainer(steps, batch, accum, seq)
    report = Report("hf_trainer", columns=["provider", "steps", "median s/step", "best s/step",
                                           "vs loop (median)", "vs loop (best)"], device="cpu")
    ref = periods["hand loop"]
    for name, values in periods.items():
        report.add(provider=name, steps=len(values), **{
            "median s/step": statistics.median(values), "best s/step": min(values),
            "vs loop (median)": statistics.median(values) / statistics.median(ref),
            "vs loop (best)": min(values) / min(ref)})
    report.note(f"Qwen3-shaped {sum(p.numel() for p in _model().parameters()) / 1e6:.1f}M parameters, "
                f"{batch} x {seq} tokens x {accum} accumulation steps per optimizer step, 2 CPU workers, "
                f"synchronous, {torch.get_num_threads()} torch threads; goal: Trainer <= 1.05x the loop")
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
