"""Long context: the longest sequence (batch 1) a Hugging Face model trains with, by the planner's memory model.

    fit = rp.hf.max_seq_len("qwen3-1.7b", device_memory=24 << 30)       # or a config, a dict, a config.json
    fit.seq_len, fit.binding, fit.table()

The prediction is the engine's own refusal rule, not a second model of it.  The engine plans at the
first call from per-layer `LayerCost`s (roundpipe/engine/dry_run.py: a dry run of the first
microbatch through copies of the layers, saved bytes counted by autograd's saved-tensor hooks,
attention counted as the fused kernel keeps it) and `planner.partition(costs, workers,
microbatches, budget)` under the cap rule (`planner.partition_for_cap`: each stage within
`cap_stage_limit`), which raises `LayerTooLarge` when one layer's weights, fp32 gradient
accumulators and one microbatch's activations and workspace (planner/memory.py) exceed what a stage
may hold; the engine turns that into a ValueError before any work.  Here:

    1. the model is built from its config on the meta device (no weights, no download) and cut
       into roundpipe layers as `rp.hf.wrap` cuts it (hf/model.py `cut_layers`);
    2. for a sequence length T, the costs come from the engine's dry run on the meta device
       (`dry_run_costs`, what GPU workers run) with token ids [1, T] in the compute dtype;
    3. `partition(costs, workers, 1, device_memory)` succeeds or raises LayerTooLarge: the
       largest T that succeeds is found by secant steps on the margin, then doubling steps out from
       there and bisection (costs grow with T); each T is dry-run once.

Only one layer has to fit a stage, so the worker count does not change the answer (it
changes the plan, not the refusal); it is an argument because the plan at that length is returned.
Nor does `recompute="layer"` (RoundPipe's layer-grain recompute): a one-layer backward stage holds
the same bytes at either grain, and the planner already cuts stages down to one layer when memory
binds.  What layer grain changes is the plan: its backward stages may hold more layers at that length
(`ContextFit.plan`), since a stage then holds one layer's activations whatever its size.

What the model does not count (reported beside it, `ContextFit.head_workspace`): the LM-head loss.
The head layer hands (normed hidden, head weight) to the loss in the fused tail stage, so the dry
run stops before the loss; on CUDA the fused linear + cross-entropy (roundpipe.kernels) holds a
logits chunk, its fp32 weight-gradient accumulator, dh [T, H] and dW [V, H] while it runs, never
the full [T, V] logits.  Shapes: T tokens, H hidden, V vocabulary, b bytes per compute element.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from roundpipe.core.checks import check_int
from roundpipe.core.units import byte_unit, dtype_name
from roundpipe.planner.plan import Plan
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, QWEN3_32B

GiB = 1 << 30

# The built-in shapes (roundpipe/shapes.py: the published configs), by name; `roundpipe plan` runs them all.
SHAPES = {s.key: s for s in (QWEN3_1_7B, LLAMA_3_1_8B, QWEN3_32B)}
MAX_TOKENS = 1 << 24   # the search stops here (16M tokens); ContextFit.at_search_limit says so


@dataclass(frozen=True)
class LayerBytes:
    """What one layer needs in a backward stage at the fitted length, as the planner counts it."""

    index: int
    name: str            # "embedding", "decoder 5", "norm + LM head"
    weights: int         # compute-dtype weights uploaded for it
    gradients: int       # fp32 accumulators + one low-precision .grad of its trainable parameters
    activations: int     # activations and workspace at a backward stage's worst moment, one microbatch
    attention: int       # of which: fused attention's q, k, v, output and fp32 log-sum-exp

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.activations


@dataclass(frozen=True)
class ContextFit:
    """The longest sequence (batch 1, one microbatch) that the planner accepts under `device_memory`."""

    model: str                 # shape name or model_type
    seq_len: int
    device_memory: int         # the cap (RoundPipe's device_memory=), bytes
    workers: int
    dtype: torch.dtype         # compute dtype
    binding: LayerBytes        # the layer that would not fit one token more
    embedding: LayerBytes
    decoder: LayerBytes        # the largest decoder layer
    head: LayerBytes           # final norm + LM head
    head_workspace: int        # fused LM-head loss on CUDA: logits chunk, fp32 dW sum, dh, dW (not in the model)
    full_logits: int           # fp32 [T, V] logits, what an unfused loss would hold (for comparison)
    plan: Plan = field(repr=False)
    at_search_limit: bool = False   # seq_len == MAX_TOKENS: it fits at least this long
    # the most one stage may hold: half the cap, or the cap less what the largest one-layer neighbouring
    # stage holds when one layer does not fit half (planner.cap_stage_limit)
    stage_limit: int = 0
    recompute: str = "stage"   # the grain the plan was made for (RoundPipe's recompute=)

    def table(self) -> str:
        """Bytes per part at seq_len for the binding layer, the largest decoder layer, the head and the embedding."""
        unit, scale = byte_unit(self.device_memory)
        rows = [("layer", "weights", "gradients", "activations", "(attention)", "total")]
        for lb in dict.fromkeys([self.binding, self.decoder, self.head, self.embedding]):
            rows.append((lb.name, *(f"{v / scale:.2f}" for v in (lb.weights, lb.gradients, lb.activations,
                                                                  lb.attention, lb.total))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"{self.model}: {self.seq_len:,} tokens{' or more' if self.at_search_limit else ''} (batch 1) "
                 f"under a {self.device_memory / scale:.2f} {unit} cap, {self.workers} worker(s), {dtype_name(self.dtype)}, "
                 f"recompute={self.recompute!r} ({len(self.plan.backward)} backward stages); {unit} per part:"]
        lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        lines.append(f"  stage limit {self.stage_limit / scale:.2f} {unit} (the rest holds neighbouring stages); LM-head loss workspace "
                     f"{self.head_workspace / scale:.2f} {unit}, not counted (fp32 [T, V] logits: "
                     f"{self.full_logits / scale:.2f} {unit})")
        return "\n".join(lines)


def load_config(config: Any):
    """A transformers config from a config object, a dict with model_type, a SHAPES name, a config.json
    path or a folder holding one (nothing is downloaded)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if text.lower() in SHAPES:
            config = SHAPES[text.lower()].hf_config()
        elif os.path.isdir(text) and os.path.isfile(os.path.join(text, "config.json")):
            return AutoConfig.from_pretrained(text, local_files_only=True)
        elif os.path.isfile(text):
            try:
                with open(text) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"config={text!r}: not a readable JSON config ({e})") from None
        else:
            raise ValueError(f"config={text!r} is neither a built-in shape ({', '.join(SHAPES)}) nor a config.json "
                             "file or a folder holding one (the hub is not reached)")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a transformers config, a dict, a shape name or a path, "
                        f"got {type(config).__name__}")
    kwargs = dict(config)
    model_type = kwargs.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"config has model_type={model_type!r}; a dict config needs its model_type (e.g. 'qwen3')")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as e:
        raise ValueError(f"config: model_type={model_type!r} is not known to transformers ({e})") from None


