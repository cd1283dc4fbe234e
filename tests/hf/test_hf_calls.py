"""Calls on a wrapped HF model beyond forward_backward: composed with autograd, PEFT's disable_adapter(), per-call
options; each equals plain transformers / PEFT (fp32, 1 and 2 CPU workers)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp

pytest.importorskip("transformers")
from hf_grads import check_grads, rel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 42
WORKERS = [1, 2]


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
           output_router_logits=True)   # the router loss on: forward_backward adds it, a logits call has none


def tiny(kind="llama", seed=0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(kind, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=64,
                               tie_word_embeddings=kind == "qwen3", **(MOE if kind == "qwen3_moe" else {}))
    return AutoModelForCausalLM.from_config(cfg).float().train()


def lora(seed=0, targets=("q_proj", "v_proj", "down_proj")):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)   # random B
    return peft.get_peft_model(tiny(seed=seed), cfg).train()


def batch(b=3, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, :3] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def logits_loss(logits, ids, mask):
    """Any loss of the logits the user writes: a masked cross-entropy against the next token, plus a term that
    reaches every logit, so that a wrong seed anywhere shows."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (ce * mask[:, 1:].flatten()).sum() / mask.sum() + 1e-2 * logits.square().mean()


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind, mbs", [("llama", 1), ("llama", 2), ("qwen3", 2), ("qwen3_moe", 2)])
def test_composed_call_backward_equals_hf(kind, mbs, workers):
    """model(input_ids=...) in train mode returns logits whose backward lands every gradient as HF's forward would
    (before: the seeded backward met the head's (hidden, weight) pair, a shape mismatch)."""
    ref = tiny(kind)
    ids, mask, _ = batch()
    expected = ref(input_ids=ids, attention_mask=mask).logits
    logits_loss(expected, ids, mask).backward()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=mbs) as model:
        logits = model(input_ids=ids, attention_mask=mask)
        assert logits.requires_grad and logits.shape == (3, 7, V)
        assert rel(logits.detach(), expected.detach()) <= 1e-5
        logits_loss(logits, ids, mask).backward()
        model.synchronize()
        check_grads(model, ref, every=True)


@pytest.mark.parametrize("workers", WORKERS)
def test_composed_call_backward_equals_peft(workers):
    """The same through a PEFT LoRA model: every LoRA gradient equals PEFT's, the frozen base gets none."""
    ref = lora()
    ids, mask, _ = batch()
    logits_loss(ref(input_ids=ids, attention_mask=mask).logits, ids, mask).backward()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=2) as model:
        logits_loss(model(input_ids=ids, attention_mask=mask), ids, mask).backward()
        model.synchronize()
        check_grads(model, ref)
        assert sum(p.grad is not None for p in model.parameters()) == 12


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("through", ["peft model", "wrapped model"])
def test_disable_adapter_reaches_the_workers(through, workers):
    """Inside `with disable_adapter()` (the PEFT model's, or the wrapped model's) the workers run the base model, as
    PEFT does, under no_grad and in train mode alike; after the block the adapter is back, for forwards and for
    training (before: the replicas kept the adapter on, the output equal to the enabled one)."""
    ref = lora()
    ids, mask, labels = batch()
    with torch.no_grad():
        enabled = ref(input_ids=ids, attention_mask=mask).logits
        with ref.disable_adapter():
            disabled = ref(input_ids=ids, attention_mask=mask).logits
    assert rel(disabled, enabled) > 1e-2
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=2) as model:
        assert rel(model(input_ids=ids, attention_mask=mask).detach(), enabled) <= 1e-5
        block = model.hf_model.disable_adapter if through == "peft model" else model.disable_adapter
        for _ in range(2):
            with block():
                with torch.no_grad():
                    assert rel(model(input_ids=ids, attention_mask=mask), disabled) <= 1e-5
                assert rel(model(input_ids=ids, attention_mask=mask), disabled) <= 1e-5   # train mode, grad on
            with torch.no_grad():
                assert rel(model(input_ids=ids, attention_mask=mask), enabled) <= 1e-5
        out = ref(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref)


@pytest.mark.parametrize("workers", WORKERS)
def test_set_adapter_reaches_the_workers(workers):
    """PEFT's set_adapter() between two adapters loaded before wrapping: the workers run the active one, as PEFT
    does (TRL's reference adapter); a module switched apart by hand is a ValueError naming it."""
    peft = pytest.importorskip("peft")
    ref = lora()
    torch.manual_seed(5)
    ref.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "v_proj"],
                                             init_lora_weights=False))
    ids, mask, _ = batch()
    with torch.no_grad():
        default = ref(input_ids=ids, attention_mask=mask).logits
        ref.set_adapter("other")
        other = ref(input_ids=ids, attention_mask=mask).logits
        ref.set_adapter("default")
    assert rel(other, default) > 1e-2
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers) as model, torch.no_grad():
        for name, expected in (("other", other), ("default", default)):
            model.hf_model.set_adapter(name)
            assert rel(model(input_ids=ids, attention_mask=mask), expected) <= 1e-5
        proj = model.hf_model.get_submodule("base_model.model.model.layers.1.self_attn.q_proj")
        proj.enable_adapters(False)
        with pytest.raises(ValueError, match="layers.1.self_attn.q_proj"):
            model(input_ids=ids, attention_mask=mask)


def test_disable_adapter_of_a_model_without_adapter_is_a_type_error():
    """A wrapped model without PEFT has no adapter to disable: a TypeError that says so."""
    with rp.hf.wrap(tiny(), devices=["cpu"]) as model:
        with pytest.raises(TypeError, match="PEFT"):
            with model.disable_adapter():
                pass


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("options", [dict(num_microbatches=2), dict(recompute="layer"), dict(num_microbatches=3,
                                                                                            recompute="stage")])
def test_per_call_options_pass_through(options, workers):
    """forward_backward(..., num_microbatches=, recompute=) and model(..., the same) take RoundPipe's per-call options:
    the loss, the gradients and the logits equal HF's (before: a TypeError)."""
    ref = tiny()
    ids, mask, labels = batch()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels, **options)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, **options)
        assert rel(logits, out.logits.detach()) <= 1e-5


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind, mbs", [("llama", 2), ("lora", 2), ("qwen3_moe", 1)])
def test_return_outputs_gives_the_logits(kind, mbs, workers):
    """forward_backward(..., return_outputs=True) returns (loss, logits [B, T, V] on the CPU, detached), HF's
    loss, gradients and logits; the router loss included (one microbatch: HF's aux loss is per microbatch)."""
    ref = lora() if kind == "lora" else tiny(kind)
    ids, mask, labels = batch()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers) as model:
        loss, logits = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels, return_outputs=True,
                                              num_microbatches=mbs)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        assert not logits.requires_grad and logits.shape == (3, 7, V)
        assert rel(logits, out.logits.detach()) <= 1e-5
        model.synchronize()
        check_grads(model, ref)


def test_per_call_options_are_checked():
    """A wrong per-call option is RoundPipe's error; an unknown keyword names what the model takes."""
    ids, mask, labels = batch()
    with rp.hf.wrap(tiny(), devices=["cpu"]) as model:
        with pytest.raises(ValueError, match="num_microbatches"):
            model.forward_backward(input_ids=ids, labels=labels, num_microbatches=0)
        with pytest.raises(ValueError, match="recompute"):
            model(input_ids=ids, recompute="block")
        with pytest.raises(TypeError, match="return_outputs"):
            model.forward_backward(input_ids=ids, labels=labels, return_outputs=1)
        with pytest.raises(TypeError, match="num_microbatches"):
            model(input_ids=ids, microbatches=2)
