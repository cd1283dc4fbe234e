"""The largest image or the longest video a diffusion transformer trains with under a device-memory cap.

    fit = rp.diffusers.max_resolution("flux-dev", device_memory=24 << 30, lora=True)   # square, batch 1
    fit.height, fit.binding, fit.table()
    fit = rp.diffusers.max_frames("wan2.1-14b", height=480, width=832)                # 4k + 1 frames

Like `rp.hf.max_seq_len` (roundpipe/hf/context.py), the prediction is the engine's own refusal rule on the
layers the engine would run, not a second model of it:

    1. the transformer is built from its config on the meta device (no weights, no download; with
       `lora`, PEFT adapters are added as `transformer.add_adapter` adds them) and cut as
       `rp.diffusers.wrap` cuts it (roundpipe/diffusers/layers.py `cut_layers`: input layer, one layer
       per block, output layer);
    2. at a size, the first layer's call is `rp.diffusers.example_inputs(...)` of that many pixels
       (and frames) on the meta device, and the costs come from the engine's dry run of it
       (`dry_run_costs`, what GPU workers run; attention counted as the fused kernel keeps it);
    3. `partition_for_cap(costs, workers, 1, device_memory, prefetch=device == "cuda")` (the engine's
       `_solver`: GPU workers prefetch the next stage, CPU workers do not) succeeds or raises
       LayerTooLarge (each layer's weights, gradient accumulators, one microbatch's saved activations
       and workspace within `cap_stage_limit`): the largest size that succeeds is found by secant
       steps on the margin in tokens (costs are close to affine in them), then stepping out and
       bisection.  FLUX.1-dev at 24 GiB: 5 dry runs of ~2 s on a 2-core CPU.

The sizes searched are what the model accepts: image sides in multiples of 16 px for all three (VAE 8 x
patch 2), and Wan's frame counts 4k + 1 (its causal VAE keeps the first frame and packs each 4 after it);
tokens = latent frames x (H / 16) x (W / 16) beside the text's (roundpipe/diffusers/shapes.py).  SD3's
position table stops at `pos_embed_max_size` patches a side (3,072 px for 3.5 Large) and Wan's rotary
tables at `rope_max_seq_len` positions an axis: a cap that fits more is reported at that limit
(`at_search_limit`), as is MAX_SIDE for Flux.

What the prediction does not count: the VAE and the text encoders (frozen, run once per sample before
training or on the host: not on the workers, not trained); CUDA's context and allocator slack (the cap is
what RoundPipe(device_memory=) allots, not the card).  The flow-matching loss on the output is counted, as
the engine counts it: `train.diffusion_loss` on a target of the output's shape, measured on the last layer
(an MSE over the latents: MiBs, beside GiBs of a block).
Every answer is predicted by the planner's memory model and unmeasured on a GPU until a GPU run says
otherwise (`DiTFit.PREDICTED`).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from roundpipe.core.checks import check_int
from roundpipe.core.units import byte_unit, dtype_name
from roundpipe.hf.context import LayerBytes
from roundpipe.planner.plan import Plan

GiB = 1 << 30
MAX_SIDE = 1024   # latent tokens a side, latent frames: the search stops here (Wan's rotary tables hold 1024 a side)
DEFAULT_FRAMES = 81   # Wan2.1's clips: 5 s at 16 fps (its pipeline's num_frames default)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
LORA_RANK = 16


@dataclass(frozen=True)
class DiTFit:
    """The largest size (batch `batch`, one microbatch) that the planner accepts under `device_memory`."""

    PREDICTED = "predicted by the planner's memory model (meta-device dry run), unmeasured on GPU"

    model: str
    question: Literal["resolution", "frames"]
    height: int                # pixels
    width: int
    frames: int | None         # video frames (Wan), None for images
    tokens: int                # latent tokens of one sample at this size (text excluded)
    text_tokens: int
    batch: int
    device_memory: int         # the cap (RoundPipe's device_memory=), bytes
    workers: int
    dtype: torch.dtype
    lora: bool                 # PEFT LoRA adapters trained over a frozen base (else full fine-tuning)
    binding: LayerBytes        # the layer that would not fit one step more
    layers: tuple[LayerBytes, ...] = field(repr=False)
    refused: str = ""          # the next size up, which the planner refuses ("" at the search limit)
    stage_limit: int = 0       # what one stage may hold (planner.cap_stage_limit)
    plan: Plan | None = field(default=None, repr=False)
    at_search_limit: bool = False   # the model's (or MAX_SIDE's) largest size fits: it fits at least this
    device: str = "cuda"       # the workers planned for: "cuda" (prefetching GPU workers) or "cpu"

    @property
    def answer(self) -> int:
        """The height in pixels (resolution) or the frame count (frames)."""
        return self.height if self.question == "resolution" else int(self.frames)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}" + ("" if self.frames is None else f"x{self.frames}f")

    def largest(self) -> list[LayerBytes]:
        """The binding layer, then the largest of each kind of layer (input, each block kind, output)."""
        kinds: dict[str, LayerBytes] = {}
        for lb in self.layers:
            kind = lb.name.rsplit(" ", 1)[0] if lb.name[-1].isdigit() else lb.name
            if kind not in kinds or lb.total > kinds[kind].total:
                kinds[kind] = lb
        return list(dict.fromkeys([self.binding, *kinds.values()]))

    def table(self) -> str:
        """Bytes per part at the answer for the binding layer and the largest layer of each kind."""
        unit, scale = byte_unit(self.device_memory)
        rows = [("layer", "weights", "gradients", "activations", "(attention)", "total")]
        for lb in self.largest():
            rows.append((lb.name, *(f"{v / scale:.2f}" for v in (lb.weights, lb.gradients, lb.activations,
                                                                  lb.attention, lb.total))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        what = "LoRA" if self.lora else "full fine-tuning"
        lines = [f"{self.model}: {self.size}{' or more' if self.at_search_limit else ''} ({self.tokens:,} latent + "
                 f"{self.text_tokens} text tokens a sample, batch {self.batch}) under a {self.device_memory / scale:.2f} "
                 f"{unit} cap, {what}, {self.workers} {'GPU' if self.device == 'cuda' else 'CPU'} worker(s), "
                 f"{dtype_name(self.dtype)}; {unit} per part:"]
        lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in rows]
        tail = f"refused at {self.refused}; " if self.refused else ""
        lines.append(f"  stage limit {self.stage_limit / scale:.2f} {unit}; {tail}not counted: VAE, text encoders "
                     "(not on the workers)")
        lines.append(f"  {self.PREDICTED}")
        return "\n".join(lines)


def _need(c) -> float:
    """One layer's bytes in a backward stage, as the partitioner counts them (planner.costs.backward_memory)."""
    from roundpipe.planner.costs import backward_memory
    return backward_memory([c], range(1))