def meta_layers(config) -> list[nn.Module]:
    """The roundpipe layers `rp.hf.wrap` would cut the model into, built on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM

    from roundpipe.hf.model import cut_layers
    from roundpipe.hf.presets import PRESETS

    if getattr(config, "model_type", None) not in PRESETS:
        raise ValueError(f"config: model_type={getattr(config, 'model_type', None)!r} has no roundpipe preset; the "
                         f"meta-device model cannot run the generic cut's check; presets: {sorted(PRESETS)}")
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    return cut_layers(hf_model)   # not quantized, as wrap's default


class _AttentionBytes(torch.overrides.TorchFunctionMode):
    """Per dry run, the bytes the engine's estimate charges to attention (dry_run.fused_attention_bytes),
    collected per call."""

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            from roundpipe.engine.dry_run import fused_attention_bytes
            nbytes = fused_attention_bytes(args, kwargs, out)
            if nbytes:
                self.calls.append(nbytes)
        return out


def layer_costs(layers: list[nn.Module], seq_len: int, dtype: torch.dtype, attention: list[int] | None = None):
    """The engine's dry-run costs (GPU workers' meta path) of token ids [1, seq_len]; `attention`, when given,
    receives each layer's attention bytes."""
    from roundpipe.engine.dry_run import RATES, dry_run_costs

    # head="loss": the head hands (normed hidden, weight) to the loss, as in forward_backward (hf/layers.py)
    sample = ((), {"input_ids": torch.zeros(1, seq_len, dtype=torch.long), "attention_mask": None,
                   "position_ids": None, "head": "loss"})
    mode = _AttentionBytes()
    with mode:
        costs = dry_run_costs(layers, sample, dtype, RATES["cuda"], "meta")
    if attention is not None:
        attention[:] = _split_attention(layers, mode.calls)
    return costs


