"""`roundpipe train`: train the built-in byte-level decoder on the standard library's sources.

The main job of the package: no downloads, no configuration.  It builds the
decoder of roundpipe.models.tiny_decoder as a list of layers, wraps it in
`rp.RoundPipe` (GPU workers when there are GPUs, otherwise CPU workers), draws
seeded next-byte batches from roundpipe.commands.data and runs AdamW, with a tqdm bar
showing the loss and tokens/s.  It ends by printing the training loss at the start
and at the end and the held-out loss before and after, so a run shows whether the
model learned.  `--engine torch` runs the same model, data and optimizer as a
plain PyTorch loop on one device: the reference for correctness and speed.

    roundpipe train                          # tiny model on CPU workers, ~1 minute on 2 cores
    roundpipe train --size 0.8b --steps 50   # tokens/s of a 0.8B decoder on the GPUs
    python -c "from roundpipe.commands.train import TrainConfig, train; print(train(TrainConfig(steps=20)))"
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from roundpipe.commands.data import ByteCorpus
from roundpipe.commands.train_loops import DTYPES, OPTIMIZERS, lr_at, make_engine, make_optimizer
from roundpipe.core.checks import is_int
from roundpipe.models.tiny_decoder import PRESETS, DecoderConfig, build_layers, loss_fn
from roundpipe.workers import parse_devices

ENGINES = ("roundpipe", "torch")


@dataclass
class TrainConfig:
    """One training run.  None means "pick for the machine" (GPU or CPU) where noted."""

    size: str | None = None              # preset; None: "tiny" on CPU, "small" with GPUs
    layers: int | None = None            # overrides of the preset's shape
    hidden: int | None = None
    heads: int | None = None
    steps: int = 300
    batch_size: int | None = None        # sequences per step; None: 16 on CPU, 32 with GPUs
    seq_len: int | None = None           # bytes per sequence; None: 128 on CPU, 1024 with GPUs
    microbatches: int | None = None      # None: the engine's default (workers + 1)
    devices: list[str] | None = None     # None: every GPU, else one CPU worker
    lr: float | None = None              # peak lr; None: 3e-3, or 3e-4 above hidden 512 (default_lr)
    weight_decay: float = 0.1
    optim: Literal["adamw", "adamw8bit"] = "adamw"   # adamw8bit: moments in 8-bit blocks (rp.optim.AdamW8bit)
    warmup: int | None = None            # linear warmup steps; None: 10% of steps, at most 50
    data_dir: str | None = None          # None: the standard library's *.py files
    seed: int = 0
    asynchronous: bool | None = None     # one-step-stale optimizer step; None: with GPUs only (below)
    engine: Literal["roundpipe", "torch"] = "roundpipe"
    dtype: Literal["fp32", "bf16", "fp16"] | None = None  # compute dtype; None: bf16 on CUDA, fp32 on CPU
    master_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: masters updated in fp32, rounded stochastically
    device_step: bool = False            # one worker keeps and updates the layers' masters and state (synchronous)
    eval_batches: int = 4                # held-out batches evaluated before and after training
    trace: str | None = None             # write a Chrome trace of the run here
    progress: bool = True
    hf: str | None = None                # fine-tune this local HF checkpoint instead (roundpipe/commands/train_hf.py)
    max_grad_norm: float | None = None   # clip the global gradient norm (model.step(max_grad_norm=))
    checkpoint: str | None = None        # save a checkpoint here at the end (and every checkpoint_every steps;
                                         # "{step}" in it becomes the step number)
    checkpoint_every: int | None = None
    resume: str | None = None            # continue from this checkpoint (bitwise as if never stopped)
    compensation: float | None = None    # asynchronous step: upload w + alpha (w - w_prev) (StalenessCompensation)
    lora: int | None = None              # with hf: train a LoRA adapter of this rank (peft), the base frozen
    quantize: Literal["nf4", "fp4"] | None = None   # with hf and lora: the frozen base 4-bit (roundpipe/hf/quantize.py)

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "microbatches", "layers", "hidden", "heads", "warmup",
                     "checkpoint_every", "lora"):
            value = getattr(self, name)
            if value is None and name != "steps":
                continue
            lowest = 0 if name == "warmup" else 1
            if not is_int(value) or value < lowest:
                raise ValueError(f"{name}={value!r} must be an int >= {lowest}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float))
                                                   and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be None or a finite number > 0")
        if (self.checkpoint is not None or self.resume is not None) and self.engine != "roundpipe":
            raise ValueError("checkpoint/resume need engine='roundpipe' (RoundPipe.save_checkpoint/load_checkpoint)")
        if self.compensation is not None and not (isinstance(self.compensation, (int, float))
                                                  and math.isfinite(self.compensation) and self.compensation >= 0):
            raise ValueError(f"compensation={self.compensation!r} must be None or a finite number >= 0")
        if self.compensation is not None and self.engine != "roundpipe":
            raise ValueError("compensation needs engine='roundpipe' (it acts on the asynchronous step)")
        if self.quantize not in (None, "nf4", "fp4"):
            raise ValueError(f"quantize={self.quantize!r} must be None, 'nf4' or 'fp4'")
        for name in ("lora", "quantize"):
            if getattr(self, name) is not None and self.hf is None:
                raise ValueError(f"{name}={getattr(self, name)!r} needs hf (a Hugging Face checkpoint to fine-tune)")
        if self.quantize is not None and self.lora is None:
            raise ValueError(f"quantize={self.quantize!r} stores the frozen base 4-bit under a LoRA adapter: "
                             "give lora (its rank) too")
        if self.checkpoint_every is not None and self.checkpoint is None:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} needs checkpoint (the directory to write)")
        if not isinstance(self.eval_batches, int) or self.eval_batches < 0:
            raise ValueError(f"eval_batches={self.eval_batches!r} must be an int >= 0")
        if self.size is not None and self.size not in PRESETS:
            raise ValueError(f"size={self.size!r} is not a preset; choose one of {sorted(PRESETS)}")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} must be None or a finite number > 0")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay={self.weight_decay!r} must be a number >= 0")
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"optim={self.optim!r} must be one of {sorted(OPTIMIZERS)}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} must be one of {ENGINES}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)} or None")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"master_dtype={self.master_dtype!r} must be one of {list(MASTER_DTYPES)}")
        if self.master_dtype != "fp32" and self.engine == "torch":
            raise ValueError(f"master_dtype={self.master_dtype!r} needs engine='roundpipe' (the torch reference keeps "
                             "fp32 weights)")
        if self.devices is not None:
            if isinstance(self.devices, str) or not self.devices or not all(isinstance(d, str) and d for d in self.devices):
                raise ValueError(f"devices={self.devices!r} must be a non-empty list of device names like 'cpu' or 'cuda:0'")
            self.devices = list(self.devices)
            if self.engine == "torch" and len(self.devices) != 1:
                raise ValueError(f"devices={self.devices!r}: engine='torch' runs on exactly one device")
        if self.asynchronous not in (None, True, False):
            raise ValueError(f"asynchronous={self.asynchronous!r} must be True, False or None")
        if not isinstance(self.device_step, bool):
            raise ValueError(f"device_step={self.device_step!r} must be True or False")
        if self.device_step and (self.engine != "roundpipe" or self.asynchronous or self.master_dtype != "fp32"
                                 or (self.devices is not None and len(self.devices) != 1)):
            raise ValueError("device_step=True needs engine='roundpipe', the synchronous step, master_dtype='fp32' and "
                             f"one device (got engine={self.engine!r}, asynchronous={self.asynchronous!r}, "
                             f"master_dtype={self.master_dtype!r}, devices={self.devices!r})")
        if self.engine == "torch" and self.asynchronous:
            raise ValueError("asynchronous=True needs engine='roundpipe' (the torch reference steps synchronously)")
        if self.engine == "torch" and self.microbatches not in (None, 1):
            raise ValueError(f"microbatches={self.microbatches}: engine='torch' runs the whole batch at once")
        if self.batch_size is not None and self.microbatches is not None and self.microbatches > self.batch_size:
            raise ValueError(f"microbatches={self.microbatches} must be <= batch_size={self.batch_size}")
        self.model_config()  # the model's shape is checked here, not after the data is loaded

    @property
    def uses_cuda(self) -> bool:
        if self.devices is not None:
            return any(d.startswith("cuda") for d in self.devices)
        return torch.cuda.is_available()

    def model_config(self) -> DecoderConfig:
        base = PRESETS[self.size or ("small" if self.uses_cuda else "tiny")]
        shape = {k: getattr(self, k) for k in ("layers", "hidden", "heads") if getattr(self, k) is not None}
        if "hidden" in shape and "heads" not in shape:
            shape["heads"] = max(1, shape["hidden"] // 64) if shape["hidden"] % 64 == 0 else base.heads
        return DecoderConfig(**{**{k: getattr(base, k) for k in ("vocab_size", "hidden", "layers", "heads")},
                                **shape})

    def resolved(self) -> "TrainConfig":
        """A copy with every None that has a machine-dependent default filled in."""
        cuda = self.uses_cuda
        out = TrainConfig(**{**self.__dict__})
        out.batch_size = self.batch_size or (32 if cuda else 16)
        out.seq_len = self.seq_len or (1024 if cuda else 128)
        out.warmup = self.warmup if self.warmup is not None else min(50, self.steps // 10)
        out.lr = self.lr if self.lr is not None else default_lr(None if self.hf else self.model_config())
        # The asynchronous step pays off when the CPU optimizer overlaps GPU compute.  CPU
        # workers share the cores with the optimizer: bench/dispatch.py saw no consistent
        # gain (tiny decoder, one worker, 2-core Xeon, three runs: async 8,686-8,846 tokens/s,
        # sync 8,534-9,204), while the one-step staleness cost learning (default run,
        # 300 steps: end loss 2.56 async vs 1.88 sync).
        if self.asynchronous is None:
            out.asynchronous = cuda and self.engine == "roundpipe" and not self.device_step
        if self.devices is None:
            out.devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
            if self.engine == "torch" or self.device_step:
                out.devices = out.devices[:1]
        parse_devices(out.devices)  # unknown names, or CUDA where there is none: ValueError now
        out.__post_init__()
        return out


@dataclass
class TrainResult:
    losses: list[float]                  # training loss of every step
    val_start: float | None              # held-out loss before the first step
    val_end: float | None                # held-out loss after the last step
    tokens: int
    seconds: float                       # wall time of the training steps (no evaluation)
    num_parameters: int
    devices: list[str] = field(default_factory=list)
    loss_scale: float | None = None      # fp16: the dynamic loss scale at the end

    @property
    def start_loss(self) -> float:
        return self.losses[0]

    @property
    def end_loss(self) -> float:
        """Mean of the last steps (up to 10): one step's loss is too noisy to compare."""
        tail = self.losses[-min(10, len(self.losses)):]
        return sum(tail) / len(tail)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def default_lr(model: DecoderConfig | None) -> float:
    """3e-3, the rate the tiny and small decoders (and --hf fine-tuning) were tuned at; 3e-4 for the
    decoder above hidden 512.  At 3e-3 the 0.8b preset diverges with plain PyTorch too (H200,
    2026-11-26, bench/results/gpu-2026-11-26: 6.24 -> 16 nats/byte by step 4), at 3e-4 it learns."""
    return 3e-3 if model is None or model.hidden <= 512 else 3e-4


