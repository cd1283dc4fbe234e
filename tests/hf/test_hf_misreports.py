"""Small misreports (issue 40 item 5): the CLI names the 4-bit base it really uses and warns when --quantize is
ignored; a bitsandbytes checkpoint missing a key names the file, the tensor and the key; a seeded
rp.hf.from_pretrained(dir, peft_config=) initialises LoRA as seeded transformers + PEFT do."""
import warnings

import pytest
import torch

import roundpipe as rp

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_qlora import SHAPE, bnb_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

WEIGHT = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"plain": a tiny fp32 Llama, "nf4": it through bitsandbytes NF4 (double-quantized)}, both save_pretrained."""
    torch.manual_seed(0)
    plain = tmp_path_factory.mktemp("plain")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPE)).save_pretrained(
        plain)
    nf4 = tmp_path_factory.mktemp("nf4")
    bnb_model(plain).save_pretrained(nf4)
    return {"plain": plain, "nf4": nf4}


def test_train_hf_names_the_base_it_uses_and_warns_of_an_ignored_quantize(tmp_path, capsys):
    """--quantize fp4 over an NF4 checkpoint: the model line says `base nf4` (what is used), and one warning says
    that --quantize is ignored."""
    from test_train_hf import local_checkpoint, text_folder
    from transformers import AutoTokenizer

    from roundpipe.commands.train import main

    local_checkpoint(tmp_path / "model")
    bnb_model(tmp_path / "model").save_pretrained(tmp_path / "bnb")
    AutoTokenizer.from_pretrained(tmp_path / "model").save_pretrained(tmp_path / "bnb")
    with pytest.warns(UserWarning, match=r"quantize='fp4' is ignored: .* 4-bit already \(nf4, as loaded\)") as seen:
        rc = main(["--hf", str(tmp_path / "bnb"), "--data", str(text_folder(tmp_path / "data")), "--steps", "1",
                   "--batch-size", "2", "--seq-len", "8", "--devices", "cpu", "--eval-batches", "0",
                   "--no-progress", "--lora", "4", "--quantize", "fp4"])
    assert rc == 0
    assert sum("is ignored" in str(w.message) for w in seen) == 1
    text = capsys.readouterr().out
    assert "trained, base nf4)" in text and "fp4" not in text


def _without(folder, tmp_path, key):
    """A copy of folder's checkpoint without tensor `key`."""
    import shutil
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    del tensors[key]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("missing", [".quant_state.bitsandbytes__nf4", ".absmax"])
def test_a_missing_bnb_key_names_the_file_the_tensor_and_the_key(folders, tmp_path, missing):
    """A checkpoint without a weight's quant_state (once a size mismatch naming no key) or its absmax (once a bare
    KeyError) is a ValueError naming the file, the weight and the missing key."""
    broken = _without(folders["nf4"], tmp_path, WEIGHT + missing)
    with pytest.raises(ValueError) as e:
        rp.hf.from_pretrained(broken, devices=["cpu"])
    message = str(e.value)
    assert str(broken / "model.safetensors") in message and repr(WEIGHT) in message
    assert repr(WEIGHT + missing) in message and "missing" in message


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


@pytest.mark.parametrize("kind", ["plain", "nf4"])
@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_lora_initialisation_equals_transformers_and_peft(folders, kind, seed):
    """torch.manual_seed(s) before rp.hf.from_pretrained(dir, peft_config=) gives the LoRA A and B that
    transformers' from_pretrained(dir) (bitsandbytes for the 4-bit folder) then get_peft_model give, each after
    torch.manual_seed(s): the same draws in the same order, none lost to the 4-bit reader's meta skeleton."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(folders[kind], device_map="cpu")
        torch.manual_seed(seed)
        expected = {n: p.detach().clone() for n, p in peft.get_peft_model(hf, _lora()).named_parameters()
                    if "lora_" in n}
    torch.manual_seed(seed)
    with rp.hf.from_pretrained(folders[kind], devices=["cpu"], peft_config=_lora()) as model:
        got = {n: p.detach() for n, p in model.hf_model.named_parameters() if "lora_" in n}
        assert got.keys() == expected.keys() and len(got) == 12
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        assert any(bool(v.abs().sum()) for n, v in got.items() if "lora_A" in n)


def test_a_lora_init_that_reads_the_base_weight_is_refused_for_a_4bit_folder(folders):
    """PiSSA (and the other inits that read the base weight) over a 4-bit folder is a ValueError naming it, since the
    adapters are built before the stored weights are in place."""
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'"):
        rp.hf.from_pretrained(folders["nf4"], devices=["cpu"], peft_config=cfg)