def _split_attention(layers: list[nn.Module], calls: list[int]) -> list[int]:
    """Attention bytes per layer: one SDPA call per decoder layer, in order; none for the others."""
    from roundpipe.hf.layers import Decoder

    out, it = [], iter(calls)
    for layer in layers:
        out.append(next(it, 0) if isinstance(layer, Decoder) else 0)
    return out


def _fits(costs, workers: int, device_memory: int, layer_grain: bool = False) -> Plan | None:
    from roundpipe.planner.partition import LayerTooLarge, partition_for_cap

    try:   # the engine's rule for GPU workers (they prefetch)
        return partition_for_cap(costs, workers, 1, device_memory, prefetch=True, layer_grain=layer_grain).plan
    except LayerTooLarge:
        return None


def _stage_limit(costs, device_memory: int) -> int:
    from roundpipe.planner.partition import cap_stage_limit
    return int(cap_stage_limit(costs, device_memory, prefetch=True))


def _head_workspace(seq_len: int, hidden: int, vocab: int, itemsize: int) -> int:
    """The fused LM-head loss's bytes while it runs (CUDA): temporaries plus the dh and dW it returns."""
    from roundpipe.kernels.linear_cross_entropy import chunk_costs, default_chunk_size

    chunk = default_chunk_size(seq_len, hidden, vocab, itemsize)
    c = chunk_costs(seq_len, hidden, vocab, chunk, itemsize)
    return c.temporary_bytes + c.gradient_bytes


def _need(c) -> float:
    """One layer's bytes in a backward stage, as the partitioner counts them (planner.costs.backward_memory)."""
    from roundpipe.planner.costs import backward_memory
    return backward_memory([c], range(1))


def _names(layers: list[nn.Module]) -> list[str]:
    return ["embedding"] + [f"decoder {i}" for i in range(len(layers) - 2)] + ["norm + LM head"]


def _guess(margin) -> int:
    """Where the search starts: the length at which `margin(T)` (the stage limit less the largest layer's need)
    reaches 0.  Both are close to affine in T (saved activations grow with the tokens; the limit gives up what
    a one-layer neighbour holds), so secant steps from two dry runs land within a few tokens of the answer
    (Qwen3-1.7B at 24 GiB: 284,511, 137,072, then 143,355, the answer: 7 dry runs in all, where stepping
    out by 1% from one line through each layer's need, 14% off, and bisecting took 25)."""
    a, b = 1024, 2048
    ma, mb = margin(a), margin(b)
    for _ in range(4):
        slope = (mb - ma) / (b - a)
        if slope >= 0:   # the margin does not shrink as T grows: no limit in sight from here
            return MAX_TOKENS if mb > 0 else 1
        t = max(1, min(round(b - mb / slope), MAX_TOKENS))
        if t in (a, b):
            break
        a, ma, b, mb = b, mb, t, margin(t)
    return b


