"""`roundpipe train --hf DIR --data DIR`: fine-tune a local Hugging Face checkpoint on text files.

The folder DIR holds what `save_pretrained` writes for a causal LM (config.json, *.safetensors)
and its tokenizer; nothing is downloaded.  The text files under --data (every text file,
recursively; the standard library's sources without it) are tokenized with that tokenizer,
joined with its EOS token into one token stream, and cut into seeded random windows of
--seq-len tokens (labels = the window: HF's loss shifts them inside); the last 5% of the
stream is held out.  The model is loaded straight into host memory (`rp.hf.from_pretrained`)
and trained with roundpipe.optim.AdamW, the same warmup + cosine schedule as `roundpipe train`;
`--save OUT` writes the fine-tuned model and the tokenizer with save_pretrained.

    roundpipe train --hf ./my-model --data ./notes --steps 100 --save ./my-model-tuned
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from roundpipe.commands.data import _is_text, _list_files, stdlib_dir


class TokenCorpus:
    """One token stream with a held-out tail and seeded [B, T] windows."""

    def __init__(self, tokens: torch.Tensor, source: str, val_fraction: float = 0.05):
        self.tokens = tokens
        self.source = source
        self.split_at = len(tokens) - int(len(tokens) * val_fraction)

    @classmethod
    def load(cls, data_dir: str | None, tokenizer) -> "TokenCorpus":
        if data_dir is None:
            root, files = stdlib_dir(), _list_files(stdlib_dir(), "*.py")
        else:
            root = Path(data_dir).expanduser()
            if not root.is_dir():
                raise ValueError(f"--data {str(data_dir)!r} is not a directory")
            files = [p for p in _list_files(root.resolve(), "*") if _is_text(p)]
        if not files:
            raise ValueError(f"--data {str(root)!r} holds no text files (hidden and binary files are skipped)")
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for path in files:
            ids += tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
            if eos is not None:
                ids.append(eos)
        return cls(torch.tensor(ids, dtype=torch.long), f"{root} ({len(files)} text files, {len(ids):,} tokens)")

    def batches(self, batch_size: int, seq_len: int, seed: int, split: str = "train", steps: int | None = None):
        data = self.tokens[: self.split_at] if split == "train" else self.tokens[self.split_at:]
        if len(data) < seq_len:
            raise ValueError(f"--seq-len {seq_len} needs at least {seq_len} tokens, but the {split} split of "
                             f"{self.source} has {len(data)}; use a shorter --seq-len or more data")
        gen = torch.Generator().manual_seed(seed)
        window = torch.arange(seq_len)
        count = 0
        while steps is None or count < steps:
            starts = torch.randint(0, len(data) - seq_len + 1, (batch_size, 1), generator=gen)
            yield data[starts + window]
            count += 1


def held_out_loss(model, corpus: TokenCorpus, cfg) -> float | None:
    """HF's loss of `cfg.eval_batches` fixed held-out batches, forward only (logits on the host)."""
    if cfg.eval_batches == 0:
        return None
    total = 0.0
    for ids in corpus.batches(cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1, split="val", steps=cfg.eval_batches):
        logits = model(input_ids=ids)
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))
    return total / cfg.eval_batches


def train_hf(cfg, save: str | None = None) -> dict:
    """Fine-tunes cfg.hf on cfg.data_dir (a resolved TrainConfig); returns losses and timings."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    import roundpipe as rp
    from roundpipe.commands.train import lr_at, make_optimizer
    from roundpipe.commands.train_loops import DTYPES

    if not Path(cfg.hf).is_dir():
        raise ValueError(f"--hf {cfg.hf!r} is not a directory; give a folder written by save_pretrained "
                         "(config.json, *.safetensors and the tokenizer); nothing is downloaded")
    tokenizer = AutoTokenizer.from_pretrained(cfg.hf)
    corpus = TokenCorpus.load(cfg.data_dir, tokenizer)
    next(corpus.batches(cfg.batch_size, cfg.seq_len, cfg.seed, "val" if cfg.eval_batches else "train"))
    with rp.hf.from_pretrained(cfg.hf, devices=cfg.devices, num_microbatches=cfg.microbatches,
                               compute_dtype=DTYPES[cfg.dtype] if cfg.dtype else None) as model:
        model.train()   # from_pretrained leaves a model in eval mode, as transformers does
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {cfg.hf} ({model.config.model_type}, {n_params / 1e6:.2f}M parameters)\n"
              f"data:  {corpus.source}\n"
              f"run:   {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, lr {cfg.lr:g}, seed {cfg.seed}, "
              f"on {','.join(cfg.devices)}, {'async' if cfg.asynchronous else 'sync'} step", flush=True)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable, cfg.lr, cfg.weight_decay, cfg.optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
        val_start = held_out_loss(model, corpus, cfg)
        bar = tqdm(total=cfg.steps, unit="step", disable=not cfg.progress, dynamic_ncols=True, file=sys.stderr)
        losses: list[float] = []
        start = time.perf_counter()
        for step, ids in enumerate(corpus.batches(cfg.batch_size, cfg.seq_len, cfg.seed, steps=cfg.steps)):
            losses.append(float(model.forward_backward(input_ids=ids, labels=ids)))
            model.step(optimizer, lr_scheduler=schedule, asynchronous=cfg.asynchronous)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update()
        model.synchronize()
        seconds = time.perf_counter() - start
        bar.close()
        val_end = held_out_loss(model, corpus, cfg)
        if save is not None:
            model.save_pretrained(save)
            tokenizer.save_pretrained(save)
    return {"losses": losses, "val_start": val_start, "val_end": val_end, "seconds": seconds,
            "tokens": cfg.steps * cfg.batch_size * cfg.seq_len}


def run(cfg, save: str | None) -> int:
    """What `roundpipe train --hf` prints."""
    r = train_hf(cfg, save)
    tail = r["losses"][-min(10, len(r["losses"])):]
    val = "" if r["val_start"] is None else \
        f"\nheld-out loss: start {r['val_start']:.3f}  end {r['val_end']:.3f}  ({cfg.eval_batches} batches)"
    print(f"loss: start {r['losses'][0]:.3f}  end {sum(tail) / len(tail):.3f}  (nats/token; end = mean of the last "
          f"{len(tail)} steps){val}\n{cfg.steps} steps, {r['tokens']:,} tokens in {r['seconds']:.1f} s: "
          f"{r['tokens'] / r['seconds']:,.0f} tokens/s" + (f"\nsaved to {save}" if save else ""))
    return 0
