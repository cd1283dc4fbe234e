"""`wrap`: a Hugging Face causal LM as a RoundPipe, with HF's names, loss and files.

    model = rp.hf.wrap(hf_model, devices=["cpu", "cpu"])
    loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    model.step(optimizer)
    logits = model(input_ids=ids, attention_mask=mask)
    model.save_pretrained(out_dir)

The model is cut into an embedding layer, one layer per decoder layer and a norm + LM head
layer (roundpipe/hf/layers.py) that hold the HF model's own modules, so the host masters are
the HF model's parameters: `named_parameters()`, `state_dict()` and `save_pretrained()` are the
HF model's.  Training runs the engine with `loss_reduction="sum"` and HF's token-weighted loss
(roundpipe/hf/loss.py); the LM head's loss goes through the fused linear + cross-entropy.

Each call tells the layers what it wants of the head (logits, or the fused loss's inputs) and which PEFT
adapters are on, read from the HF model when it starts; both travel with the activation
(roundpipe/hf/layers.py), so `with model.disable_adapter():` and a backward through `model(...)`'s logits
reach the workers' replicas.  Per call, forward_backward and `model(...)` take RoundPipe's options
(num_microbatches, recompute; return_outputs: the logits beside the loss).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from roundpipe.engine.config import ENGINE_OPTIONS, EngineConfig, check_wrap_options
from roundpipe.engine.data_parallel import launched_group
from roundpipe.engine.model import RoundPipe
from roundpipe.engine.step.host_state import FILE_BACKED
from roundpipe.hf.layers import LOGITS, LOSS, LOSS_LOGITS, Decoder, Embed, Head, adapter_state, is_tuner
from roundpipe.hf.loss import TokenLoss, count_items, shift_labels
from roundpipe.hf.mapped import load_mapped
from roundpipe.hf.presets import PRESETS, causal_lm, find_parts
from roundpipe.hf.quantize import (
    HF_OPTIONS,
    QuantizeConfig,
    bnb_save_state,
    check_headers,
    check_layers,
    checkpoint_files,
    is_bnb_4bit,
    load_bnb_checkpoint,
    quantize_decoder,
)

# every keyword rp.hf.wrap (and rp.hf.Trainer, which passes them to it) takes besides the model: the engine's
# options (EngineConfig's fields; loss_reduction among them, which wrap refuses) and wrap's own (QuantizeConfig's)
WRAP_OPTIONS: tuple[str, ...] = ENGINE_OPTIONS + HF_OPTIONS


def cut_layers(hf_model: nn.Module, quant: QuantizeConfig | None = None) -> list[nn.Module]:
    """The roundpipe layers wrap cuts `hf_model` into: embedding (+ rotary, masks), decoder layers, norm + head;
    4-bit quantized first when `quant` asks (default: not quantized)."""
    quant = quant if quant is not None else QuantizeConfig()
    parts = find_parts(hf_model)
    quantize_decoder(hf_model, parts.layers, quant)   # before the layers see the modules
    layers: list[nn.Module] = [Embed(parts.embed_tokens, parts.rotary_emb, parts.config, parts.attention_types,
                                     parts.router)]
    layers += [Decoder(layer, kind, parts.router) for layer, kind in zip(parts.layers, parts.attention_types)]
    layers.append(Head(parts.norm, parts.lm_head, parts.router))
    covered = {id(p) for layer in layers for p in layer.parameters()}
    for name, p in hf_model.named_parameters():
        if id(p) not in covered:
            raise ValueError(f"{type(hf_model).__name__}: parameter {name!r} is outside the embedding, the decoder "
                             "layers, the final norm and the LM head, so no roundpipe layer would train it")
    if not parts.preset:
        _check_generic(hf_model, layers)
    return layers


@torch.no_grad()
def _check_generic(hf_model: nn.Module, layers: list[nn.Module]) -> None:
    """A model cut by the generic search must give its own logits through our layers (one short forward in
    eval mode): a forward that does more than embed, decode, norm and project (embedding scales, logit
    soft-capping) is a ValueError here rather than wrong training later."""
    lm = causal_lm(hf_model)
    modes = [(m, m.training) for m in hf_model.modules()]
    hf_model.eval()
    try:
        vocab = layers[-1].lm_head.weight.shape[0] if hasattr(layers[-1].lm_head, "weight") else 2
        ids = torch.arange(1, 6).remainder(vocab).unsqueeze(0)
        expected = lm(input_ids=ids).logits.float()
        x = layers[0](input_ids=ids)
        for layer in layers[1:]:
            x = layer(x)
        got = x.float()
    finally:
        for m, mode in modes:
            m.training = mode
    err = ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item()
    tol = 1e-4 if got.dtype == expected.dtype and next(hf_model.parameters()).dtype == torch.float32 else 2e-2
    if got.shape != expected.shape or not err <= tol:
        raise ValueError(f"{type(lm).__name__} (model_type {getattr(lm.config, 'model_type', None)!r}) has no roundpipe "
                         f"preset, and cut generically (embedding, decoder layers, final norm, LM head) its logits differ "
                         f"from its own forward's (max relative error {err:.2e}): its forward does something more; "
                         f"presets: {sorted(PRESETS)}")


def _patch_kernels(hf_model: nn.Module, devices: list[torch.device]) -> int:
    """Our Triton kernels into the HF modules when a worker is a GPU (roundpipe/hf/kernels.py), else 0.

    Patched before the workers' replicas are made, so that every replica runs them."""
    if not any(d.type == "cuda" for d in devices):
        return 0
    try:
        from roundpipe.hf.kernels import patch_kernels
    except ImportError:
        return 0
    return patch_kernels(hf_model, devices)


