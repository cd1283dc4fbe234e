"""Does the asynchronous step learn as well as the synchronous one, and do 8-bit states and bf16 masters?

The `roundpipe train` default model (the byte-level decoder on the standard library's
sources, one CPU worker) trained for a fixed number of steps, for a few peak learning
rates and three seeds each (the seed sets the initial weights and the batches), in the
variants of one comparison (--compare):

  modes (default): the optimizer step, fp32 AdamW throughout
    sync          step(asynchronous=False): exactly plain PyTorch's training
    async         step(asynchronous=True): every update one step stale
    async+pred    async with rp.StalenessCompensation(predict=ALPHA): workers read the
                  predicted weights w + alpha (w - w_prev) (docs/staleness.md)

  optim: the optimizer state and the masters, every run synchronous (issue 29)
    adamw         rp.optim.AdamW, fp32 masters
    adamw8bit     rp.optim.AdamW8bit (moments in 8-bit blocks), fp32 masters
    8bit+bf16sr   AdamW8bit, bf16 masters rounded stochastically
                  (RoundPipe(master_dtype=torch.bfloat16, master_rounding="stochastic"))
    8bit+bf16rn   the same, rounded to nearest: updates under half a bf16 ulp are lost

With --hf, also a tiny Llama-shaped Hugging Face model (byte vocabulary, built from a
config: no download) wrapped by rp.hf.wrap, at one learning rate, with a constant rate.
Prints per (variant, lr) the final held-out loss (mean and spread over the seeds) and the
ratio to the comparison's first variant; writes a PNG of the training-loss curves (mean
over seeds, smoothed) and the table.

    python bench/convergence.py [--compare modes|optim] [--steps 150] [--lrs 3e-3,1e-2,3e-2]
                                [--seeds 3] [--alpha 1.0] [--png FILE] [--out FILE] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, NamedTuple

import torch

import roundpipe as rp
from roundpipe.commands.data import ByteCorpus
from roundpipe.commands.train import TrainConfig, evaluate
from roundpipe.commands.train_loops import DTYPES, OPTIMIZERS, lr_at, make_optimizer
from roundpipe.models.tiny_decoder import build_layers, loss_fn

ROOT = Path(__file__).resolve().parents[1]


class Variant(NamedTuple):
    """One trained configuration: the optimizer step's mode, the optimizer and the masters."""

    asynchronous: bool = False
    predict: bool = False                         # staleness compensation with --alpha
    optim: Literal["adamw", "adamw8bit", "bnb-adamw8bit"] = "adamw"   # bnb-: bitsandbytes' own, the peer
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    rounding: Literal["stochastic", "nearest"] = "stochastic"   # of bf16 masters


COMPARISONS = {
    "modes": {"sync": Variant(), "async": Variant(asynchronous=True),
              "async+pred": Variant(asynchronous=True, predict=True)},
    "optim": {"adamw": Variant(), "adamw8bit": Variant(optim="adamw8bit"),
              "8bit+bf16sr": Variant(optim="adamw8bit", master_dtype="bf16", rounding="stochastic"),
              "8bit+bf16rn": Variant(optim="adamw8bit", master_dtype="bf16", rounding="nearest")},
    # ours against bitsandbytes' CPU AdamW8bit (same groups, betas, eps, decay; a torch optimizer, so its
    # step takes RoundPipe's routed path): is a gap to fp32 AdamW the 8-bit format's or our kernel's?
    "peer": {"adamw": Variant(), "adamw8bit": Variant(optim="adamw8bit"),
             "bnb-adamw8bit": Variant(optim="bnb-adamw8bit")},
}


def optimizer_class(optim: str) -> type:
    """rp.optim's AdamW / AdamW8bit, or bitsandbytes' AdamW8bit (a [dev] dependency) for the peer variant."""
    if optim == "bnb-adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit
    return OPTIMIZERS[optim]


