"""rp.hf's Embed hands its masks and rotary tables to its recompute: built once per microbatch, same results."""
import copy
import functools

import pytest
import torch

import roundpipe as rp
from roundpipe.hf import layers as hf_layers

transformers = pytest.importorskip("transformers")
from hf_grads import check_grads  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, masking_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

V, L, MB = 96, 3, 3
# rp layers: Embed, 3 decoders, Head.  The Embed (layer 0) runs in a forward stage and is recomputed in the
# last backward stage.
PLAN = rp.Plan(forward=[range(0, 2)], backward=[range(2, L + 2), range(0, 2)])


def tiny_llama():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=L, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg).float()


def padded_batch(b=6, t=10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (b, t), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate([t, 4, t - 1, 2, 7, 5]):
        mask[i, :t - n] = 0   # left padding: every microbatch's mask must be built (no causal skip)
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.fixture
def counts(monkeypatch):
    """Calls of HF's mask builder (with its allow_is_causal_skip), its skip check (the host sync on CUDA) and
    the rotary embedding, on every thread."""
    seen = {"mask": [], "skip_check": 0, "rotary": 0}
    build, check, rotary = (masking_utils.create_causal_mask, masking_utils._ignore_causal_mask_sdpa,
                            modeling_llama.LlamaRotaryEmbedding.forward)

    @functools.wraps(build)   # Embed reads the builder's signature
    def counting_build(*args, **kw):
        seen["mask"].append(kw.get("allow_is_causal_skip", True))
        return build(*args, **kw)

    def counting_check(*args, **kw):
        seen["skip_check"] += 1
        return check(*args, **kw)

    def counting_rotary(self, *args, **kw):
        seen["rotary"] += 1
        return rotary(self, *args, **kw)
    monkeypatch.setattr(masking_utils, "create_causal_mask", counting_build)
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", counting_check)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", counting_rotary)
    return seen


def train_once(counts, ref):
    """One forward_backward of the padded batch (recompute checked bitwise); the counts of that call only."""
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=MB, plan=PLAN)
    model._check_recompute = True   # every backward stage's recompute equals its forward, bitwise
    ids, mask, labels = padded_batch()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with model:
        counts["mask"].clear()
        counts["skip_check"] = counts["rotary"] = 0
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        model.synchronize()
        seen = copy.deepcopy(counts)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        check_grads(model, ref)
    return seen


def test_masks_and_rotary_built_once_per_microbatch(counts):
    """The recompute of layer 0 reuses the forward's masks and cos/sin: one build of each per microbatch."""
    seen = train_once(counts, tiny_llama())
    assert seen["mask"] == [True] * MB
    assert seen["skip_check"] == MB
    assert seen["rotary"] == MB


def test_large_masks_rebuilt_without_the_skip_check(counts, monkeypatch):
    """Past KEEP_BYTES the recompute rebuilds masks and cos/sin, the masks with HF's skip check (its sync) off."""
    monkeypatch.setattr(hf_layers, "KEEP_BYTES", 0)
    seen = train_once(counts, tiny_llama())
    assert sorted(seen["mask"]) == [False] * MB + [True] * MB
    assert seen["skip_check"] == MB
    assert seen["rotary"] == 2 * MB


def test_unpadded_masks_are_kept_as_none(counts, monkeypatch):
    """A batch without padding: HF skips the mask (None), which the recompute keeps even past KEEP_BYTES."""
    monkeypatch.setattr(hf_layers, "KEEP_BYTES", 0)
    ref = tiny_llama()
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=MB, plan=PLAN)
    model._check_recompute = True
    ids = torch.randint(1, V, (6, 10), generator=torch.Generator().manual_seed(2))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    with model:
        counts["mask"].clear()
        loss = model.forward_backward(input_ids=ids, labels=ids)
        model.synchronize()
        assert counts["mask"] == [True] * MB
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        check_grads(model, ref)
