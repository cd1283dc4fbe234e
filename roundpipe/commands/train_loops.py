"""The two engines `roundpipe train` can drive, behind one small interface.

`RoundPipeEngine` wraps `rp.RoundPipe` (the product); `TorchReference` runs the same
layers as one `nn.Sequential` on one device with a plain PyTorch loop (the reference
for losses and tokens/s).  Both offer what the training loop needs and nothing more:

    engine.forward_backward(x, labels=y, loss_fn=f) -> 0-dim CPU loss
    engine.step(optimizer, lr_scheduler=..., asynchronous=..., max_grad_norm=...)   # steps, then the scheduler; clears grads
                                                                 # (RoundPipe clears them itself)
    engine(x) -> output;  engine.named_parameters();  engine.synchronize()
    engine.devices;  engine.save_trace(path or None);  with engine: ...

The lr scheduler goes into RoundPipe's public `step(lr_scheduler=)`, which steps it
right after the update it belongs to: the asynchronous step of iteration t runs while
iteration t+1 computes, and a scheduler stepped from the loop would race with it.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
from torch import nn

from roundpipe.optim import AdamW, AdamW8bit
from roundpipe.trace import Trace

# --dtype names -> compute dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TorchReference:
    """The layers as one nn.Sequential on one device; autocast when dtype is not fp32."""

    def __init__(self, layers: list[nn.Module], device: str, dtype: torch.dtype | None, trace: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"devices=[{device!r}]: no CUDA device is visible")
        self.devices = [str(self.device)]
        self.module = nn.Sequential(*layers).to(self.device)
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.trace = Trace(metadata={"engine": "torch"}) if trace else None
        self._step = 0
        # fp16: torch's own dynamic loss scaling, as a plain PyTorch loop would use it
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.module(x.to(self.device, non_blocking=True))

    def forward_backward(self, x: torch.Tensor, *, labels: torch.Tensor, loss_fn) -> torch.Tensor:
        start = time.perf_counter()
        with self._autocast():
            loss = loss_fn(self.module(x.to(self.device)), labels.to(self.device))
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        loss = loss.detach().cpu()
        if self.trace is not None:
            self.trace.add(self.devices[0], f"forward_backward {self._step}", start, time.perf_counter(), "fused")
        return loss

    def step(self, optimizer: torch.optim.Optimizer, *, lr_scheduler=None, asynchronous: bool = False,
             max_grad_norm: float | None = None) -> None:
        start = time.perf_counter()
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)   # skipped when a gradient is inf/NaN
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale
        else:
            optimizer.step()
            stepped = True
        if lr_scheduler is not None and stepped:
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if self.trace is not None:
            self.synchronize()
            self.trace.add(self.devices[0], f"step {self._step}", start, time.perf_counter(), "optimizer")
        self._step += 1

    def named_parameters(self):
        return self.module.named_parameters()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def save_trace(self, path: str | None) -> None:
        if path is not None and self.trace is not None:
            self.trace.save(path)

    def close(self) -> None:
        self.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RoundPipeEngine:
    """rp.RoundPipe over the layers; the optimizer steps through `model.step`.

    Takes RoundPipe's own arguments after the layers (devices, num_microbatches, compute_dtype, ... : every
    engine option, roundpipe.EngineConfig's fields, or config=), so it offers whatever the engine does."""

    def __init__(self, layers: list[nn.Module], *args: Any, trace: bool = False, **options: Any):
        from roundpipe.engine.model import RoundPipe

        self.model = RoundPipe(layers, *args, **options)
        self.devices = [str(d) for d in self.model.devices]
        self._recording = self.model.record_trace() if trace else None
        self.trace = self._recording.__enter__() if trace else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def forward_backward(self, x: torch.Tensor, *, labels: torch.Tensor, loss_fn) -> torch.Tensor:
        return self.model.forward_backward(x, labels=labels, loss_fn=loss_fn)

    def step(self, optimizer: torch.optim.Optimizer, *, lr_scheduler=None, asynchronous: bool = False,
             max_grad_norm: float | None = None) -> None:
        self.model.step(optimizer, asynchronous=asynchronous, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm)

    def named_parameters(self):
        return self.model.named_parameters()

    @property
    def loss_scale(self) -> float | None:
        return self.model.loss_scale

    def save_checkpoint(self, path: str, optimizer, lr_scheduler, extra: dict) -> None:
        self.model.save_checkpoint(path, optimizer, lr_scheduler, extra=extra)

    def load_checkpoint(self, path: str, optimizer, lr_scheduler) -> dict:
        return self.model.load_checkpoint(path, optimizer, lr_scheduler)

    def synchronize(self) -> None:
        self.model.synchronize()

    def save_trace(self, path: str | None) -> None:
        if path is not None and self.trace is not None:
            self.trace.save(path)

    def close(self) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
        self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_options(cfg) -> dict[str, Any]:
    """The engine options (roundpipe.EngineConfig's fields) that the flags of `roundpipe train` set, for a resolved
    TrainConfig: RoundPipe's keywords here, rp.hf.from_pretrained's with --hf (roundpipe/commands/train_hf.py)."""
    from roundpipe.engine.step.staleness import StalenessCompensation

    cpu = all(d.startswith("cpu") for d in cfg.devices)
    # the device step on a CPU worker (no device_memory cap to size the resident prefix from): every layer, the
    # embedding and the head beside the decoder layers (the built-in decoder's, or rp.hf.wrap's cut)
    resident = {"device_step": True, "resident_layers": _decoder_layers(cfg) + 2 if cpu else None} \
        if cfg.device_step else {}
    return {"devices": cfg.devices, "num_microbatches": cfg.microbatches,
            "compute_dtype": DTYPES[cfg.dtype] if cfg.dtype is not None else None,
            "compensation": None if cfg.compensation is None else StalenessCompensation(cfg.compensation),
            "master_dtype": DTYPES[cfg.master_dtype], **resident}


def _decoder_layers(cfg) -> int:
    """The decoder layers of the model `roundpipe train` trains: --hf's config, else the built-in one's."""
    if cfg.hf is None:
        return cfg.model_config().layers
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(cfg.hf).num_hidden_layers


def make_engine(layers: list[nn.Module], cfg) -> TorchReference | RoundPipeEngine:
    """The engine `cfg.engine` names, for a resolved roundpipe.commands.train.TrainConfig."""
    if cfg.engine == "torch":
        device = cfg.devices[0] if cfg.devices else "cpu"
        return TorchReference(layers, device, DTYPES[cfg.dtype] if cfg.dtype is not None else None,
                              trace=cfg.trace is not None)
    from roundpipe.engine.config import EngineConfig
    return RoundPipeEngine(layers, config=EngineConfig(**engine_options(cfg)), trace=cfg.trace is not None)


OPTIMIZERS = {"adamw": AdamW, "adamw8bit": AdamW8bit}


def make_optimizer(named_params, lr: float, weight_decay: float, optim: str = "adamw") -> torch.optim.Optimizer:
    """roundpipe.optim.AdamW (or AdamW8bit) over the fp32 master weights; matrices decay, norms and biases do not.

    The native fused step (torch.optim.AdamW's arithmetic; AdamW8bit: bitsandbytes'); through
    RoundPipe it runs per layer and writes each layer's upload copy in the same pass.
    """
    named = list(named_params)
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return OPTIMIZERS[optim]([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, cfg) -> float:
    """Linear warmup over cfg.warmup steps, then cosine decay to 10% of cfg.lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