# ---- the model and its layers

def load_shape(model: Any):
    """A DiTShape from a shape, a SHAPES key, or a dict config with `_class_name` (diffusers' config.json)."""
    from roundpipe.diffusers.shapes import CLASSES, SHAPES, DiTShape

    if isinstance(model, DiTShape):
        return model
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if text.lower() in SHAPES:
            return SHAPES[text.lower()]
        if os.path.isdir(text) and os.path.isfile(os.path.join(text, "config.json")):
            text = os.path.join(text, "config.json")
        if not os.path.isfile(text):
            raise ValueError(f"model={text!r} is neither a built-in shape ({', '.join(SHAPES)}) nor a diffusers "
                             "transformer config.json or a folder holding one (the hub is not reached)")
        try:
            with open(text) as f:
                model = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"model={text!r}: not a readable JSON config ({e})") from None
    if isinstance(model, dict):
        config = dict(model)
        name = config.pop("_class_name", None)
        config.pop("_diffusers_version", None)
        if name not in CLASSES:
            raise ValueError(f"model: a config dict needs _class_name, one of {CLASSES}; got {name!r}")
        video = name == "WanTransformer3DModel"
        return DiTShape(name, name, "(config)", name, config, kind="video" if video else "image",
                        temporal=4 if video else 1, max_latent=config.get("pos_embed_max_size"))
    raise TypeError(f"model must be a shape name, a DiTShape, a config dict or a diffusers transformer, "
                    f"got {type(model).__name__}")


