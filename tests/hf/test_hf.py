"""rp.hf.wrap: every preset and the generic path train exactly like the HF model itself (CPU, fp32)."""
import copy

import pytest
import torch

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from hf_grads import check_grads, rel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 96
BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, max_position_embeddings=64)
CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(tie_word_embeddings=True, head_dim=8),
    "qwen3_moe": dict(tie_word_embeddings=False, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, decoder_sparse_step=1),
    "phi3": dict(tie_word_embeddings=False, pad_token_id=0),   # no preset: the generic path
}


def tiny(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(kind, **{**BASE, **CONFIGS[kind], **over})
    return AutoModelForCausalLM.from_config(cfg).float()


def batch(pad: str, seed: int = 1, b: int = 5, t: int = 11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (b, t), generator=g)
    mask = torch.ones_like(ids)
    lengths = [t, 4, t - 1, 2, 7, t, 5][:b]
    for i, n in enumerate(lengths):
        if pad == "right":
            mask[i, n:] = 0
        else:
            mask[i, :t - n] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


@pytest.mark.parametrize("kind, pad, workers, mbs", [
    ("llama", "right", 2, 3), ("llama", "left", 1, 5), ("mistral", "left", 3, 4), ("qwen2", "right", 2, 2),
    ("qwen2", "left", 3, 5), ("qwen3", "left", 2, 3), ("qwen3_moe", "right", 3, 4), ("qwen3_moe", "left", 1, 2),
    ("phi3", "right", 2, 3)])
def test_loss_and_gradients_equal_hf(kind, pad, workers, mbs):
    """Loss, every gradient and the forward logits equal the HF model's own on a padded batch."""
    ref = tiny(kind)
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=mbs)
    ids, mask, labels = batch(pad)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with model:
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref)
        logits = model(input_ids=ids, attention_mask=mask)
        assert logits.shape == (5, 11, V)
        keep = mask.bool()
        assert rel(logits[keep], out.logits.detach()[keep]) <= 1e-5


def test_token_weighting_and_num_items_in_batch():
    """Microbatches with few counted tokens weigh by tokens, not samples; num_items_in_batch is the divisor."""
    ref = tiny("llama")
    ids, mask, labels = batch("right")
    labels[1:, 3:] = -100   # microbatches with very different token counts
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"], num_microbatches=5) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        out = ref(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=100)
        out = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=100)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        out.loss.backward()
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.synchronize()
        check_grads(model, ref)


@pytest.mark.parametrize("kind, optim", [("qwen3", "torch"), ("llama", "rp")])
def test_ten_synchronous_steps_equal_hf_with_adamw(kind, optim):
    """10 synchronous steps (tied embeddings for qwen3) give HF + torch AdamW's losses and weights."""
    ref = tiny(kind)
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    make = torch.optim.AdamW if optim == "torch" else rp.optim.AdamW
    opt = make(model.parameters(), lr=1e-3, weight_decay=0.1)
    with model:
        for step in range(10):
            ids, mask, labels = batch("left" if step % 2 else "right", seed=step)
            out = ref(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.step(opt, asynchronous=False)
            assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item(), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_tied_embeddings_one_master_both_gradients():
    """A tied LM head and embedding are one master: the optimizer sees it once, its gradient is the sum."""
    ref = tiny("qwen3")
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=2)
    with model:
        names = [n for n, _ in model.named_parameters()]
        assert "lm_head.weight" not in names and len(names) == len(set(id(p) for p in model.parameters()))
        assert model.hf_model.lm_head.weight is model.hf_model.model.embed_tokens.weight
        host = model.memory_stats()["host"]
        assert host["masters"] == sum(p.nbytes for p in model.parameters())
        ids, mask, labels = batch("right")
        model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.synchronize()
        check_grads(model, ref)


