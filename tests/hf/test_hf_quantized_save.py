"""save_pretrained of a wrapped model with a 4-bit base and no adapter (issue 40 item 4): bitsandbytes' tensors and
quantization_config, a folder that rp.hf.from_pretrained and transformers + bitsandbytes load, the packed base
bitwise as it was; a 4-bit base that has no bitsandbytes form is refused before anything is written."""
import json
import warnings

import pytest
import torch
from torch import nn

import roundpipe as rp
from roundpipe.quant import QuantLinear, from_bnb

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")
from safetensors.torch import load_file  # noqa: E402
from test_hf import batch  # noqa: E402
from test_qlora import SHAPE, bnb_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def bnb_dirs(tmp_path_factory):
    """(quant_type, double_quant) -> folder transformers saved from a bitsandbytes 4-bit tiny Llama."""
    torch.manual_seed(0)
    plain = tmp_path_factory.mktemp("plain")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPE)).save_pretrained(
        plain)
    out = {}
    for kinds in (("nf4", True), ("fp4", False)):
        path = tmp_path_factory.mktemp("-".join(map(str, kinds)))
        bnb_model(plain, *kinds).save_pretrained(path)
        out[kinds] = path
    return out


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _assert_same_files(got, expected, skip=()):
    """The two folders' model.safetensors hold the same keys, dtypes, shapes and bytes (but `skip`)."""
    a, b = load_file(got / "model.safetensors"), load_file(expected / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        if k not in skip:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bits(a[k]), _bits(b[k])), k


def _transformers(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, device_map="cpu").train()


@pytest.mark.parametrize("kinds", [("nf4", True), ("fp4", False)])
def test_save_of_a_bnb_checkpoint_is_bitwise_the_checkpoint(bnb_dirs, tmp_path, kinds):
    """from_pretrained(bnb folder).save_pretrained(out): every tensor of out is bitwise the source's (packed bytes,
    absmax, maps, quant-state JSON, the fp32 rest), config.json's quantization_config says the same 4-bit type;
    rp.hf.from_pretrained and transformers + bitsandbytes load it with the same packed states."""
    source = bnb_dirs[kinds]
    with rp.hf.from_pretrained(source, devices=["cpu"]) as model:
        model.save_pretrained(tmp_path)
    _assert_same_files(tmp_path, source)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    theirs = json.loads((source / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] is True
    for key in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
        assert qc[key] == theirs[key], key
    assert qc["llm_int8_skip_modules"] == ["lm_head"]
    with rp.hf.from_pretrained(tmp_path, devices=["cpu"]) as again:
        linears = {n: m for n, m in again.hf_model.named_modules() if isinstance(m, QuantLinear)}
        assert len(linears) == 14 and all(m.quant_type == kinds[0] for m in linears.values())
    hf = _transformers(tmp_path)
    for name, m in linears.items():
        state = from_bnb(hf.get_submodule(name))
        assert torch.equal(state.data, m.weight) and torch.equal(_bits(state.absmax), _bits(m.absmax)), name


def test_trained_parts_are_saved_and_reloaded_exactly(bnb_dirs, tmp_path):
    """After two steps that train the embedding, the norms and the LM head (the 4-bit Linears frozen), the saved
    folder holds those trained values and the untouched packed base bitwise; rp.hf.from_pretrained gives the same
    parameters and logits, and transformers + bitsandbytes the same parameters and packed bytes."""
    source = bnb_dirs[("nf4", True)]
    ids, mask, labels = batch("right", b=2, t=8)
    with rp.hf.from_pretrained(source, devices=["cpu"]) as model:
        model.train()
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert "model.embed_tokens.weight" in trained and "lm_head.weight" in trained and len(trained) == 7
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):
            model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.step(opt, asynchronous=True)   # asynchronous: save_pretrained waits for it
        model.save_pretrained(tmp_path)
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.eval()
        logits = model(input_ids=ids, attention_mask=mask)
    stored = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(stored[n], values[n]) for n in trained)
    assert not torch.equal(stored["lm_head.weight"], load_file(source / "model.safetensors")["lm_head.weight"])
    _assert_same_files(tmp_path, source, skip=set(trained))
    with rp.hf.from_pretrained(tmp_path, devices=["cpu"]) as again:
        assert all(torch.equal(p, values[n]) for n, p in again.named_parameters())
        again.eval()
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask), logits, rtol=0, atol=0)
    hf = _transformers(tmp_path)
    for name in trained:
        assert torch.equal(hf.get_parameter(name), values[name]), name