def _bracket(plan_at, guess: int) -> tuple[int, int]:
    """(lo, hi) with plan_at(lo) fitting and hi = lo + 1 or not fitting (or past MAX_TOKENS), stepping
    out from the guess by doubling steps; then bisection closes it (plan_at(1) fits)."""
    step = 1   # the guess is within a few tokens (_guess): stepping out from it doubles
    if plan_at(guess) is not None:
        lo, hi = guess, guess + step
        while hi <= MAX_TOKENS and plan_at(hi) is not None:
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, MAX_TOKENS + 1)
    else:
        lo, hi = max(1, guess - step), guess
        while lo > 1 and plan_at(lo) is None:
            hi, step = lo, step * 2
            lo = max(1, lo - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan_at(mid) is not None:
            lo = mid
        else:
            hi = mid
    return lo, hi


def max_seq_len(config: Any, device_memory: int, workers: int = 1, dtype: torch.dtype = torch.bfloat16,
                recompute: str = "stage") -> ContextFit:
    """The longest sequence (batch 1, one microbatch) for which the planner accepts every layer under
    `device_memory` (the cap RoundPipe's device_memory= sets, bytes), and what takes the space there.

    config: a transformers config, a dict with model_type, a shape name in SHAPES, a config.json path or
    a folder holding one.  workers: the worker count the plan is made for (it does not move the limit).
    dtype: the compute dtype (bf16 on GPU workers, fp32 on CPU workers by default).  recompute: RoundPipe's
    recompute= the plan is made for, "stage" or "layer" (it does not move the limit either: module docstring)."""
    check_int("device_memory", device_memory, 1)
    check_int("workers", workers, 1)
    from roundpipe.engine.config import RECOMPUTE_MODES
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} must be 'stage' or 'layer' (RoundPipe's recompute= grain)")
    grain = recompute == "layer"
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype (torch.bfloat16, torch.float16, torch.float32)")
    name = config.lower() if isinstance(config, str) and config.lower() in SHAPES else None
    cfg = load_config(config)
    layers = meta_layers(cfg)
    dry_runs: dict[int, tuple[list, list[int]]] = {}   # T -> (costs, attention bytes per layer): each T once

    def costs_at(t: int) -> tuple[list, list[int]]:
        if t not in dry_runs:
            attention: list[int] = []
            dry_runs[t] = layer_costs(layers, t, dtype, attention), attention
        return dry_runs[t]

    def plan_at(t: int) -> Plan | None:
        return _fits(costs_at(t)[0], workers, device_memory, grain)

    def margin(t: int) -> float:
        costs = costs_at(t)[0]
        return _stage_limit(costs, device_memory) - max(_need(c) for c in costs)

    if plan_at(1) is None:
        costs = costs_at(1)[0]
        worst = max(range(len(costs)), key=lambda i: _need(costs[i]))
        raise ValueError(f"device_memory={device_memory:,}: even one token does not fit; {_names(layers)[worst]} "
                         f"needs {_need(costs[worst]):,.0f} bytes in a backward stage, more than a stage may "
                         f"hold ({_stage_limit(costs, device_memory):,}); raise device_memory")
    lo, hi = _bracket(plan_at, _guess(margin))
    seq = lo
    costs, attention = costs_at(seq)
    nxt = costs_at(seq + 1)[0]
    limit = _stage_limit(nxt, device_memory)
    over = [i for i, c in enumerate(nxt) if _need(c) > limit]
    binding = over[0] if over else max(range(len(costs)), key=lambda i: _need(costs[i]))
    names = _names(layers)
    parts = [LayerBytes(i, names[i], int(c.param_bytes), int(c.grads), int(_need(c) - c.param_bytes - c.grads),
                        attention[i]) for i, c in enumerate(costs)]
    decoder = max(parts[1:-1], key=lambda p: p.total)
    itemsize = torch.empty((), dtype=dtype).element_size()
    head_w = layers[-1].lm_head.weight
    vocab, hidden = head_w.shape
    return ContextFit(model=name or str(getattr(cfg, "model_type", "?")), seq_len=seq, device_memory=device_memory,
                      workers=workers, dtype=dtype, binding=parts[binding], embedding=parts[0], decoder=decoder,
                      head=parts[-1], head_workspace=_head_workspace(seq, hidden, vocab, itemsize),
                      full_logits=seq * vocab * 4, plan=_fits(costs, workers, device_memory, grain),
                      at_search_limit=seq >= MAX_TOKENS, stage_limit=_stage_limit(costs, device_memory),
                      recompute=recompute)
