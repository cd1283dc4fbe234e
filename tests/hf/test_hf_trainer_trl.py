"""rp.hf.TrainerMixin with TRL: `class SFT(rp.hf.TrainerMixin, trl.SFTTrainer)` logs trl.SFTTrainer's losses."""
import copy
import warnings

import pytest
import torch

import roundpipe as rp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from test_hf_trainer import tiny  # noqa: E402
from test_train_hf import TEXT, word_tokenizer  # noqa: E402


def config(out, **over):
    """SFTConfig's defaults but bf16 (the CPU runs fp32); gradient_checkpointing stays on, as SFTConfig has it."""
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
              use_cpu=True, bf16=False, dataloader_num_workers=0, max_length=16)
    kw.update(over)
    return trl.SFTConfig(**kw)


class SFT(rp.hf.TrainerMixin, trl.SFTTrainer):
    """The one class a TRL script defines."""



def assert_same_losses(trainer, ref, steps=3):
    """Our logged losses equal TRL's, step for step (three logged steps by default)."""
    ours = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    theirs = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == steps
    assert ours == pytest.approx(theirs, rel=1e-5)

def test_sft_trainer_mixin_equals_trl(tmp_path):
    """A tiny SFT run (text rows tokenized by TRL, accumulation 2, linear schedule): the same logged losses and
    final weights as trl.SFTTrainer, with the optimizer's fused roundpipe.optim version."""
    tokenizer = word_tokenizer()
    rows = datasets.Dataset.from_dict({"text": [s.strip() + " ." for s in TEXT.split(" . ")[:16]]})
    hf = tiny()
    ref_model = copy.deepcopy(hf)
    ref = trl.SFTTrainer(model=ref_model, args=config(tmp_path / "ref"), train_dataset=rows,
                         processing_class=tokenizer)
    ref.train()
    trainer = SFT(model=hf, args=config(tmp_path / "rp"), train_dataset=rows, processing_class=tokenizer,
                  devices=["cpu", "cpu"])
    with trainer.rp_model:
        trainer.train()
        assert_same_losses(trainer, ref)
        assert isinstance(trainer.optimizer.optimizer, rp.optim.AdamW)
        # atol: Adam divides by sqrt(v), so where a gradient is near 0 the fp32 summation order (2 workers, the
        # fused linear + cross-entropy) moves an update by up to ~2e-5 (measured); a wrong step moves it ~1e-2
        for (name, p), q in zip(trainer.rp_model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)


def sft_rows():
    return datasets.Dataset.from_dict({"text": [s.strip() + " ." for s in TEXT.split(" . ")[:16]]})


def test_sft_peft_config_equals_trl(tmp_path):
    """peft_config= (TRL's own way to add LoRA): the adapter TRL puts around the model is what the RoundPipe trains;
    the same logged losses and adapter weights as trl.SFTTrainer with the same peft_config."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    tokenizer = word_tokenizer()
    hf = tiny()
    ref = trl.SFTTrainer(model=copy.deepcopy(hf), args=config(tmp_path / "ref"), train_dataset=sft_rows(),
                         processing_class=tokenizer, peft_config=lora())
    ref.train()
    trainer = SFT(model=hf, args=config(tmp_path / "rp"), train_dataset=sft_rows(), processing_class=tokenizer,
                  peft_config=lora(), devices=["cpu", "cpu"])
    assert isinstance(trainer.rp_model.hf_model, peft.PeftModel) and trainer.rp_model.hf_model is trainer.model
    with trainer.rp_model:
        trainer.train()
        assert_same_losses(trainer, ref)
        adapter = {n: p for n, p in trainer.rp_model.named_parameters() if p.requires_grad}
        ref_adapter = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
        assert sorted(adapter) == sorted(ref_adapter) and all("lora_" in n for n in adapter)
        for name, p in adapter.items():   # the tolerance of test_sft_trainer_mixin_equals_trl, for its reason
            torch.testing.assert_close(p, ref_adapter[name], rtol=1e-4, atol=1e-4, msg=name)


def test_sft_gradient_checkpointing_gives_way_to_the_engines_recompute(tmp_path):
    """SFTConfig's default gradient_checkpointing=True: HF's checkpointing is turned off with one line saying that the
    engine recomputes already, the planner's dry run runs (no fallback warning), and the losses equal
    trl.SFTTrainer's with checkpointing and ours with gradient_checkpointing=False."""
    tokenizer = word_tokenizer()
    hf = tiny()
    ref = trl.SFTTrainer(model=copy.deepcopy(hf), args=config(tmp_path / "ref"), train_dataset=sft_rows(),
                         processing_class=tokenizer)
    ref.train()
    plain = SFT(model=copy.deepcopy(hf), args=config(tmp_path / "plain", gradient_checkpointing=False),
                train_dataset=sft_rows(), processing_class=tokenizer, devices=["cpu", "cpu"])
    with plain.rp_model:
        plain.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SFT(model=hf, args=config(tmp_path / "rp"), train_dataset=sft_rows(), processing_class=tokenizer,
                      devices=["cpu", "cpu"])
        with trainer.rp_model:
            trainer.train()
    messages = [str(w.message) for w in caught]
    assert sum("recomputes" in m for m in messages) == 1, messages
    assert not any("dry run" in m for m in messages), messages
    assert not any(getattr(m, "gradient_checkpointing", False) for m in hf.modules())
    ours = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert ours == [h["loss"] for h in plain.state.log_history if "loss" in h]
    assert ours == pytest.approx([h["loss"] for h in ref.state.log_history if "loss" in h], rel=1e-5)


def test_peft_config_with_a_wrapped_model_is_an_error(tmp_path):
    """peft_config= with a model already wrapped by rp.hf.wrap is a TypeError saying what to pass instead."""
    peft = pytest.importorskip("peft")
    with rp.hf.wrap(tiny(), devices=["cpu"]) as model, pytest.raises(TypeError, match="peft_config.*unwrapped"):
        SFT(model=model, args=config(tmp_path, gradient_checkpointing=False), train_dataset=sft_rows(),
            processing_class=word_tokenizer(), peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))
