"""roundpipe.shapes: every named shape counts the parameters transformers builds from the same config."""
import dataclasses

import pytest
import torch

from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_235B_A22B, SHAPES, DecoderShape

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def meta_model(shape: DecoderShape):
    with torch.device("meta"):   # shapes only: no memory, no weights
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape.hf_config()))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_parameter_count_matches_the_transformers_model(shape):
    """parameters() equals the model's unique parameters (a tied head is the embedding's tensor, counted once),
    and one decoder layer's tensors are the model's, in count and sizes."""
    model = meta_model(shape)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == shape.tied
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert sorted(shape.layer_numels()) == sorted(p.numel() for p in layer.parameters())
    assert len(shape.parameter_numels()) == len(list(model.parameters()))


def test_active_parameters_of_an_moe_layer():
    """A token uses the top-k of the experts: Qwen3-235B-A22B is ~22 B active with the embedding and head."""
    dense = LLAMA_3_1_8B
    assert dense.layer_parameters(active=True) == dense.layer_parameters()
    m = QWEN3_235B_A22B
    gap = (m.experts - m.experts_per_token) * m.expert_parameters()
    assert m.layer_parameters() - m.layer_parameters(active=True) == gap
    active = m.parameters() - m.layers * gap
    assert 21e9 < active < 23e9 and 234e9 < m.parameters() < 236e9


def test_tensor_bytes_and_keys():
    """tensor_bytes scales each tensor; SHAPES is keyed by the lower-cased published name."""
    assert LLAMA_3_1_8B.tensor_bytes(4) == [4 * n for n in LLAMA_3_1_8B.parameter_numels()]
    assert SHAPES["llama-3.1-8b"] is LLAMA_3_1_8B and all(k == s.name.lower() for k, s in SHAPES.items())


@pytest.mark.parametrize("change, match", [
    (dict(hidden=0), r"hidden=0 must be an int >= 1"),
    (dict(layers=-1), r"layers=-1 must be an int >= 1"),
    (dict(vocab=1.5), r"vocab=1.5 must be an int"),
    (dict(head_dim=True), r"head_dim=True must be an int"),
    (dict(kv_heads=3), r"heads=32 must be a multiple of kv_heads=3"),
    (dict(name=""), r"name=''"),
    (dict(tied=1), r"tied=1 must be a bool"),
    (dict(model_type="gpt2"), r"model_type='gpt2' must be one of"),
    (dict(experts=8), r"experts=8 with model_type='llama'"),
    (dict(model_type="qwen3_moe"), r"experts=0 with model_type='qwen3_moe'"),
    (dict(model_type="qwen3_moe", experts=8, experts_per_token=9, expert_intermediate=4),
     r"experts_per_token=9 must be in \[1, experts=8\]"),
    (dict(model_type="qwen3_moe", experts=8, experts_per_token=2), r"expert_intermediate=0 must be >= 1"),
    (dict(max_positions=0), r"max_positions=0"),
])
def test_bad_fields_are_named(change, match):
    """A bad field raises ValueError naming the field, its value and the constraint."""
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LLAMA_3_1_8B, **change)
