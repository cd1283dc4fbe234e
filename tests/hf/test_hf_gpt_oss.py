"""rp.hf.wrap of GPT-OSS (sliding + full layers, attention sinks, its MoE) and of sliding-window models equals HF."""
import copy

import pytest
import torch

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from hf_grads import check_grads, rel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 64
GPT_OSS = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, vocab_size=V, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
               tie_word_embeddings=False)


def tiny(kind: str = "gpt_oss", seed: int = 0, **over):
    torch.manual_seed(seed)
    base = GPT_OSS if kind == "gpt_oss" else dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**base, **over})).float()


def batch(pad: str, b: int = 4, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (b, t), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate([t, 4, t - 2, 6][:b]):
        if pad == "right":
            mask[i, n:] = 0
        else:
            mask[i, :t - n] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_preset_cuts_sliding_and_full_layers():
    """gpt_oss has a preset; its layers keep config.layer_types (sliding, full), each with the matching mask."""
    from roundpipe.hf.model import cut_layers
    from roundpipe.hf.presets import PRESETS, find_parts
    model = tiny()
    assert "gpt_oss" in PRESETS and find_parts(model).preset
    layers = cut_layers(model)
    assert [d.attention_type for d in layers[1:-1]] == ["sliding_attention", "full_attention"]
    assert layers[0].attention_types == ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("pad, workers, mbs", [("right", 1, 1), ("left", 2, 3)])
def test_loss_and_gradients_equal_hf(pad, workers, mbs):
    """Loss, every gradient (sinks, router weight and bias, expert weights and biases) and logits are HF's on a
    padded batch longer than the sliding window."""
    ref = tiny()
    ids, mask, labels = batch(pad)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert all(ref.model.layers[0].self_attn.sinks.grad.abs() > 0)
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=mbs) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref, every=True)
        logits = model(input_ids=ids, attention_mask=mask)
        keep = mask.bool()
        assert rel(logits[keep], out.logits.detach()[keep]) <= 1e-5


def test_router_loss_equals_hf():
    """output_router_logits=True: HF's LM loss + coef * load-balancing loss, and every gradient (2 workers)."""
    ref = tiny(output_router_logits=True, router_aux_loss_coef=0.5)
    ids, mask, labels = batch("left")
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert out.aux_loss.item() > 0
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=1) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref, every=True)


@pytest.mark.parametrize("kind, over", [("mistral", dict(sliding_window=3)),
                                        ("mixtral", dict(sliding_window=3, num_local_experts=4))])
def test_sliding_window_without_layer_types_equals_hf(kind, over):
    """A model whose config has sliding_window but no layer_types (Mistral, Mixtral) slides in every layer, as
    its own forward does: logits equal HF's on sequences longer than the window (before: full attention)."""
    ref = tiny(kind, **over)
    ids, mask, _ = batch("right")
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"]) as model:
        logits = model(input_ids=ids, attention_mask=mask)
    expected = ref(input_ids=ids, attention_mask=mask).logits.detach()
    keep = mask.bool()
    assert rel(logits[keep], expected[keep]) <= 1e-5