def test_tied_embeddings_asynchronous_steps_are_one_step_stale():
    """Asynchronous steps on a tied model: call t's gradient is taken at W_(t-1), as the engine promises."""
    ref = tiny("qwen3")
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu", "cpu"], num_microbatches=3)
    opt = rp.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    stale = copy.deepcopy(ref)   # the weights the next call reads
    with model:
        for step in range(5):
            ids, mask, labels = batch("left", seed=step)
            loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            out = stale(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item(), step
            new_stale = copy.deepcopy(ref)   # W_(t-1) before this step, read by the next call
            for p, q in zip(ref.parameters(), stale.parameters()):
                p.grad = q.grad
            opt_ref.step()
            opt_ref.zero_grad()
            stale.zero_grad()
            stale = new_stale if step > 0 else copy.deepcopy(stale)
            model.step(opt, asynchronous=True)
        model.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_bad_input_names_the_argument():
    """Bad arguments raise ValueError/TypeError naming them; a model lacking a part names what is missing."""
    with rp.hf.wrap(tiny("llama"), devices=["cpu"]) as model:
        ids, mask, labels = batch("right")
        with pytest.raises(ValueError, match="labels is None"):
            model.forward_backward(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
            model.forward_backward(input_ids=ids.float(), labels=labels)
        with pytest.raises(ValueError, match="attention_mask"):
            model(input_ids=ids, attention_mask=mask[:, :3])
        with pytest.raises(TypeError, match="token_type_ids"):
            model(input_ids=ids, token_type_ids=ids)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            model.forward_backward(input_ids=ids, labels=labels, num_items_in_batch=0)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=V))
    with pytest.raises(ValueError, match="wpe"):
        rp.hf.wrap(gpt2, devices=["cpu"])
    with pytest.raises(TypeError, match="hf_model"):
        rp.hf.wrap(torch.nn.Linear(2, 2), devices=["cpu"])


def test_import_is_lazy():
    """import roundpipe and rp.hf.wrap's module import no transformers (only wrapping a model does)."""
    import subprocess
    import sys
    code = ("import sys, roundpipe as rp; rp.hf.wrap; rp.hf.from_pretrained; "
            "assert 'transformers' not in sys.modules and 'peft' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_generic_path_refuses_a_forward_it_cannot_reproduce():
    """A model without a preset whose forward does more than embed, decode, norm and project (Gemma-2's logit
    soft-capping) is a ValueError."""
    rp.hf.wrap(tiny("phi3"), devices=["cpu"]).close()   # no preset, a plain decoder: accepted
    gemma2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma2", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, final_logit_softcapping=0.5))
    with pytest.raises(ValueError, match="logits differ"):
        rp.hf.wrap(gemma2, devices=["cpu"])


KERNELS_SCRIPT = r"""
import copy, torch, roundpipe as rp
from roundpipe.hf.kernels import patch_kernels
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=64)
ref = AutoModelForCausalLM.from_config(cfg)
model = copy.deepcopy(ref)
assert patch_kernels(model, force=True) > 0
ids = torch.randint(1, 64, (3, 7)); mask = torch.ones_like(ids); mask[0, :2] = 0
labels = ids.masked_fill(mask == 0, -100)
out = ref(input_ids=ids, attention_mask=mask, labels=labels); out.loss.backward()
with rp.hf.wrap(model, devices=["cpu", "cpu"], num_microbatches=3) as w:
    norm = w.replicas[w.workers[1].name][1].module.layer.input_layernorm
    assert norm.__dict__["forward"].__self__ is norm   # each replica runs the patched forward on itself
    loss = w.forward_backward(input_ids=ids, attention_mask=mask, labels=labels); w.synchronize()
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    for p, q in zip(w.parameters(), ref.parameters()):
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 1e-4
"""


def test_kernel_patched_model_wraps():
    """A model patched with our kernels (Triton interpreter on CPU) trains through the wrapper with HF's gradients."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", KERNELS_SCRIPT], check=True, timeout=300, env=env)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gpu_workers_size_estimate_counts_activations(kind):
    """The planner's dry run for GPU workers (meta device) counts an HF model's activations as the CPU
    workers' dry run does (before: the mask functions' packed-sequence search called .item() on meta
    position ids, the dry run failed silently and every layer's activations counted 0 bytes)."""
    from roundpipe.engine.autoplan import size_costs
    from roundpipe.hf.model import cut_layers
    layers = cut_layers(tiny(kind))
    x = torch.randint(0, 64, (2, 32))
    on_cpu = [c.act_bytes for c in size_costs(layers, ((x,), {}), torch.float32, "cpu")]
    on_meta = [c.act_bytes for c in size_costs(layers, ((x,), {}), torch.float32, "cuda")]
    assert all(b > 0 for b in on_meta) and on_meta == on_cpu, (on_meta, on_cpu)