def _transformer(model: Any, lora: Any) -> tuple[nn.Module, str]:
    """(the transformer with adapters when asked, on the meta device unless given built, its name)."""
    if isinstance(model, nn.Module):
        transformer, name = model, type(model).__name__
        if lora:
            raise ValueError("lora=: give the transformer with its adapters added (transformer.add_adapter), or a "
                             "shape or config to add them to")
        return transformer, name   # the caller's: read, never changed (its processors stay its own)
    shape = load_shape(model)
    transformer, name = shape.build("meta"), shape.key
    if lora:
        transformer.add_adapter(lora_config(lora))
    _share_processors(transformer)
    return transformer, name


def _share_processors(transformer: nn.Module) -> None:
    """One attention processor object per class where they hold no state (diffusers makes one per module).

    The dry run measures a layer once and gives its cost to every later layer whose `layer_key` matches;
    the key compares an attribute that is an arbitrary object (a processor) by identity, so diffusers'
    per-module processors kept every block apart: 59 Flux layers measured at ~0.1 s each (6 s a dry run
    on 2 cores) where 4 are distinct.  Stateless processors of one class compute the same: sharing one
    changes no cost, only how many layers are measured."""
    shared: dict[type, Any] = {}
    for m in transformer.modules():
        p = getattr(m, "processor", None)
        if p is not None and hasattr(m, "set_processor") and not vars(p):
            m.processor = shared.setdefault(type(p), p)


def lora_config(lora: Any):
    """`lora=True`: rank 16 (alpha 16) on every attention projection, as diffusers' DreamBooth LoRA scripts
    for Flux and SD3 target them; a peft LoraConfig is taken as given."""
    from peft import LoraConfig

    if lora is True:
        return LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
                          target_modules=list(LORA_TARGETS))
    if isinstance(lora, LoraConfig):
        return lora
    raise TypeError(f"lora={lora!r} must be True, False or a peft LoraConfig")


def _names(layers: list[nn.Module]) -> list[str]:
    """'input', 'double block 0', 'single block 3' (Flux), 'block 5', 'output'."""
    out, seen = [], {}
    for i, layer in enumerate(layers):
        if i == 0:
            out.append("input")
        elif i == len(layers) - 1:
            out.append("output")
        else:
            cls = type(getattr(layer, "block", layer)).__name__
            kind = "single block" if "Single" in cls else "double block" if cls == "FluxTransformerBlock" else "block"
            out.append(f"{kind} {seen.get(kind, 0)}")
            seen[kind] = seen.get(kind, 0) + 1
    return out


def layer_costs(layers: list[nn.Module], sample: dict, dtype: torch.dtype, target: torch.Tensor | None = None):
    """The engine's dry-run costs (GPU workers' meta path) of the first layer called with `sample`; with `target`,
    the loss a training call hands the engine (train.diffusion_loss) measured on the last layer, as wrap's
    forward_backward has it measured."""
    from roundpipe.diffusers.train import diffusion_loss
    from roundpipe.engine.dry_run import RATES, dry_run_costs

    loss = None if target is None else (diffusion_loss, target)
    return dry_run_costs(layers, ((), sample), dtype, RATES["cuda"], "meta", loss)


def _target(transformer: nn.Module, sample: dict) -> torch.Tensor:
    """A meta tensor of the transformer's output shape: what forward_backward's target must be (model.py)."""
    cfg, x = transformer.config, sample["hidden_states"]
    out = getattr(cfg, "out_channels", None) or cfg.in_channels
    if x.dim() == 3:   # Flux: packed [b, S_img, p * p * C]
        shape = (*x.shape[:2], cfg.patch_size ** 2 * out)
    else:              # SD3 [b, C, H/8, W/8], Wan [b, C, F', H/8, W/8]
        shape = (x.shape[0], out, *x.shape[2:])
    return torch.empty(shape, dtype=torch.float32, device="meta")


