"""The built-in decoder-only transformer of `roundpipe train`, as a list of layers.

A Llama-shaped byte-level language model: token embedding, `layers` pre-norm decoder
blocks (RMSNorm, causal self-attention with rotary position embeddings through
`F.scaled_dot_product_attention`, RMSNorm, SwiGLU MLP, residual adds) and a final
norm + LM head.  `build_layers` returns these as separate modules because that is
the form RoundPipe cuts into stages: layer 0 takes the input ids, every later layer
the previous one's hidden states, the last one returns logits.  The head is not tied
to the embedding: tied weights would join the first and the last stage.

Shapes:  B batch, T sequence, H hidden, nh heads, hd = H / nh head dim, V vocab,
         F SwiGLU width.

    Embedding     int64 [B, T]     -> [B, T, H]
    DecoderBlock  [B, T, H]        -> [B, T, H]   (q, k, v: [B, nh, T, hd]; MLP [B, T, F])
    Head          [B, T, H]        -> [B, T, V]   logits
    loss_fn       [B, T, V], int64 [B, T] -> scalar mean cross-entropy over B*T bytes

Rotary tables are computed in each block's forward (a [T, hd/2] outer product,
negligible next to the matmuls) instead of being stored as buffers, so a stage
that is shipped to a worker carries its parameters and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.core.checks import is_int


@dataclass(frozen=True)
class DecoderConfig:
    """Size of the decoder; `intermediate` defaults to ~8/3 * hidden rounded up to a multiple of 64."""

    vocab_size: int = 256
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads} "
                             f"into an even head dimension (rotary embeddings rotate pairs)")
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", -(-8 * self.hidden // 3 // 64) * 64)
        elif not isinstance(self.intermediate, int) or self.intermediate < 1:
            raise ValueError(f"intermediate={self.intermediate!r} must be a positive int or None")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(f"rope_theta={self.rope_theta}, norm_eps={self.norm_eps} and "
                             f"init_std={self.init_std} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        h, f = self.hidden, self.intermediate
        block = 4 * h * h + 3 * h * f + 2 * h
        return 2 * self.vocab_size * h + self.layers * block + h


# name -> size.  "tiny" is the CPU default (~0.8M parameters; learns visibly in a minute on
# two cores), "small" the GPU default, "0.8b" the size for tokens/s on a GPU.
PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(hidden=128, layers=4, heads=4),
    "small": DecoderConfig(hidden=512, layers=8, heads=8),
    "base": DecoderConfig(hidden=1024, layers=16, heads=16),
    "0.8b": DecoderConfig(hidden=2048, layers=16, heads=16),
}


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotates pairs (x[..., i], x[..., i + hd/2]) of x [B, nh, T, hd] by position * theta^(-2i/hd)."""
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)  # [T, hd/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Embedding(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.theta = cfg.heads, cfg.rope_theta
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hd]
        return self.out(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _init(module: nn.Module, cfg: DecoderConfig) -> None:
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            # GPT-2's scaling: projections that write into the residual stream shrink
            # with depth so the residual's variance stays ~constant at initialisation.
            scale = (2 * cfg.layers) ** -0.5 if name.endswith(("out.weight", "down.weight")) else 1.0
            nn.init.normal_(p, std=cfg.init_std * scale)


def build_layers(cfg: DecoderConfig | str = "tiny", *, seed: int | None = None) -> list[nn.Module]:
    """[Embedding, DecoderBlock x cfg.layers, Head], fp32 on the CPU; `seed` fixes the init."""
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise ValueError(f"size={cfg!r} is not a preset; choose one of {sorted(PRESETS)}")
        cfg = PRESETS[cfg]
    if not isinstance(cfg, DecoderConfig):
        raise TypeError(f"cfg must be a DecoderConfig or a preset name, got {type(cfg).__name__}")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        layers = [Embedding(cfg), *(DecoderBlock(cfg) for _ in range(cfg.layers)), Head(cfg)]
        for layer in layers:
            _init(layer, cfg)
    return layers


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of logits [B, T, V] against labels [B, T], in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
