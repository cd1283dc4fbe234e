"""Model shapes: the sizes of a decoder-only transformer and the one parameter-count formula.

The planner's benches (bench/schedules.py, bench/host_step_sim.py, bench/qlora_sim.py), the host
footprint (roundpipe/offload/footprint.py) and the long-context fit (roundpipe/hf/context.py) all
take their models from here, so a layer has the same size everywhere.  The named shapes are the
models' published config.json values; tests/test_shapes.py checks every count against a model that
transformers builds from the same config on the meta device.

Tensors of one decoder layer, in forward order (H hidden, Q = heads x head_dim, K = kv_heads x
head_dim, I intermediate, E experts, Ie an expert's intermediate):

    input norm [H], q [Q, H], k [K, H], v [K, H], (qwen3: q norm, k norm [head_dim]), o [H, Q],
    post-attention norm [H], then a gated MLP gate/up/down [I, H] x 3, or (qwen3_moe) the router
    [E, H] and the experts as transformers stores them: gate_up [E, 2 Ie, H], down [E, H, Ie]

and around the layers the embedding [V, H], the final norm [H] and, unless tied, the LM head [V, H].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from roundpipe.core.checks import is_int

ModelType = Literal["llama", "qwen3", "qwen3_moe"]
MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")   # families with an RMSNorm on each head's queries and keys


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only transformer (Llama / Qwen3 / Qwen3-MoE style)."""

    name: str                 # the published model name, e.g. "Qwen3-1.7B"; SHAPES key: name.lower()
    hidden: int               # hidden_size, H
    intermediate: int         # intermediate_size of the dense MLP (present in MoE configs, unused there)
    layers: int               # num_hidden_layers
    vocab: int                # vocab_size, V
    heads: int                # num_attention_heads (query heads)
    kv_heads: int             # num_key_value_heads (GQA: heads is a multiple of it)
    head_dim: int             # per head; hidden // heads where the config does not say
    tied: bool = False        # tie_word_embeddings: the LM head is the embedding's tensor
    model_type: ModelType = "llama"   # the transformers family; qwen3* add q/k norms
    experts: int = 0          # num_experts of every layer's MoE block (0: dense MLP)
    experts_per_token: int = 0        # num_experts_per_tok (top-k routing)
    expert_intermediate: int = 0      # moe_intermediate_size, Ie
    max_positions: int = 4096         # max_position_embeddings (no parameters; the configs carry it)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty str")
        for field in ("hidden", "intermediate", "layers", "vocab", "heads", "kv_heads", "head_dim", "max_positions"):
            _check_int(field, getattr(self, field), 1)
        for field in ("experts", "experts_per_token", "expert_intermediate"):
            _check_int(field, getattr(self, field), 0)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads} (grouped-query attention)")
        if not isinstance(self.tied, bool):
            raise ValueError(f"tied={self.tied!r} must be a bool")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} must be one of {MODEL_TYPES}")
        if (self.model_type == "qwen3_moe") != (self.experts > 0):
            raise ValueError(f"experts={self.experts} with model_type={self.model_type!r}: MoE shapes are qwen3_moe, "
                             "with experts >= 1; dense ones have experts=0")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in [1, experts={self.experts}]")
        if self.experts and self.expert_intermediate < 1:
            raise ValueError(f"expert_intermediate={self.expert_intermediate} must be >= 1 with experts={self.experts}")

    @property
    def key(self) -> str:
        return self.name.lower()

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_numels(self) -> list[int]:
        """q, k, v, o projections (no biases in these families)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return [q * h, kv * h, kv * h, h * q]

    def expert_parameters(self) -> int:
        """One expert's gate, up and down projections (0 for a dense shape)."""
        return 3 * self.hidden * self.expert_intermediate if self.experts else 0

    def layer_numels(self) -> list[int]:
        """Element counts of one decoder layer's parameter tensors, in forward order (module docstring)."""
        h = self.hidden
        q, k, v, o = self.attention_numels()
        norms = [self.head_dim, self.head_dim] if self.model_type in QK_NORM else []
        if self.experts:
            mlp = [self.experts * h, self.experts * 2 * self.expert_intermediate * h, self.experts * h * self.expert_intermediate]
        else:
            mlp = [self.intermediate * h] * 3
        return [h, q, k, v, *norms, o, h, *mlp]

    def layer_parameters(self, active: bool = False) -> int:
        """One decoder layer's parameters; `active`: those one token uses (top-k experts of an MoE layer)."""
        n = sum(self.layer_numels())
        if active and self.experts:
            n -= (self.experts - self.experts_per_token) * self.expert_parameters()
        return n

    def parameter_numels(self) -> list[int]:
        """Element counts of every parameter tensor, in forward order: embedding, layers, final norm,
        LM head (absent when tied: it is the embedding's tensor)."""
        head = [] if self.tied else [self.vocab * self.hidden]
        return [self.vocab * self.hidden] + self.layer_numels() * self.layers + [self.hidden] + head

    def parameters(self) -> int:
        """The model's parameter count (a tied head counted once)."""
        return sum(self.parameter_numels())

    def tensor_bytes(self, bytes_per_element: int = 2) -> list[int]:
        """Byte sizes of every parameter tensor at `bytes_per_element` (2: the bf16 upload copy)."""
        return [n * bytes_per_element for n in self.parameter_numels()]

    def hf_config(self) -> dict[str, Any]:
        """The transformers config fields (`AutoConfig.for_model(**shape.hf_config())`) of this shape."""
        out = dict(model_type=self.model_type, hidden_size=self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                   intermediate_size=self.intermediate, vocab_size=self.vocab, tie_word_embeddings=self.tied,
                   max_position_embeddings=self.max_positions)
        if self.experts:   # every layer sparse, as the published Qwen3 MoE configs
            out.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
        return out


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


# The published config.json values (Hugging Face hub: Qwen/Qwen3-*, meta-llama/Llama-3.1-8B).
QWEN3_1_7B = DecoderShape("Qwen3-1.7B", 2048, 6144, 28, 151936, 16, 8, 128, tied=True, model_type="qwen3",
                          max_positions=40960)
QWEN3_4B = DecoderShape("Qwen3-4B", 2560, 9728, 36, 151936, 32, 8, 128, tied=True, model_type="qwen3",
                        max_positions=40960)
LLAMA_3_1_8B = DecoderShape("Llama-3.1-8B", 4096, 14336, 32, 128256, 32, 8, 128, max_positions=131072)
QWEN3_32B = DecoderShape("Qwen3-32B", 5120, 25600, 64, 151936, 64, 8, 128, model_type="qwen3", max_positions=40960)
QWEN3_235B_A22B = DecoderShape("Qwen3-235B-A22B", 4096, 12288, 94, 151936, 64, 4, 128, model_type="qwen3_moe",
                               experts=128, experts_per_token=8, expert_intermediate=1536, max_positions=40960)
SHAPES = {s.key: s for s in (QWEN3_1_7B, QWEN3_4B, LLAMA_3_1_8B, QWEN3_32B, QWEN3_235B_A22B)}