def checkpointing_off(hf_model: nn.Module, asked_by: str | None = None) -> None:
    """Turns HF's gradient checkpointing off on `hf_model` (on when `model.gradient_checkpointing_enable()` ran, or
    when `asked_by`, e.g. TrainingArguments(gradient_checkpointing=True), asks for it), with one line saying so.

    Why off: a backward stage of the engine reruns its layers' forward from the stage's input already (a stage
    keeps no activations between its forward and its backward; one worker keeps them only when the planner found
    that the whole batch fits, docs/planner.md), so HF's checkpointing inside a decoder layer is a second recompute
    of the same forward for a memory saving the engine has made.  The input hook it added
    (enable_input_require_grads) stays: it changes no parameter's gradient."""
    on = any(getattr(m, "gradient_checkpointing", False) is True for m in hf_model.modules())
    if on:
        lm = causal_lm(hf_model)
        # activation_checkpointing_disable: transformers >= 5.x's name; gradient_checkpointing_disable before it
        (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()
    if on or asked_by:
        warnings.warn(f"rp.hf: HF gradient checkpointing ({asked_by or 'gradient_checkpointing_enable()'}) turned "
                      "off: the engine recomputes each layer's forward in its backward already (docs/hf.md)",
                      stacklevel=3)


class HFRoundPipe(RoundPipe):
    """A RoundPipe over a Hugging Face causal LM (built by `wrap`); HF names, loss and files."""

    def __init__(self, hf_model: nn.Module, devices=None, num_microbatches: int | None = None,
                 compute_dtype: torch.dtype | None = None, plan=None, *, quantize: str | QuantizeConfig | None = None,
                 double_quant: bool = True, **roundpipe_kwargs):
        check_wrap_options("rp.hf.wrap", "hf_model", "a transformers causal LM", hf_model, roundpipe_kwargs,
                           {"loss_reduction": "HF's token-weighted loss"}, HF_OPTIONS)
        if isinstance(quantize, QuantizeConfig):   # checked already (from_pretrained)
            if double_quant is not True:
                raise ValueError("quantize= is a QuantizeConfig, which holds double_quant; do not pass double_quant too")
            quant = quantize
        else:
            quant = QuantizeConfig(quantize, double_quant)
        if "process_group" not in roundpipe_kwargs:   # launched by torchrun: the ranks train together
            roundpipe_kwargs["process_group"] = launched_group("rp.hf.wrap")
        # every engine option checked before the model is cut, quantized or patched
        config = EngineConfig(devices=devices, num_microbatches=num_microbatches, compute_dtype=compute_dtype,
                              plan=plan, loss_reduction="sum", **roundpipe_kwargs)
        compute = config.resolved_precision.compute_dtype
        mapped = [(n, p.dtype) for n, p in hf_model.named_parameters()
                  if getattr(p, FILE_BACKED, False) is True and not p.requires_grad and p.dtype != compute]
        if mapped:
            raise ValueError(f"the frozen base stays in its files (base_in_ram=False) and is uploaded as stored, in "
                             f"{mapped[0][1]} ({mapped[0][0]}, ...), but the compute dtype is {compute}; pass "
                             f"compute_dtype={mapped[0][1]}, or load the base into RAM (base_in_ram=True)")
        checkpointing_off(hf_model)
        layers = cut_layers(hf_model, quant)
        self.hf_model = hf_model
        # PEFT's adapter modules, whose switches each call reads (disable_adapter(), set_adapter(): layers.py)
        self._tuners = [(n, m) for n, m in hf_model.named_modules() if is_tuner(m)]
        self.kernels_patched = _patch_kernels(hf_model, config.worker_devices)
        super().__init__(layers, config=config)

    @property
    def config(self):
        return causal_lm(self.hf_model).config

    # ---- state: the HF model's own (parameters, state dicts, train/eval, checkpoint names)
    @property
    def _owner(self) -> nn.Module:
        return self.hf_model

    # ---- calls
    def _inputs(self, input_ids, attention_mask, position_ids, extra: dict, head: str, takes: str) -> dict:
        """The first layer's inputs of one call: the batch, what the call wants of the head, the adapter state."""
        if extra:
            raise TypeError(f"unexpected keyword argument(s) {sorted(extra)}; a wrapped HF model takes input_ids, "
                            f"attention_mask, position_ids, {takes}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            what = f"a {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}" \
                if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, seq_len], got {what}")
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                           or attention_mask.shape != input_ids.shape):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be None or a tensor of input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {shape}")
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                "head": head, "adapters": adapter_state(self._tuners)}

    def forward_backward(self, input_ids=None, attention_mask=None, labels=None, *, position_ids=None,
                         num_items_in_batch=None, return_outputs: bool = False, num_microbatches: int | None = None,
                         recompute: str | None = None, **kwargs):
        """HF's causal-LM loss of the batch (labels shifted inside, -100 ignored, the mean over the batch's
        counted tokens or divided by num_items_in_batch) and its gradients; returns the loss, or with
        return_outputs=True (loss, logits [batch, seq_len, vocab] on the CPU, detached; the loss then takes the
        cross-entropy of those logits rather than the fused head).  num_microbatches and recompute: this call's,
        as RoundPipe.forward_backward takes them."""
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs must be True or False, got {return_outputs!r}")
        inputs = self._inputs(input_ids, attention_mask, position_ids, kwargs, LOSS_LOGITS if return_outputs else LOSS,
                              "labels, num_items_in_batch, return_outputs, num_microbatches, recompute")
        if labels is None:
            raise ValueError("labels is None; pass labels [batch, seq_len] (usually input_ids, with -100 at padding)")
        shifted = shift_labels(labels)
        if shifted.shape != input_ids.shape:
            raise ValueError(f"labels have shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}; they must match")
        items = count_items(shifted, num_items_in_batch)
        batch = input_ids.shape[0]   # a router loss (MoE) is weighted by each microbatch's share (hf/loss.py)
        options = {"return_outputs": return_outputs, "num_microbatches": num_microbatches, "recompute": recompute}
        if self.dp is not None and num_items_in_batch is None:
            # the token mean over every rank's batch: each rank divides by the ranks' total count, and
            # the ranks' gradients are summed (loss_reduction="sum"); the loss returned is this rank's own mean
            total = self.dp.sum_over_ranks(items)
            loss_fn = TokenLoss(total, batch, aux_share=items / total)
            out = super().forward_backward(labels=shifted, loss_fn=loss_fn, **options, **inputs)
            scale = total / items
            return (out[0] * scale, out[1][0]) if return_outputs else out * scale
        out = super().forward_backward(labels=shifted, loss_fn=TokenLoss(items, batch), **options, **inputs)
        return (out[0], out[1][0]) if return_outputs else out   # the head's (logits, None[, aux]): its logits

    def __call__(self, input_ids=None, attention_mask=None, *, position_ids=None, num_microbatches: int | None = None,
                 recompute: str | None = None, **kwargs) -> torch.Tensor:
        """Logits [batch, seq_len, vocab] on the CPU: forward only, or under autograd (grad enabled and the model
        in train() with trainable parameters) a node of the caller's graph, whose backward lands the gradients
        HF's forward would (RoundPipe.__call__).  num_microbatches and recompute: this call's."""
        inputs = self._inputs(input_ids, attention_mask, position_ids, kwargs, LOGITS, "num_microbatches, recompute")
        return super().__call__(num_microbatches=num_microbatches, recompute=recompute, **inputs)

    forward = __call__

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """PEFT's `disable_adapter()` of the wrapped PEFT model: calls inside the block run the base model alone
        on the workers, as PEFT's forward does, and with the adapter after it (e.g. a reference model's
        log-probabilities, as TRL computes them).  `with model.hf_model.disable_adapter():` does the same."""
        if not callable(getattr(self.hf_model, "disable_adapter", None)) or not self._tuners:
            raise TypeError(f"disable_adapter(): the wrapped {type(self.hf_model).__name__} is no PEFT model with an "
                            "adapter; wrap a peft.get_peft_model(...) model (or pass peft_config= to "
                            "rp.hf.from_pretrained), or switch transformers' own adapters with "
                            "model.hf_model.disable_adapters() / enable_adapters()")
        with self.hf_model.disable_adapter():
            yield

    # ---- files
    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """The HF model's save_pretrained (safetensors, HF names; a PEFT model writes its adapter)
        with the masters as they are after every pending step.

        A model with a 4-bit base and no adapter writes what transformers writes for a model it loaded with
        bitsandbytes 4-bit: bitsandbytes' tensors and `quantization_config` in config.json (hf/quantize.py,
        `bnb_save_state`), a folder that transformers + bitsandbytes and rp.hf.from_pretrained load, the packed
        base bitwise as it was; a 4-bit base with no bitsandbytes form is a ValueError before anything is written."""
        self.synchronize()
        if self.offload is not None and self.offload.placeholders:
            raise ValueError("save_pretrained: some fp32 masters live in offload_dir (host_memory too small for them), "
                             "and the HF model holds placeholders for them; save with save_checkpoint (streamed), or "
                             "close() this model (which reads the masters back into the HF model) and call "
                             "hf_model.save_pretrained")
        adapter_only = hasattr(self.hf_model, "peft_config") or getattr(self.hf_model, "_hf_peft_config_loaded", False)
        saved = None if adapter_only else bnb_save_state(self.hf_model)
        if saved is None:
            self.hf_model.save_pretrained(save_directory, **kwargs)
            return
        if "state_dict" in kwargs:
            raise TypeError("save_pretrained: state_dict= cannot be given for a model with a 4-bit base: the tensors "
                            "written are the model's own, its 4-bit layers in bitsandbytes' format")
        state, quantization_config = saved
        config = causal_lm(self.hf_model).config
        had = "quantization_config" in config.__dict__
        before = config.__dict__.get("quantization_config")
        config.quantization_config = quantization_config   # written into config.json, then taken back
        try:
            self.hf_model.save_pretrained(save_directory, state_dict=state, **kwargs)
        finally:
            if had:
                config.quantization_config = before
            else:
                del config.quantization_config


