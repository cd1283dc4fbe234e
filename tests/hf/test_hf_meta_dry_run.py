"""The planner's dry run on the meta device (what GPU workers run) with inputs whose values decide
a branch: a padded attention mask makes transformers' mask builder ask `.all().item()` of it.

Before roundpipe/engine/dry_run.py's SmallDataOnCpu this failed with "Tensor.item() cannot be
called on meta tensors" and the planner fell back to parameter counts, so on a GPU every padded
HF batch was planned without its activations."""
import warnings

import pytest
import torch

import roundpipe as rp

pytest.importorskip("transformers")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from roundpipe.engine.autoplan import size_costs  # noqa: E402
from roundpipe.engine.dry_run import RATES, dry_run_costs  # noqa: E402


def _wrapped(model_type):
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return rp.hf.wrap(AutoModelForCausalLM.from_config(cfg), devices=["cpu"])


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_padded_mask_is_planned_on_the_meta_device_as_on_the_cpu(model_type):
    model = _wrapped(model_type)
    try:
        layers = list(model.module)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[0, :5] = 0   # left padding: the mask builder cannot skip the mask
        sample = ((ids,), {"attention_mask": mask})
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # the fallback to parameter counts warns
            meta = size_costs(layers, sample, torch.bfloat16, "cuda")
        with sdpa_kernel(SDPBackend.MATH):
            cpu = dry_run_costs(layers, sample, torch.bfloat16, RATES["cpu"], "cpu")
        assert [c.act_bytes for c in meta] == [c.act_bytes for c in cpu]
        assert [c.memory for c in meta] == [c.memory for c in cpu]
        assert all(c.memory.recompute > 0 for c in meta[1:])
        assert mask[0, :5].eq(0).all() and ids.device.type == "cpu"   # the caller's tensors untouched
    finally:
        model.close()