class _AttentionBytes(torch.overrides.TorchFunctionMode):
    """Sums what the dry run charges to each SDPA call (dry_run.fused_attention_bytes) while it is on."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from roundpipe.engine.dry_run import fused_attention_bytes

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.total += fused_attention_bytes(args, kwargs, out)
        return out


def _meta_copy(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The layer with its weights as `dtype` meta tensors (buffers keep their dtype), as the dry run copies it."""
    memo: dict[int, Any] = {id(p): nn.Parameter(p.detach().to("meta", dtype), p.requires_grad) for p in layer.parameters()}
    memo.update({id(b): b.detach().to("meta") for b in layer.buffers()})
    return copy.deepcopy(layer, memo)


def attention_bytes(layers: list[nn.Module], sample: dict, dtype: torch.dtype) -> list[int]:
    """Per layer, what the dry run charges to attention (dry_run.fused_attention_bytes of each SDPA call: q, k, v,
    output, fp32 log-sum-exp), from one forward of meta copies.  A pass of its own: within the dry run a
    measured layer runs several forwards (memory_probe) and the calls cannot be told apart per layer."""
    from roundpipe.core.tree import tree_map
    from roundpipe.engine.dry_run import SmallDataOnCpu

    def to_meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return torch.empty_like(t, device="meta", dtype=dtype)

    out = []
    with SmallDataOnCpu(), torch.enable_grad():
        x = tree_map(to_meta, sample)
        for i, layer in enumerate(layers):
            mode = _AttentionBytes()
            with mode:
                replica = _meta_copy(layer, dtype)
                x = replica(**x) if i == 0 else replica(x)
            out.append(mode.total)
    return out


# ---- the engine's rule (engine/autoplan.py `_solver`: partition_for_cap, prefetching on GPU workers)

def _fits(costs, workers: int, device_memory: int, prefetch: bool) -> Plan | None:
    from roundpipe.planner.partition import LayerTooLarge, partition_for_cap

    try:
        return partition_for_cap(costs, workers, 1, device_memory, prefetch=prefetch).plan
    except LayerTooLarge:
        return None


def _stage_limit(costs, device_memory: int, prefetch: bool) -> int:
    from roundpipe.planner.partition import cap_stage_limit
    return int(cap_stage_limit(costs, device_memory, prefetch=prefetch))


# ---- the search

