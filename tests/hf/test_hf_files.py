"""save_pretrained / rp.hf.from_pretrained: HF names in safetensors, loadable by transformers and back."""
import pytest
import torch

import roundpipe as rp

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 80


def tiny(kind, tied):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(kind, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=V, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kind, tied", [("llama", False), ("qwen3", True)])
def test_save_pretrained_round_trips(tmp_path, kind, tied):
    """A trained wrapped model saved with save_pretrained loads with AutoModelForCausalLM and rp.hf.from_pretrained."""
    from safetensors import safe_open
    ids = torch.randint(1, V, (3, 8), generator=torch.Generator().manual_seed(0))
    with rp.hf.wrap(tiny(kind, tied), devices=["cpu", "cpu"]) as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model.forward_backward(input_ids=ids, labels=ids)
            model.step(opt, asynchronous=True)   # asynchronous: save_pretrained waits for it
        model.save_pretrained(tmp_path)
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        logits = model(input_ids=ids)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert set(trained) <= keys
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    for n, p in hf.named_parameters():
        torch.testing.assert_close(p.float(), trained[n], msg=n)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    torch.testing.assert_close(hf(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
    with rp.hf.from_pretrained(tmp_path, devices=["cpu"]) as again:
        for n, p in again.named_parameters():
            assert p.dtype == torch.float32
            torch.testing.assert_close(p, trained[n], msg=n)
        torch.testing.assert_close(again(input_ids=ids), logits, rtol=1e-5, atol=1e-5)


def test_from_pretrained_needs_a_local_folder(tmp_path):
    """A path that is not a folder is a ValueError naming it (the hub is not reached)."""
    with pytest.raises(ValueError, match="not-there"):
        rp.hf.from_pretrained(tmp_path / "not-there")


def test_from_pretrained_bf16_checkpoint_trains_fp32_masters(tmp_path):
    """A bf16 checkpoint loads as stored and its trainable parameters become fp32 masters of the same values."""
    tiny("llama", False).to(torch.bfloat16).save_pretrained(tmp_path)
    stored = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with rp.hf.from_pretrained(tmp_path, devices=["cpu"]) as model:
        for (name, p), q in zip(model.named_parameters(), stored.parameters()):
            assert p.dtype == torch.float32 and torch.equal(p, q.float()), name
    with pytest.raises(ValueError, match="dtype="):
        rp.hf.from_pretrained(tmp_path, dtype="half")