def test_a_base_quantized_by_wrap_saves_in_bnb_format(bnb_dirs, tmp_path):
    """wrap(quantize="fp4") of a model whose decoder Linears are frozen saves bitsandbytes' format too (compute
    dtype null: the product in the input's dtype, as the wrapped layers ran); both loaders read the same packed
    states and rp.hf.from_pretrained gives the same logits."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPE)).float()
    for m in hf.model.layers.modules():
        if isinstance(m, nn.Linear):
            m.requires_grad_(False)
    ids, mask, _ = batch("left", b=2, t=8)
    with rp.hf.wrap(hf, devices=["cpu"], quantize="fp4", double_quant=False) as model:
        model.eval()
        logits = model(input_ids=ids, attention_mask=mask)
        states = {n: m.quant_state for n, m in model.hf_model.named_modules() if isinstance(m, QuantLinear)}
        model.save_pretrained(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["bnb_4bit_quant_type"] == "fp4" and qc["bnb_4bit_use_double_quant"] is False
    assert qc["bnb_4bit_compute_dtype"] is None and qc["llm_int8_skip_modules"] == ["lm_head"]
    with rp.hf.from_pretrained(tmp_path, devices=["cpu"]) as again:
        again.eval()
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask), logits, rtol=0, atol=0)
    theirs = _transformers(tmp_path)
    assert len(states) == 14
    for name, state in states.items():
        got = from_bnb(theirs.get_submodule(name))
        assert torch.equal(got.data, state.data) and torch.equal(got.absmax, state.absmax), name


def test_a_base_with_no_bnb_form_is_refused_before_writing(tmp_path):
    """Layers of two 4-bit types, and fused MoE experts stored 4-bit, are a ValueError naming the layer and why, and
    nothing is written."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPE)).float()
    hf.requires_grad_(False)
    hf.model.norm.requires_grad_(True)
    mlp = hf.model.layers[0].mlp
    mlp.up_proj = QuantLinear.from_linear(mlp.up_proj, "fp4")
    with rp.hf.wrap(hf, devices=["cpu"], quantize="nf4") as model:
        with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj is 4-bit .*'nf4'.* but "
                                             r"model.layers.0.mlp.up_proj is .*'fp4'"):
            model.save_pretrained(tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    moe = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96, num_experts=4,
               num_experts_per_tok=2, max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **moe)).float()
    hf.requires_grad_(False)
    hf.model.norm.requires_grad_(True)
    with rp.hf.wrap(hf, devices=["cpu"], quantize="nf4") as model:
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts holds fused MoE expert tensors 4-bit"):
            model.save_pretrained(tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


def test_train_hf_save_without_lora_writes_a_loadable_bnb_folder(tmp_path, capsys):
    """`roundpipe train --hf BNB_DIR --save OUT` (no --lora) goes through the same path: OUT loads with
    rp.hf.from_pretrained, its packed base bitwise the source's, and the model line names the base nf4."""
    from test_train_hf import local_checkpoint, text_folder
    from transformers import AutoTokenizer

    from roundpipe.commands.train import main

    local_checkpoint(tmp_path / "model")
    bnb_model(tmp_path / "model", "nf4", True).save_pretrained(tmp_path / "bnb")
    AutoTokenizer.from_pretrained(tmp_path / "model").save_pretrained(tmp_path / "bnb")
    out = tmp_path / "tuned"
    rc = main(["--hf", str(tmp_path / "bnb"), "--data", str(text_folder(tmp_path / "data")), "--steps", "2",
               "--batch-size", "2", "--seq-len", "8", "--devices", "cpu", "--eval-batches", "0", "--no-progress",
               "--save", str(out)])
    assert rc == 0 and "trained, base nf4)" in capsys.readouterr().out
    source, saved = load_file(tmp_path / "bnb" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(saved) == set(source)
    packed = [k for k in source if source[k].dtype == torch.uint8]
    assert packed and all(torch.equal(saved[k], source[k]) for k in packed)
    assert not torch.equal(saved["model.norm.weight"], source["model.norm.weight"])   # trained
    with rp.hf.from_pretrained(out, devices=["cpu"]) as again:
        assert torch.equal(again.hf_model.model.norm.weight, saved["model.norm.weight"])
        assert sum(isinstance(m, QuantLinear) for m in again.hf_model.modules()) == 14
