"""`roundpipe train --hf DIR --data DIR`: fine-tune a local Hugging Face checkpoint on text files.

The folder DIR holds what `save_pretrained` writes for a causal LM (config.json, *.safetensors)
and its tokenizer; nothing is downloaded.  The text files under --data (every text file,
recursively; the standard library's sources without it) are tokenized with that tokenizer,
joined with its EOS token into one token stream, and cut into seeded random windows of
--seq-len tokens (labels = the window: HF's loss shifts them inside); the last 5% of the
stream is held out.  The model is loaded straight into host memory (`rp.hf.from_pretrained`)
and trained with roundpipe.optim.AdamW, the same warmup + cosine schedule as `roundpipe train`;
`--save OUT` writes the fine-tuned model and the tokenizer with save_pretrained.

The training flags of `roundpipe train` work as they do there: --max-grad-norm, --checkpoint
(--checkpoint-every), --resume (bitwise as if never stopped), --compensation, --async/--sync,
--dtype, --microbatches, --devices.  The flags that shape the built-in decoder (--size,
--layers, --hidden, --heads) are errors: the checkpoint's config.json fixes the shape.

--lora RANK trains a PEFT LoRA adapter (alpha 2 x RANK, every Linear of the decoder, no dropout)
with the base frozen, and --save writes the adapter; --quantize nf4|fp4 with it keeps the frozen
base 4-bit (QLoRA: roundpipe/hf/quantize.py).  A bitsandbytes 4-bit checkpoint is read as stored
(--quantize then changes nothing, and says so in a warning); the `model:` line names the base's 4-bit
type as loaded.  Without --lora, --save of a 4-bit checkpoint writes it in bitsandbytes' format
(transformers and `rp.hf.from_pretrained` load it, the packed base bitwise as read).

    roundpipe train --hf ./my-model --data ./notes --steps 100 --save ./my-model-tuned
    roundpipe train --hf ./my-model --lora 16 --quantize nf4 --save ./my-adapter
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from roundpipe.commands.data import is_text, list_files, stdlib_dir


class TokenCorpus:
    """One token stream with a held-out tail and seeded [B, T] windows."""

    def __init__(self, tokens: torch.Tensor, source: str, val_fraction: float = 0.05):
        self.tokens = tokens
        self.source = source
        self.split_at = len(tokens) - int(len(tokens) * val_fraction)

    @classmethod
    def load(cls, data_dir: str | None, tokenizer) -> "TokenCorpus":
        if data_dir is None:
            root, files = stdlib_dir(), list_files(stdlib_dir(), "*.py")
        else:
            root = Path(data_dir).expanduser()
            if not root.is_dir():
                raise ValueError(f"--data {str(data_dir)!r} is not a directory")
            files = [p for p in list_files(root.resolve(), "*") if is_text(p)]
        if not files:
            raise ValueError(f"--data {str(root)!r} holds no text files (hidden and binary files are skipped)")
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for path in files:
            ids += tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
            if eos is not None:
                ids.append(eos)
        if len(ids) == (len(files) if eos is not None else 0):   # nothing but the EOS tokens it added
            raise ValueError(f"the tokenizer of --hf turned the {len(files)} text file(s) of {root} into no tokens; "
                             "check that the folder's tokenizer files are the model's")
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


# what save_pretrained writes for a tokenizer that can encode text (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")
# flags of `roundpipe train` that shape the built-in decoder: with --hf, config.json does
SHAPE_FLAGS = {"size": "--size", "layers": "--layers", "hidden": "--hidden", "heads": "--heads"}


def check_hf_flags(cfg) -> None:
    """ValueError naming a flag `roundpipe train --hf` cannot honour, or a folder it cannot use."""
    for name, flag in SHAPE_FLAGS.items():
        if getattr(cfg, name) is not None:
            raise ValueError(f"{flag} {getattr(cfg, name)} shapes the built-in decoder; with --hf the checkpoint's "
                             f"config.json fixes the model's shape: drop {flag}")
    folder = Path(cfg.hf)
    if not folder.is_dir():
        raise ValueError(f"--hf {cfg.hf!r} is not a directory; give a folder written by save_pretrained "
                         "(config.json, *.safetensors and the tokenizer); nothing is downloaded")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"--hf {cfg.hf!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's "
                         "tokenizer into it with tokenizer.save_pretrained(folder); nothing is downloaded")
    if cfg.resume is not None and not Path(cfg.resume).is_dir():
        raise ValueError(f"--resume {cfg.resume!r} is not a directory; give a folder written by --checkpoint")


def lora_config(rank: int | None):
    """The adapter --lora RANK trains: PEFT LoRA on every Linear of the decoder, alpha 2 x rank, no dropout."""
    if rank is None:
        return None
    import peft
    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def checkpoint_due(step: int, cfg) -> bool:
    """Whether --checkpoint is written after step `step` (0-based): at the end, and every --checkpoint-every."""
    done = step + 1
    return cfg.checkpoint is not None and (done == cfg.steps or (
        cfg.checkpoint_every is not None and done % cfg.checkpoint_every == 0))


def train_hf(cfg, save: str | None = None) -> dict:
    """Fine-tunes cfg.hf on cfg.data_dir (a resolved TrainConfig); returns losses and timings."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    import roundpipe as rp
    from roundpipe.commands.train_loops import engine_options, lr_at, make_optimizer
    from roundpipe.hf.quantize import base_types

    check_hf_flags(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.hf)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--hf {cfg.hf!r}: its tokenizer could not be loaded ({exc})") from exc
    corpus = TokenCorpus.load(cfg.data_dir, tokenizer)
    next(corpus.batches(cfg.batch_size, cfg.seq_len, cfg.seed, "val" if cfg.eval_batches else "train"))
    with rp.hf.from_pretrained(cfg.hf, peft_config=lora_config(cfg.lora), quantize=cfg.quantize,
                               **engine_options(cfg)) as model:   # the same engine options as `roundpipe train`
        model.train()   # from_pretrained leaves a model in eval mode, as transformers does
        n_params = sum(p.numel() for p in model.parameters()) + model.host.quantized_numel
        n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        types = base_types(model.hf_model)   # what the base is, not what --quantize asked (hf/quantize.py)
        base = f", base {'+'.join(types)}" if types else ""
        print(f"model: {cfg.hf} ({model.config.model_type}, {n_params / 1e6:.2f}M parameters, "
              f"{n_trained / 1e6:.2f}M trained{base})\n"
              f"data:  {corpus.source}\n"
              f"run:   {cfg.steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens, lr {cfg.lr:g}, seed {cfg.seed}, "
              f"on {','.join(cfg.devices)}, {'async' if cfg.asynchronous else 'sync'} step", flush=True)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = make_optimizer(trainable, cfg.lr, cfg.weight_decay, cfg.optim)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
        first = 0
        if cfg.resume is not None:   # the model, optimizer, schedule and RNG as they were after step `first`
            first = model.load_checkpoint(cfg.resume, optimizer, schedule).get("step", 0)
            if first >= cfg.steps:
                raise ValueError(f"--resume {cfg.resume!r} was saved after step {first}; --steps {cfg.steps} leaves "
                                 "nothing to train")
        val_start = held_out_loss(model, corpus, cfg) if cfg.resume is None else None
        bar = tqdm(total=cfg.steps - first, unit="step", disable=not cfg.progress, dynamic_ncols=True,
                   file=sys.stderr)
        losses: list[float] = []
        start = time.perf_counter()
        for step, ids in enumerate(corpus.batches(cfg.batch_size, cfg.seq_len, cfg.seed, steps=cfg.steps)):
            if step < first:   # the batches a resumed run already trained on
                continue
            losses.append(float(model.forward_backward(input_ids=ids, labels=ids)))
            model.step(optimizer, lr_scheduler=schedule, asynchronous=cfg.asynchronous,
                       max_grad_norm=cfg.max_grad_norm)
            if checkpoint_due(step, cfg):
                model.save_checkpoint(cfg.checkpoint.replace("{step}", str(step + 1)), optimizer, schedule,
                                      extra={"step": step + 1})
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
            "tokens": (cfg.steps - first) * cfg.batch_size * cfg.seq_len, "first": first}


def run(cfg, save: str | None) -> int:
    """What `roundpipe train --hf` prints."""
    r = train_hf(cfg, save)
    tail = r["losses"][-min(10, len(r["losses"])):]
    resumed = f" (resumed after step {r['first']})" if r["first"] else ""
    val = "" if r["val_start"] is None else \
        f"\nheld-out loss: start {r['val_start']:.3f}  end {r['val_end']:.3f}  ({cfg.eval_batches} batches)"
    print(f"loss: start {r['losses'][0]:.3f}  end {sum(tail) / len(tail):.3f}  (nats/token; end = mean of the last "
          f"{len(tail)} steps){val}\n{len(r['losses'])} steps{resumed}, {r['tokens']:,} tokens in {r['seconds']:.1f} s: "
          f"{r['tokens'] / r['seconds']:,.0f} tokens/s" + (f"\nsaved to {save}" if save else ""))
    return 0
