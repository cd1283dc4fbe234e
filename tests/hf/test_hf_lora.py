"""rp.hf.wrap(get_peft_model(...)): LoRA gradients equal PEFT's; frozen base weights cost no training state."""
import copy

import pytest
import torch

import roundpipe as rp

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 96


def base_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def lora_model(dtype=torch.float32, seed=0):
    base = base_model(dtype, seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)   # random B: every LoRA weight gets a gradient
    return peft.get_peft_model(base, lora)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_lora_gradients_equal_peft_and_frozen_weights_get_none():
    """LoRA gradients equal PEFT's within 1e-5; base weights get no gradient, names are PEFT's."""
    ref = lora_model()
    ids, mask, labels = batch()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * 3, num_microbatches=4) as model:
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        ref_params = dict(ref.named_parameters())
        trained = 0
        for name, p in model.named_parameters():
            q = ref_params[name]
            if q.requires_grad:
                trained += 1
                assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 1e-5, name
            else:
                assert p.grad is None, name
        assert trained == 12
        host = model.memory_stats()["host"]
        lora_bytes = sum(p.nbytes for p in model.parameters() if p.requires_grad)
        assert host["grad_landing"] + host["grads"] + host["grads_held"] <= lora_bytes


def test_frozen_base_keeps_its_dtype_and_one_copy():
    """A bf16 base stays bf16 (no fp32 master); with a bf16 compute dtype its upload copy is the master itself;
    the optimizer holds state for LoRA weights only and training changes no base weight."""
    model = rp.hf.wrap(lora_model(torch.bfloat16), devices=["cpu", "cpu"], compute_dtype=torch.bfloat16)
    with model:
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n in frozen)
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        host = model.memory_stats()["host"]
        assert host["upload_copies"] == sum(p.numel() * 2 for p in model.parameters() if p.requires_grad)
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(2):
            ids, mask, labels = batch(step)
            model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.step(opt, asynchronous=True)
        model.synchronize()
        assert {id(p) for p in opt.state} <= {id(p) for p in model.parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if n in frozen:
                assert torch.equal(p, frozen[n]) and p.grad is None, n


def test_save_pretrained_writes_the_adapter_as_peft_does(tmp_path):
    """save_pretrained on a wrapped PEFT model writes adapter files PEFT writes and loads back."""
    from safetensors.torch import load_file
    ref = lora_model()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"]) as model:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        ids, mask, labels = batch()
        model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        model.step(opt, asynchronous=False)
        model.save_pretrained(tmp_path / "ours")
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ref.save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), \
        load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and len(ours) == 12
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (tmp_path / "peft").iterdir())
    loaded = peft.PeftModel.from_pretrained(base_model(seed=1), tmp_path / "ours")
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, trained[n], msg=n)