def _largest(fits: Callable[[int], bool], margin: Callable[[int], float], tokens: Callable[[int], int],
             limit: int) -> int:
    """The largest k in [1, limit] with fits(k) (fits(1) holds; fits is monotone).  Secant steps on the
    margin as a function of tokens(k) (close to affine: saved activations grow with the tokens), the
    k whose tokens are nearest below the zero, then stepping out from it by doubling and bisection."""
    def k_of(t: float) -> int:   # the largest k with tokens(k) <= t (tokens grows with k)
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens(mid) <= t else (lo, mid - 1)
        return lo

    a, b = max(1, limit // 16), max(2, limit // 8)
    a, b = min(a, limit), min(b, limit)
    guess = b
    if a < b:
        ma, mb = margin(a), margin(b)
        for _ in range(4):
            ta, tb = tokens(a), tokens(b)
            slope = (mb - ma) / (tb - ta)
            if slope >= 0:   # no limit in sight
                guess = limit if mb > 0 else 1
                break
            k = k_of(tb - mb / slope)
            guess = k
            if k in (a, b):
                break
            a, ma, b, mb = b, mb, k, margin(k)
    step = 1
    if fits(guess):
        lo, hi = guess, guess + step
        while hi <= limit and fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit + 1)
    else:
        lo, hi = max(1, guess - step), guess
        while lo > 1 and not fits(lo):
            hi, step = lo, step * 2
            lo = max(1, lo - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _check(dtype, batch, workers, device_memory, device) -> None:
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' (GPU workers, which prefetch the next stage) or 'cpu'")
    check_int("device_memory", device_memory, 1)
    check_int("batch", batch, 1)
    check_int("workers", workers, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype (torch.bfloat16, torch.float16, torch.float32)")


def _fit(model: Any, question: str, sizes: Callable[[int], tuple[int, int, int | None]], limit: int,
         device_memory: int, batch: int, dtype: torch.dtype, workers: int, lora: Any, text_len: int | None,
         device: str) -> DiTFit:
    """The search over k = 1..limit, sizes(k) = (height, width, frames) growing with k."""
    prefetch = device == "cuda"
    from roundpipe.diffusers.layers import cut_layers
    from roundpipe.diffusers.presets import FAMILIES, example_inputs, family

    transformer, name = _transformer(model, lora)
    kind = family(transformer)
    layers = cut_layers(transformer)
    text = FAMILIES[kind].text_len if text_len is None else text_len
    side = 16
    dry_runs: dict[int, list] = {}

    def tokens(k: int) -> int:
        h, w, f = sizes(k)
        return (1 if f is None else 1 + (f - 1) // 4) * (h // side) * (w // side)

    def sample(k: int) -> dict:
        h, w, f = sizes(k)
        return example_inputs(transformer, batch, h, w, f, dtype=dtype, device="meta", text_len=text_len)

    def costs_at(k: int) -> list:
        if k not in dry_runs:
            inputs = sample(k)
            dry_runs[k] = layer_costs(layers, inputs, dtype, _target(transformer, inputs))
        return dry_runs[k]

    def fits(k: int) -> bool:
        return _fits(costs_at(k), workers, device_memory, prefetch) is not None

    def margin(k: int) -> float:
        costs = costs_at(k)
        return _stage_limit(costs, device_memory, prefetch) - max(_need(c) for c in costs)

    names = _names(layers)
    if not fits(1):
        costs = costs_at(1)
        worst = max(range(len(costs)), key=lambda i: _need(costs[i]))
        h, w, f = sizes(1)
        raise ValueError(f"device_memory={device_memory:,}: even {w}x{h}{'' if f is None else f'x{f}f'} does not "
                         f"fit; {names[worst]} needs {_need(costs[worst]):,.0f} bytes in a backward stage, more than a "
                         f"stage may hold ({_stage_limit(costs, device_memory, prefetch):,}); raise device_memory"
                         + ("" if lora else " or train LoRA adapters (lora=True)"))
    k = _largest(fits, margin, tokens, limit)
    costs, attention = costs_at(k), attention_bytes(layers, sample(k), dtype)
    at_limit = k >= limit
    binding, refused = None, ""
    if not at_limit:
        nxt = costs_at(k + 1)
        cap = _stage_limit(nxt, device_memory, prefetch)
        over = [i for i, c in enumerate(nxt) if _need(c) > cap]
        binding = over[0] if over else None
        h, w, f = sizes(k + 1)
        refused = f"{w}x{h}" + ("" if f is None else f"x{f}f")
    if binding is None:
        binding = max(range(len(costs)), key=lambda i: _need(costs[i]))
    parts = tuple(LayerBytes(i, names[i], int(c.param_bytes), int(c.grads), int(_need(c) - c.param_bytes - c.grads),
                             attention[i]) for i, c in enumerate(costs))
    h, w, f = sizes(k)
    return DiTFit(model=name, question=question, height=h, width=w, frames=f, tokens=tokens(k), text_tokens=text,
                  batch=batch, device_memory=device_memory, workers=workers, dtype=dtype, lora=bool(lora),
                  binding=parts[binding], layers=parts, refused=refused,
                  stage_limit=_stage_limit(costs, device_memory, prefetch), plan=_fits(costs, workers, device_memory, prefetch),
                  at_search_limit=at_limit, device=device)


def _shape_limit(model: Any) -> tuple[int, bool]:
    """(the most latent tokens a side the model takes, whether it is a video model)."""
    if isinstance(model, nn.Module):
        cfg, video = dict(model.config), type(model).__name__ == "WanTransformer3DModel"
    else:
        shape = load_shape(model)
        cfg, video = shape.config, shape.kind == "video"
    # SD3's PatchEmbed crops a table of pos_embed_max_size patches a side; Wan's rotary tables hold
    # rope_max_seq_len positions per axis (latent frames, patches a side)
    limit = cfg.get("pos_embed_max_size") or cfg.get("rope_max_seq_len") or MAX_SIDE
    return min(limit, MAX_SIDE), video


def max_resolution(model: Any, device_memory: int = 24 * GiB, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                   frames: int | None = None, aspect: float = 1.0, lora: Any = False, workers: int = 1,
                   text_len: int | None = None, device: str = "cuda") -> DiTFit:
    """The largest image (height x round(height x aspect), multiples of 16 px) whose every layer the planner
    accepts under `device_memory` (RoundPipe's device_memory=, bytes), and what takes the space there.

    model: a built-in shape name ("flux-dev", "sd3.5-large", "sd3.5-medium", "wan2.1-14b"), a DiTShape, a
    diffusers transformer config dict with `_class_name`, or a Flux / SD3 / Wan transformer (its replicas
    are dry-run on the meta device; with its adapters if it has them).  batch: samples per microbatch.
    dtype: the compute dtype (bf16 on GPU workers).  frames: a video model's frame count (4k + 1; default
    81), None for image models.  aspect: width / height.  lora: True (rank 16 on the attention projections),
    a peft LoraConfig, or False (full fine-tuning).  workers: the worker count the plan is made for (it
    does not move the limit: only one layer has to fit a stage).  text_len: text tokens (default: the
    family's pipeline length, roundpipe/diffusers/presets.py).  device: the workers the plan is for, "cuda" (GPU
    workers prefetch the next stage, so a stage may hold less) or "cpu" (CPU workers, as the tests run them)."""
    _check(dtype, batch, workers, device_memory, device)
    if not isinstance(aspect, (int, float)) or isinstance(aspect, bool) or not 1 / 16 <= aspect <= 16:
        raise ValueError(f"aspect={aspect!r} must be a number in [1/16, 16] (width / height)")
    limit, video = _shape_limit(model)
    if video:
        frames = DEFAULT_FRAMES if frames is None else frames
        _check_frames(frames)
    elif frames is not None:
        raise ValueError(f"frames={frames!r} is for video models (Wan); an image model takes frames=None")
    if aspect > 1:   # the wider side stays within the model's limit
        limit = max(1, int(limit / aspect))

    def sizes(k: int) -> tuple[int, int, int | None]:
        return 16 * k, 16 * max(1, round(k * aspect)), frames

    return _fit(model, "resolution", sizes, limit, device_memory, batch, dtype, workers, lora, text_len,
                device)


def _check_frames(frames: Any) -> None:
    if not isinstance(frames, int) or isinstance(frames, bool) or frames < 1 or (frames - 1) % 4:
        raise ValueError(f"frames={frames!r} must be 4k + 1 (1, 5, 9, ..., 81): Wan's VAE keeps the first frame and "
                         "packs each 4 after it into one latent frame")


def max_frames(model: Any, device_memory: int = 24 * GiB, *, height: int, width: int, batch: int = 1,
               dtype: torch.dtype = torch.bfloat16, lora: Any = False, workers: int = 1,
               text_len: int | None = None, device: str = "cuda") -> DiTFit:
    """The most video frames (4k + 1) at height x width pixels (multiples of 16) whose every layer the planner
    accepts under `device_memory`; arguments as `max_resolution`'s.  Wan only."""
    _check(dtype, batch, workers, device_memory, device)
    for arg, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 16 or v % 16:
            raise ValueError(f"{arg}={v!r} must be a positive multiple of 16 pixels (VAE 8 x patch 2)")
    limit, video = _shape_limit(model)
    if not video:
        raise ValueError("model: max_frames is for video models (Wan); use max_resolution for images")
    if max(height, width) > 16 * limit:
        raise ValueError(f"height={height}, width={width}: past the model's {16 * limit} px a side")

    def sizes(k: int) -> tuple[int, int, int | None]:
        return height, width, 4 * (k - 1) + 1

    return _fit(model, "frames", sizes, limit, device_memory, batch, dtype, workers, lora, text_len,
                device)

