"""Does the asynchronous step learn as well as the synchronous one, and does staleness compensation help?

The `roundpipe train` default model (the byte-level decoder on the standard library's
sources, one CPU worker) trained for a fixed number of steps in three modes:

    sync         step(asynchronous=False): exactly plain PyTorch's training
    async        step(asynchronous=True): every update one step stale
    async+pred   async with rp.StalenessCompensation(predict=ALPHA): workers read the
                 predicted weights w + alpha (w - w_prev) (docs/staleness.md)

for a few peak learning rates and three seeds each (the seed sets the initial weights and
the batches).  With --hf, also a tiny Llama-shaped Hugging Face model (byte vocabulary,
built from a config: no download) wrapped by rp.hf.wrap, at one learning rate, with a
constant rate and AdamW.  Prints per (mode, lr) the final held-out loss (mean and spread
over the seeds) and the ratio to sync; writes a PNG of the training-loss curves (mean over
seeds, smoothed) and the table.

    python bench/convergence.py [--steps 150] [--lrs 3e-3,1e-2,3e-2] [--seeds 3] [--alpha 1.0]
                                [--png FILE] [--out FILE] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from roundpipe.commands.data import ByteCorpus
from roundpipe.commands.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": dict(asynchronous=False), "async": dict(asynchronous=True),
         "async+pred": dict(asynchronous=True, compensation=None)}   # alpha filled in from --alpha


def run_all(steps: int, lrs: list[float], seeds: int, alpha: float, batch: int, seq: int) -> dict:
    corpus = ByteCorpus.load(None)
    out = {}
    for lr in lrs:
        for mode, kw in MODES.items():
            kw = dict(kw, compensation=alpha) if mode == "async+pred" else kw
            for seed in range(seeds):
                t0 = time.perf_counter()
                r = train(TrainConfig(steps=steps, lr=lr, seed=seed, batch_size=batch, seq_len=seq, eval_batches=4,
                                      devices=["cpu"], progress=False, **kw), corpus)
                out[(mode, lr, seed)] = (r.losses, r.val_end)
                print(f"  {mode:10s} lr {lr:g} seed {seed}: held-out {r.val_end:.4f} ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
    return out


def run_hf(steps: int, lr: float, seeds: int, alpha: float, batch: int, seq: int) -> dict:
    """The tiny HF decoder through rp.hf.wrap in each mode; (mode, lr, seed) -> (losses, held-out loss)."""
    import roundpipe as rp
    from transformers import AutoConfig, AutoModelForCausalLM
    corpus = ByteCorpus.load(None)
    val = list(corpus.batches(batch, seq, seed=10_000, split="val", steps=4))
    out = {}
    for mode in MODES:
        for seed in range(seeds):
            torch.manual_seed(seed)
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
                "llama", vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                tie_word_embeddings=False)).float()
            comp = rp.StalenessCompensation(alpha) if mode == "async+pred" else None
            losses = []
            with rp.hf.wrap(hf, devices=["cpu"], compensation=comp) as model:
                opt = rp.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
                for x, _ in corpus.batches(batch, seq, seed=seed, steps=steps):
                    losses.append(float(model.forward_backward(x, labels=x)))
                    model.step(opt, asynchronous=mode != "sync")
                model.synchronize()
                with torch.no_grad():
                    held = sum(float(torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1),
                                                                         x[:, 1:].flatten())) for x, _ in val) / len(val)
            out[(mode, lr, seed)] = (losses, held)
            print(f"  hf {mode:10s} lr {lr:g} seed {seed}: held-out {held:.4f}", file=sys.stderr, flush=True)
    return out


def table(results: dict, lrs: list[float], seeds: int) -> str:
    lines = [f"{'lr':>8} {'mode':>11} {'held-out end (mean)':>20} {'min..max':>16} {'vs sync':>8}"]
    for lr in lrs:
        sync = statistics.mean(results[("sync", lr, s)][1] for s in range(seeds))
        for mode in MODES:
            vals = [results[(mode, lr, s)][1] for s in range(seeds)]
            mean = statistics.mean(vals)
            lines.append(f"{lr:>8g} {mode:>11} {mean:>20.4f} {min(vals):>7.4f}..{max(vals):<7.4f} "
                         f"{mean / sync:>8.3f}")
    return "\n".join(lines)


def smooth(xs: list[float], k: int = 9) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(results: dict, lrs: list[float], seeds: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.6), sharey=True)
    for ax, lr in zip(axes if len(lrs) > 1 else [axes], lrs):
        for mode in MODES:
            curves = [results[(mode, lr, s)][0] for s in range(seeds)]
            mean = [statistics.mean(v) for v in zip(*curves)]
            ax.plot(smooth(mean), label=mode)
        ax.set_title(f"peak lr {lr:g}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    (axes[0] if len(lrs) > 1 else axes).set_ylabel("training loss (nats/byte, mean of seeds)")
    (axes[0] if len(lrs) > 1 else axes).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--png", default=None)
    p.add_argument("--out", default=None, help="also write the table and the command to this file")
    p.add_argument("--quick", action="store_true", help="20 steps, one lr, two seeds (a smoke run)")
    p.add_argument("--no-decoder", action="store_true", help="skip the default decoder (with --hf: only the HF model)")
    p.add_argument("--hf", type=float, default=None, metavar="LR",
                   help="also train the tiny HF model at this learning rate (transformers installed)")
    a = p.parse_args(argv)
    lrs = [float(x) for x in a.lrs.split(",")]
    steps, seeds = a.steps, a.seeds
    if a.quick:
        steps, seeds, lrs = 20, 2, lrs[:1]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    results = {} if a.no_decoder else run_all(steps, lrs, seeds, a.alpha, a.batch_size, a.seq_len)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    hf = run_hf(steps, a.hf, seeds, a.alpha, a.batch_size, a.seq_len) if a.hf is not None else None
    head = (f"bench/convergence.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
            f"{datetime.date.today()}, commit {commit}, {cpu}, torch {torch.__version__}\n"
            f"{steps} steps x {a.batch_size} x {a.seq_len} bytes, one CPU worker, alpha {a.alpha}, {seeds} seeds; "
            f"{time.perf_counter() - t0:.0f} s\n")
    text = head
    if not a.no_decoder:
        text += "\nroundpipe train's default decoder, warmup + cosine schedule:\n" + table(results, lrs, seeds)
    if hf is not None:
        text += ("\ntiny HF Llama (4 layers, hidden 64, byte vocabulary) through rp.hf.wrap, constant lr:\n"
                 + table(hf, [a.hf], seeds))
    print(text)
    if a.png:
        if results:
            plot(results, lrs, seeds, a.png)
        if hf is not None:
            plot(hf, [a.hf], seeds, a.png.replace(".png", "-hf.png"))
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