MASTER_DTYPES = ("fp32", "bf16")


def evaluate(model, corpus: ByteCorpus, cfg: TrainConfig) -> float | None:
    """Mean loss of `cfg.eval_batches` fixed held-out batches (forward only)."""
    if cfg.eval_batches == 0:
        return None
    total = 0.0
    with torch.no_grad():
        for x, y in corpus.batches(cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1, split="val", steps=cfg.eval_batches):
            total += float(loss_fn(model(x).cpu(), y))
    return total / cfg.eval_batches


def train(cfg: TrainConfig, corpus: ByteCorpus | None = None) -> TrainResult:
    """Runs `cfg.steps` optimizer steps and returns the losses; the function behind `roundpipe train`."""
    from tqdm.auto import tqdm

    cfg = cfg.resolved()
    corpus = corpus if corpus is not None else ByteCorpus.load(cfg.data_dir)
    model_cfg = cfg.model_config()
    layers = build_layers(model_cfg, seed=cfg.seed)
    losses: list[float] = []
    with make_engine(layers, cfg) as model:
        optimizer = make_optimizer(model.named_parameters(), cfg.lr, cfg.weight_decay, cfg.optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
        first = 0
        if cfg.resume is not None:   # the model, optimizer, schedule and RNG as they were after step `first`
            first = model.load_checkpoint(cfg.resume, optimizer, schedule)["step"]
            if first >= cfg.steps:
                raise ValueError(f"resume={cfg.resume!r} was saved after step {first}; steps={cfg.steps} leaves "
                                 "nothing to train")
        val_start = evaluate(model, corpus, cfg) if cfg.resume is None else None
        batches = corpus.batches(cfg.batch_size, cfg.seq_len, seed=cfg.seed, steps=cfg.steps)
        bar = tqdm(total=cfg.steps - first, unit="step", disable=not cfg.progress, dynamic_ncols=True, file=sys.stderr)
        start = time.perf_counter()
        for step, (x, y) in enumerate(batches):
            if step < first:   # the batches a resumed run already trained on
                continue
            loss = model.forward_backward(x, labels=y, loss_fn=loss_fn)
            model.step(optimizer, lr_scheduler=schedule, asynchronous=cfg.asynchronous,
                       max_grad_norm=cfg.max_grad_norm)
            losses.append(float(loss))
            if cfg.checkpoint is not None and (step + 1 == cfg.steps or (
                    cfg.checkpoint_every is not None and (step + 1) % cfg.checkpoint_every == 0)):
                model.save_checkpoint(cfg.checkpoint.replace("{step}", str(step + 1)), optimizer, schedule,
                                      extra={"step": step + 1})
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{(step + 1 - first) * x.numel() / elapsed:,.0f}",
                            refresh=False)
            bar.update()
        model.synchronize()
        seconds = time.perf_counter() - start
        bar.close()
        val_end = evaluate(model, corpus, cfg)
        model.save_trace(cfg.trace)
        devices = list(model.devices)
    return TrainResult(losses, val_start, val_end, (cfg.steps - first) * cfg.batch_size * cfg.seq_len, seconds,
                       model_cfg.num_parameters(), devices, model.loss_scale)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roundpipe train", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--size", choices=list(PRESETS), default=None,
                   help="model preset (default: tiny on CPU, small with GPUs); "
                        + ", ".join(f"{k}={v.num_parameters() / 1e6:.1f}M" for k, v in PRESETS.items()))
    m.add_argument("--layers", type=int, default=None, help="decoder blocks (overrides the preset)")
    m.add_argument("--hidden", type=int, default=None, help="hidden width (overrides the preset)")
    m.add_argument("--heads", type=int, default=None, help="attention heads (overrides the preset)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=TrainConfig.steps, help=f"optimizer steps (default {TrainConfig.steps})")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16 on CPU, 32 with GPUs)")
    t.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default 128 on CPU, 1024 with GPUs)")
    t.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate; linear warmup, cosine decay to 10%% "
                   "(default 3e-3; 3e-4 for models wider than 512)")
    t.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay,
                   help=f"AdamW weight decay of the matrices (default {TrainConfig.weight_decay:g})")
    t.add_argument("--optim", choices=sorted(OPTIMIZERS), default=TrainConfig.optim,
                   help="adamw (default), or adamw8bit: its moments in bitsandbytes' 8-bit blocks (~10 instead of "
                        "16 bytes of host memory per parameter)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default 10%% of --steps, at most 50)")
    t.add_argument("--seed", type=int, default=TrainConfig.seed, help="seed of the initial weights and the batches (default 0)")
    t.add_argument("--data-dir", "--data", default=None, help="train on the text files under this folder "
                   "instead of the Python standard library's sources")
    t.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to this")
    t.add_argument("--checkpoint", default=None, metavar="DIR", help="save a checkpoint to DIR at the end "
                   "({step} in DIR becomes the step number)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="and every N steps")
    t.add_argument("--resume", default=None, metavar="DIR", help="continue from the checkpoint in DIR "
                   "(same flags; the result equals an uninterrupted run bit for bit)")
    t.add_argument("--compensation", type=float, default=None, metavar="ALPHA",
                   help="with --async: upload predicted weights w + ALPHA (w - w_prev) (docs/staleness.md)")
    t.add_argument("--eval-batches", type=int, default=TrainConfig.eval_batches,
                   help=f"held-out batches evaluated before and after training, 0 for none (default {TrainConfig.eval_batches})")
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=ENGINES, default="roundpipe",
                   help="roundpipe (default), or torch: a plain PyTorch loop on one device for comparison")
    e.add_argument("--devices", default=None, help="comma-separated workers, e.g. cuda:0,cuda:1 or cpu,cpu "
                   "(default: every GPU, else one CPU worker)")
    e.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: workers + 1)")
    e.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="compute dtype (default bf16 on CUDA, fp32 on CPU)")
    e.add_argument("--master-dtype", choices=MASTER_DTYPES, default="fp32",
                   help="fp32 (default) or bf16 masters: updated in fp32 and rounded stochastically (2 bytes per "
                        "parameter; with --dtype bf16 also the upload copy: ~6 bytes per parameter with adamw8bit)")
    mode = e.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="asynchronous", action="store_true", default=None,
                      help="one-step-stale optimizer step overlapping the next iteration "
                           "(default with GPUs; on CPU workers it shares the cores and gains nothing)")
    mode.add_argument("--sync", dest="asynchronous", action="store_false",
                      help="synchronous optimizer step, equal to --engine torch (default on CPU)")
    e.add_argument("--device-step", action="store_true", help="one worker keeps every layer it has room for (every "
                   "layer on a CPU worker) with its fp32 masters and Adam state, and updates it there: no gradient "
                   "download, no weight upload (synchronous step; docs/semantics.md)")
    e.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome/Perfetto trace of the run")
    h = p.add_argument_group("hugging face")
    h.add_argument("--hf", default=None, metavar="DIR", help="fine-tune the causal LM saved in DIR (save_pretrained's "
                   "files and its tokenizer) on --data's text files instead of the built-in decoder; no download")
    h.add_argument("--save", default=None, metavar="OUT", help="with --hf: write the fine-tuned model and tokenizer here")
    h.add_argument("--lora", type=int, default=None, metavar="RANK", help="with --hf: train a LoRA adapter of this "
                   "rank on every Linear of the decoder (peft), the base frozen; --save writes the adapter")
    h.add_argument("--quantize", choices=("nf4", "fp4"), default=None, help="with --lora: keep the frozen base "
                   "4-bit (QLoRA, bitsandbytes' format) in host memory and over the copy path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags; raises ValueError naming the flag's field for bad values."""
    devices = None if args.devices is None else [d.strip() for d in args.devices.split(",")]
    return TrainConfig(size=args.size, layers=args.layers, hidden=args.hidden, heads=args.heads, steps=args.steps,
                       batch_size=args.batch_size, seq_len=args.seq_len, microbatches=args.microbatches,
                       devices=devices, lr=args.lr, weight_decay=args.weight_decay, optim=args.optim,
                       warmup=args.warmup,
                       data_dir=args.data_dir, seed=args.seed, asynchronous=args.asynchronous,
                       engine=args.engine, dtype=args.dtype, eval_batches=args.eval_batches, trace=args.trace,
                       progress=not args.no_progress, hf=args.hf, max_grad_norm=args.max_grad_norm,
                       checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
                       compensation=args.compensation, lora=args.lora, quantize=args.quantize,
                       master_dtype=args.master_dtype, device_step=args.device_step)


def _describe(cfg: TrainConfig, corpus: ByteCorpus) -> str:
    m = cfg.model_config()
    mode = "" if cfg.engine == "torch" else (", async step" if cfg.asynchronous else
                                             ", sync step on the worker" if cfg.device_step else ", sync step")
    devices = ",".join(cfg.devices)
    return (f"model: decoder, {m.layers} layers, hidden {m.hidden}, {m.heads} heads, "
            f"{m.num_parameters() / 1e6:.2f}M parameters\n"
            f"data:  {corpus.source}, {len(corpus) / 1e6:.1f} MB\n"
            f"run:   {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} bytes, lr {cfg.lr:g}, seed {cfg.seed}, "
            f"engine {cfg.engine} on {devices}{mode}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save is not None and args.hf is None:
        parser.error("--save needs --hf (the built-in decoder is not saved)")
    if args.hf is not None:
        from roundpipe.commands.train_hf import run
        if args.engine != "roundpipe" or args.trace:
            parser.error("--hf trains with the roundpipe engine only, without --trace")
        try:
            cfg = config_from_args(args).resolved()
            return run(cfg, args.save)
        except (ValueError, TypeError, OSError) as exc:
            parser.error(str(exc))
    try:
        cfg = config_from_args(args).resolved()
        corpus = ByteCorpus.load(cfg.data_dir)
        # Data errors (seq_len longer than the held-out split, ...) before any model is built.
        next(corpus.batches(cfg.batch_size, cfg.seq_len, split="val" if cfg.eval_batches else "train"))
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(_describe(cfg, corpus), flush=True)
    result = train(cfg, corpus)
    val = ("" if result.val_start is None else
           f"\nheld-out loss: start {result.val_start:.3f}  end {result.val_end:.3f}  ({cfg.eval_batches} batches)")
    ran = len(result.losses)
    resumed = f" (resumed after step {cfg.steps - ran})" if cfg.resume else ""
    print(f"loss: start {result.start_loss:.3f}  end {result.end_loss:.3f}  "
          f"(nats/byte; end = mean of the last {min(10, ran)} steps){val}\n"
          f"{ran} steps{resumed}, {result.tokens:,} tokens in {result.seconds:.1f} s: "
          f"{result.tokens_per_s:,.0f} tokens/s on {','.join(result.devices)}")
    if cfg.trace:
        print(f"trace written to {cfg.trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