def wrap(hf_model: nn.Module, devices=None, num_microbatches: int | None = None,
         compute_dtype: torch.dtype | None = None, plan=None, *, quantize: str | QuantizeConfig | None = None,
         double_quant: bool = True, **roundpipe_kwargs: Any) -> HFRoundPipe:
    """A RoundPipe over a transformers causal LM (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS or any decoder
    with embeddings, a list of decoder layers, a final norm and an LM head), or a PEFT model around one.

    The HF model must be on the CPU; it becomes the host master (its trainable parameters turn fp32 in
    place, or bf16 with master_dtype=torch.bfloat16: updated in fp32 by roundpipe.optim and rounded
    stochastically, master_rounding=). roundpipe_kwargs are RoundPipe's other options, every one of them
    (WRAP_OPTIONS: the fields of roundpipe.EngineConfig, which documents and checks them: microbatches_per_round,
    planning, device_memory, master_dtype, offload_dir, host_memory, ...) but loss_reduction, which wrap fixes.  Under
    torchrun (more than one rank) the ranks train data-parallel on the world group unless process_group=
    says otherwise (None: this process alone), joining it first if torch.distributed is not initialized
    yet (`launched_group`); the token mean is then over all ranks' tokens.

    quantize="nf4" or "fp4" stores the frozen Linear weights of the decoder layers (a PEFT model's base
    layers) 4-bit in bitsandbytes' format (double_quant: its 8-bit absmax, ~0.52 bytes a weight), packed
    in host memory and over the copy path, dequantized on the workers (roundpipe/hf/quantize.py); a model
    loaded with bitsandbytes' 4-bit Linears is taken as it is, with or without quantize=.  quantize= may also be
    a checked roundpipe.hf.quantize.QuantizeConfig (then without double_quant=)."""
    return HFRoundPipe(hf_model, devices, num_microbatches, compute_dtype, plan, quantize=quantize,
                       double_quant=double_quant, **roundpipe_kwargs)


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | str = "auto", *, quantize: str | None = None,
                    double_quant: bool = True, peft_config=None, base_in_ram: bool = True,
                    **wrap_kwargs: Any) -> HFRoundPipe:
    """Loads a local checkpoint (safetensors) into host memory and wraps it.

    dtype "auto" keeps the checkpoint's dtype while loading: the wrap then turns every trainable
    parameter into its fp32 master in place, and parameters frozen before wrapping (see docs/hf.md)
    stay as stored; torch.float32 loads everything in fp32.  peft_config (a peft.LoraConfig, ...) puts
    that adapter around the model before wrapping (peft.get_peft_model: the base frozen); quantize=
    then stores the frozen decoder Linears 4-bit (wrap).  A checkpoint of a bitsandbytes 4-bit model
    (its config's quantization_config) is read as stored, without bitsandbytes (hf/quantize.py).

    base_in_ram=False (with peft_config): the frozen base stays in its safetensors files, memory-mapped,
    and uploads read it from the page cache, so a base larger than host RAM trains (hf/mapped.py); the
    files' dtype must then be the compute dtype (compute_dtype=torch.bfloat16 for a bf16 folder on CPU
    workers).  Not with quantize= or a 4-bit folder."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if not os.path.isdir(path):
        raise ValueError(f"path={str(path)!r} is not a directory; give a folder written by save_pretrained "
                         "(config.json and *.safetensors); the hub is not reached from here")
    if dtype != "auto" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} must be 'auto' or a floating torch.dtype")
    quant = QuantizeConfig(quantize, double_quant)   # checked before anything is loaded; wrap takes it as it is
    if not isinstance(base_in_ram, bool):
        raise TypeError(f"base_in_ram must be True or False, got {base_in_ram!r}")
    if not base_in_ram and peft_config is None:
        raise ValueError("base_in_ram=False needs peft_config= (a peft.LoraConfig, ...): only a frozen base can stay "
                         "in its files, and without an adapter every weight is trained")
    if not base_in_ram and quant.quantize is not None:
        raise ValueError(f"base_in_ram=False with quantize={quant.quantize!r}: a 4-bit base is held packed in host "
                         "memory, not mapped from the files; pass one or the other")
    files = checkpoint_files(path)   # the folder may come from anywhere: its files are checked before they are read
    try:
        config = AutoConfig.from_pretrained(path)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{os.path.join(path, 'config.json')}: transformers cannot read it "
                         f"({type(e).__name__}: {str(e)[:300]})") from None
    if is_bnb_4bit(config):
        if not base_in_ram:
            raise ValueError(f"{str(path)!r} holds a bitsandbytes 4-bit base, which is read into host memory packed; "
                             "base_in_ram=False maps 16-bit (or fp32) safetensors only")
        hf_model = load_bnb_checkpoint(path, config, dtype, peft_config)
    elif not base_in_ram:
        hf_model = load_mapped(path, config, files, dtype, peft_config)
    else:
        check_layers(config, check_headers(files), path)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if peft_config is not None:
            import peft
            hf_model = peft.get_peft_model(hf_model, peft_config)
    return wrap(hf_model, quantize=quant, **wrap_kwargs)