def build_optimizer(model, cfg: TrainConfig, optim: str) -> torch.optim.Optimizer:
    """make_optimizer's groups (matrices decay, the rest not) and hyperparameters, in `optim`'s class."""
    groups = make_optimizer(model.named_parameters(), cfg.lr, cfg.weight_decay).param_groups
    return optimizer_class(optim)([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                  lr=cfg.lr, betas=groups[0]["betas"], eps=groups[0]["eps"])


def train_decoder(cfg: TrainConfig, rounding: str, corpus: ByteCorpus, optim: str) -> tuple[list[float], float]:
    """roundpipe.commands.train.train's run (its layers, optimizer, schedule, batches and held-out
    batches) on a RoundPipe built with master_rounding=, which TrainConfig does not carry."""
    cfg = cfg.resolved()
    layers = build_layers(cfg.model_config(), seed=cfg.seed)
    comp = None if cfg.compensation is None else rp.StalenessCompensation(cfg.compensation)
    losses = []
    with rp.RoundPipe(layers, devices=cfg.devices, compensation=comp, master_dtype=DTYPES[cfg.master_dtype],
                      master_rounding=rounding) as model:
        opt = build_optimizer(model, cfg, optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
        # train() evaluates before its first step; without it the losses differ in the 7th digit
        # (measured), with it they equal train()'s bit for bit
        evaluate(model, corpus, cfg)
        for x, y in corpus.batches(cfg.batch_size, cfg.seq_len, seed=cfg.seed, steps=cfg.steps):
            losses.append(float(model.forward_backward(x, labels=y, loss_fn=loss_fn)))
            model.step(opt, lr_scheduler=schedule, asynchronous=cfg.asynchronous)
        model.synchronize()
        return losses, evaluate(model, corpus, cfg)


def run_all(variants: dict[str, Variant], steps: int, lrs: list[float], seeds: int, alpha: float, batch: int,
            seq: int) -> dict:
    """The default decoder in each variant; (variant, lr, seed) -> (losses, held-out loss)."""
    corpus = ByteCorpus.load(None)
    out = {}
    for lr in lrs:
        for name, v in variants.items():
            for seed in range(seeds):
                t0 = time.perf_counter()
                cfg = TrainConfig(steps=steps, lr=lr, seed=seed, batch_size=batch, seq_len=seq, eval_batches=4,
                                  devices=["cpu"], progress=False, asynchronous=v.asynchronous,
                                  compensation=alpha if v.predict else None,
                                  optim="adamw" if v.optim.startswith("bnb") else v.optim,
                                  master_dtype=v.master_dtype)
                out[(name, lr, seed)] = train_decoder(cfg, v.rounding, corpus, v.optim)
                print(f"  {name:12s} lr {lr:g} seed {seed}: held-out {out[(name, lr, seed)][1]:.4f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return out


def run_hf(variants: dict[str, Variant], steps: int, lr: float, seeds: int, alpha: float, batch: int,
           seq: int) -> dict:
    """The tiny HF decoder through rp.hf.wrap in each variant; (variant, lr, seed) -> (losses, held-out loss)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    corpus = ByteCorpus.load(None)
    val = list(corpus.batches(batch, seq, seed=10_000, split="val", steps=4))
    out = {}
    for name, v in variants.items():
        for seed in range(seeds):
            torch.manual_seed(seed)
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
                "llama", vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                tie_word_embeddings=False)).float()
            comp = rp.StalenessCompensation(alpha) if v.predict else None
            losses = []
            with rp.hf.wrap(hf, devices=["cpu"], compensation=comp, master_dtype=DTYPES[v.master_dtype],
                            master_rounding=v.rounding) as model:
                opt = optimizer_class(v.optim)(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
                for x, _ in corpus.batches(batch, seq, seed=seed, steps=steps):
                    losses.append(float(model.forward_backward(x, labels=x)))
                    model.step(opt, asynchronous=v.asynchronous)
                model.synchronize()
                with torch.no_grad():
                    held = sum(float(torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1).float(),
                                                                         x[:, 1:].flatten())) for x, _ in val) / len(val)
            out[(name, lr, seed)] = (losses, held)
            print(f"  hf {name:12s} lr {lr:g} seed {seed}: held-out {held:.4f}", file=sys.stderr, flush=True)
    return out


def table(results: dict, variants: list[str], lrs: list[float], seeds: int) -> str:
    """Per (lr, variant): held-out loss mean, min..max over seeds, and the mean's ratio to variants[0]'s."""
    base = variants[0]
    lines = [f"{'lr':>8} {'variant':>12} {'held-out end (mean)':>20} {'min..max':>16} {'vs ' + base:>14}"]
    for lr in lrs:
        ref = statistics.mean(results[(base, lr, s)][1] for s in range(seeds))
        for name in variants:
            vals = [results[(name, lr, s)][1] for s in range(seeds)]
            mean = statistics.mean(vals)
            lines.append(f"{lr:>8g} {name:>12} {mean:>20.4f} {min(vals):>7.4f}..{max(vals):<7.4f} "
                         f"{mean / ref:>14.3f}")
    return "\n".join(lines)


def smooth(xs: list[float], k: int = 9) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(results: dict, variants: list[str], lrs: list[float], seeds: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.6), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for name in variants:
            curves = [results[(name, lr, s)][0] for s in range(seeds)]
            mean = [statistics.mean(v) for v in zip(*curves)]
            ax.plot(smooth(mean), label=name)
        ax.set_title(f"peak lr {lr:g}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (nats/byte, mean of seeds)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="modes",
                   help="modes: sync / async / async+pred (default); optim: fp32 AdamW / AdamW8bit / AdamW8bit "
                        "with bf16 masters rounded stochastically or to nearest, all synchronous; peer: fp32 "
                        "AdamW / AdamW8bit / bitsandbytes' AdamW8bit")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--alpha", type=float, default=1.0, help="async+pred's prediction factor (--compare modes)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--png", default=None)
    p.add_argument("--out", default=None, help="also write the table and the command to this file")
    p.add_argument("--quick", action="store_true", help="20 steps, one lr, two seeds (a smoke run)")
    p.add_argument("--no-decoder", action="store_true", help="skip the default decoder (with --hf: only the HF model)")
    p.add_argument("--hf", type=float, default=None, metavar="LR",
                   help="also train the tiny HF model at this learning rate (transformers installed)")
    a = p.parse_args(argv)
    try:
        a.lrs = [float(x) for x in a.lrs.split(",")]
    except ValueError:
        p.error(f"--lrs={a.lrs!r} must be comma-separated numbers like 3e-3,1e-2")
    for name, value in (("--steps", a.steps), ("--seeds", a.seeds), ("--batch-size", a.batch_size),
                        ("--seq-len", a.seq_len)):
        if value < 1:
            p.error(f"{name}={value} must be >= 1")
    if a.no_decoder and a.hf is None:
        p.error("--no-decoder leaves nothing to train without --hf LR")
    if a.quick:
        a.steps, a.seeds, a.lrs = 20, 2, a.lrs[:1]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    variants = COMPARISONS[a.compare]
    names = list(variants)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    results = {} if a.no_decoder else run_all(variants, a.steps, a.lrs, a.seeds, a.alpha, a.batch_size, a.seq_len)
    hf = run_hf(variants, a.steps, a.hf, a.seeds, a.alpha, a.batch_size, a.seq_len) if a.hf is not None else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    setting = f"alpha {a.alpha}" if a.compare == "modes" else "synchronous step"
    text = (f"bench/convergence.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
            f"{datetime.date.today()}, commit {commit}, {cpu}, torch {torch.__version__}\n"
            f"{a.steps} steps x {a.batch_size} x {a.seq_len} bytes, one CPU worker, fp32 compute, {setting}, "
            f"{a.seeds} seeds; {time.perf_counter() - t0:.0f} s\n")
    if results:
        text += "\nroundpipe train's default decoder, warmup + cosine schedule:\n" + table(results, names, a.lrs, a.seeds)
    if hf is not None:
        text += ("\n" * bool(results) + "\ntiny HF Llama (4 layers, hidden 64, byte vocabulary) through rp.hf.wrap, "
                 "constant lr:\n" + table(hf, names, [a.hf], a.seeds))
    print(text)
    if a.png:
        if results:
            plot(results, names, a.lrs, a.seeds, a.png)
        if hf is not None:
            plot(hf, names, [a.hf], a.seeds, a.png.replace(".png", "-hf.png"))
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
