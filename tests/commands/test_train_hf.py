"""`roundpipe train --hf DIR --data DIR`: fine-tunes a local checkpoint with its own tokenizer, no download."""
import pytest
import torch

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from roundpipe.commands.train import main  # noqa: E402

TEXT = ("the quick brown fox jumps over the lazy dog . a small model learns the words of a small text . "
        "round pipes carry stages to workers and back again . ") * 8


def word_tokenizer():
    """A word-level tokenizer of TEXT, trained on the spot."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def local_checkpoint(root):
    """A tiny Llama and a word-level tokenizer trained on the spot, saved with save_pretrained."""
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    tokenizer.save_pretrained(root)


def test_train_hf_fine_tunes_and_saves(tmp_path, capsys):
    """A few steps on a folder of text files lower the loss; --save writes a model transformers loads."""
    local_checkpoint(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"part{i}.txt").write_text(TEXT)
    out = tmp_path / "tuned"
    rc = main(["--hf", str(tmp_path / "model"), "--data", str(data), "--steps", "12", "--batch-size", "4",
               "--seq-len", "16", "--lr", "0.01", "--devices", "cpu,cpu", "--eval-batches", "1", "--no-progress",
               "--save", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "model: " in text and "tokens/s" in text and f"saved to {out}" in text
    start, end = (float(w) for w in text.split("held-out loss: start ")[1].split("  (")[0].split("  end "))
    assert end < start
    tuned = AutoModelForCausalLM.from_pretrained(out)
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, first.model.layers[0].mlp.up_proj.weight)
    assert (out / "tokenizer.json").exists()


def test_train_hf_bad_folder_is_a_usage_error(tmp_path, capsys):
    """--hf naming no folder exits 2 with the flag named; --save without --hf too."""
    with pytest.raises(SystemExit) as e:
        main(["--hf", str(tmp_path / "missing"), "--steps", "1"])
    assert e.value.code == 2 and "--hf" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--save", str(tmp_path / "x"), "--steps", "1"])
    assert e.value.code == 2 and "--save needs --hf" in capsys.readouterr().err


def text_folder(root):
    root.mkdir()
    for i in range(3):
        (root / f"part{i}.txt").write_text(TEXT)
    return root


@pytest.fixture
def setup(tmp_path):
    local_checkpoint(tmp_path / "model")
    return tmp_path / "model", text_folder(tmp_path / "data")


def tune(model, data, out, *extra):
    """A short --hf run saved to out; its weights by name."""
    rc = main(["--hf", str(model), "--data", str(data), "--steps", "4", "--batch-size", "2", "--seq-len", "12",
               "--lr", "0.01", "--devices", "cpu", "--eval-batches", "0", "--no-progress", "--save", str(out), *extra])
    assert rc == 0
    return dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())


def test_train_hf_max_grad_norm_clips(setup, tmp_path):
    """--max-grad-norm 0.0001 reaches the step: the weights differ from a run without it."""
    plain = tune(*setup, tmp_path / "a")
    clipped = tune(*setup, tmp_path / "b", "--max-grad-norm", "0.0001")
    assert any(not torch.equal(plain[n], clipped[n]) for n in plain)


def test_train_hf_checkpoints_and_resumes_bitwise(setup, tmp_path, capsys):
    """--checkpoint DIR/{step} --checkpoint-every 2 writes steps 2 and 4; --resume DIR/2 ends bitwise equal."""
    ckpt = tmp_path / "ckpt"
    whole = tune(*setup, tmp_path / "a", "--checkpoint", str(ckpt) + "/{step}", "--checkpoint-every", "2")
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
    resumed = tune(*setup, tmp_path / "b", "--resume", str(ckpt / "2"))
    assert "(resumed after step 2)" in capsys.readouterr().out
    assert all(torch.equal(whole[n], resumed[n]) for n in whole)


def test_train_hf_compensation_reaches_the_model(setup, tmp_path):
    """--async --compensation 1.0 trains other weights than --async alone."""
    stale = tune(*setup, tmp_path / "a", "--async")
    compensated = tune(*setup, tmp_path / "b", "--async", "--compensation", "1.0")
    assert any(not torch.equal(stale[n], compensated[n]) for n in stale)


@pytest.mark.parametrize("flag, value", [("--size", "tiny"), ("--layers", "2"), ("--hidden", "64"), ("--heads", "2")])
def test_train_hf_shape_flags_are_errors(setup, flag, value, capsys):
    """The built-in decoder's shape flags are usage errors with --hf, naming the flag."""
    model, data = setup
    with pytest.raises(SystemExit) as e:
        main(["--hf", str(model), "--data", str(data), "--steps", "1", flag, value])
    assert e.value.code == 2 and f"{flag} {value} shapes the built-in decoder" in capsys.readouterr().err


def test_train_hf_resume_and_tokenizer_errors(setup, tmp_path, capsys):
    """--resume naming no folder, and a model folder without tokenizer files, are usage errors naming them."""
    model, data = setup
    with pytest.raises(SystemExit) as e:
        main(["--hf", str(model), "--data", str(data), "--steps", "1", "--resume", str(tmp_path / "nonexistent")])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    with pytest.raises(SystemExit) as e:
        main(["--hf", str(model), "--data", str(data), "--steps", "1"])
    assert e.value.code == 2 and "has no tokenizer" in capsys.readouterr().err
