"""rp.hf.TrainerMixin in front of TRL trainers whose loss is no plain causal-LM loss (`class DPO(rp.hf.TrainerMixin,
trl.DPOTrainer)`, KTO, SFT's "dft"): their compute_loss, called with the RoundPipe as the model, trains as under TRL,
every logged metric and the weights alike."""
import copy

import pytest
import torch

import roundpipe as rp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
from test_hf_trainer import tiny  # noqa: E402
from test_hf_trainer_trl import SFT, sft_rows  # noqa: E402
from test_hf_trainer_trl import config as sft_config  # noqa: E402
from test_train_hf import TEXT, word_tokenizer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

WORDS = TEXT.split()


def phrases(n, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (lengths[k % len(lengths)],), generator=g).tolist())
            for k in range(n)]


def preference_rows(n=16):
    """Prompts with a chosen and a rejected completion of varying lengths (right padding differs per row)."""
    return datasets.Dataset.from_dict({"prompt": phrases(n, (3, 4, 5), 0), "chosen": phrases(n, (2, 3, 4, 5), 1),
                                       "rejected": phrases(n, (3, 4), 2)})


def unpaired_rows(n=16):
    """KTO's rows: a prompt, one completion and whether it is desirable."""
    return datasets.Dataset.from_dict({"prompt": phrases(n, (3, 4, 5), 0), "completion": phrases(n, (2, 3, 4, 5), 1),
                                       "label": [k % 3 != 0 for k in range(n)]})


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def config(cls, out, **over):
    """TRL's defaults but bf16 (the CPU runs fp32); a learning rate that moves the rewards off 0 in three steps."""
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=5e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
              use_cpu=True, bf16=False, dataloader_num_workers=0, max_length=16)
    kw.update(over)
    return cls(**kw)


class DPO(rp.hf.TrainerMixin, trl.DPOTrainer):
    pass


class KTO(rp.hf.TrainerMixin, trl.KTOTrainer):
    pass


def assert_same_training(trainer, ref, steps=3):
    """Every metric TRL logs (loss, grad norm, rewards, log-probabilities, entropy, token accuracy, ...) logged alike
    step for step, and the same adapter weights after training (within 1e-4)."""
    ours = [h for h in trainer.state.log_history if "loss" in h]
    theirs = [h for h in ref.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == steps
    for a, b in zip(ours, theirs):
        assert sorted(a) == sorted(b)
        for key in b:
            # abs: a reward is beta times the difference of two log-probabilities near -20, each summed over tokens
            # in another order (fp32, ~2e-6), so it is known to ~1e-7 (measured: 3e-7 at most); a wrong gradient
            # moves the rewards by ~1e-2
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)
    assert any(abs(h["rewards/margins"]) > 1e-3 for h in theirs)   # the adapter moved the policy off the reference
    adapter = {n: p for n, p in trainer.rp_model.named_parameters() if p.requires_grad}
    ref_adapter = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
    assert sorted(adapter) == sorted(ref_adapter) and all("lora_" in n for n in adapter)
    # atol: Adam divides by sqrt(v), so where a gradient is near 0 the fp32 summation order moves an update by
    # ~1e-5 (test_hf_trainer_trl.py); a wrong gradient moves it ~lr
    for name, p in adapter.items():
        torch.testing.assert_close(p, ref_adapter[name], rtol=1e-4, atol=1e-4, msg=name)


def trained_beside_trl(tmp_path, trl_trainer, ours, config_class, rows):
    """The TRL trainer trained on a tiny LoRA model, and the mixin's counterpart (2 workers) built over the same
    model, data and adapter, not trained yet: (ours, reference)."""
    tokenizer = word_tokenizer()
    hf = tiny()
    ref = trl_trainer(model=copy.deepcopy(hf), args=config(config_class, tmp_path / "ref"), train_dataset=rows(),
                      processing_class=tokenizer, peft_config=lora())
    ref.train()
    trainer = ours(model=hf, args=config(config_class, tmp_path / "rp"), train_dataset=rows(),
                   processing_class=tokenizer, peft_config=lora(), devices=["cpu", "cpu"])
    return trainer, ref


def test_dpo_with_lora_equals_trl(tmp_path):
    """trl.DPOTrainer with peft_config= (the reference: the adapter disabled) through the mixin, 2 workers: the same
    losses, rewards, log-probabilities and adapter as trl.DPOTrainer."""
    trainer, ref = trained_beside_trl(tmp_path, trl.DPOTrainer, DPO, trl.DPOConfig, preference_rows)
    assert trainer.ref_model is None and isinstance(trainer.model, peft.PeftModel)
    with trainer.rp_model:
        trainer.train()
        assert_same_training(trainer, ref)


def test_kto_with_lora_equals_trl(tmp_path):
    """trl.KTOTrainer with peft_config= through the mixin (its KL batch a forward-only call): the same losses,
    rewards and adapter as trl.KTOTrainer."""
    trainer, ref = trained_beside_trl(tmp_path, trl.KTOTrainer, KTO, trl.KTOConfig, unpaired_rows)
    with trainer.rp_model:
        trainer.train()
        assert_same_training(trainer, ref)


def test_sft_with_a_loss_of_its_own_equals_trl(tmp_path):
    """trl.SFTTrainer with loss_type="dft" (each token's loss weighted by its probability) is no causal-LM loss, so
    its compute_loss trains through the mixin: TRL's losses, grad norms, entropy and token accuracy."""
    tokenizer = word_tokenizer()
    hf = tiny()
    ref = trl.SFTTrainer(model=copy.deepcopy(hf), args=sft_config(tmp_path / "ref", loss_type="dft"),
                         train_dataset=sft_rows(), processing_class=tokenizer)
    ref.train()
    trainer = SFT(model=hf, args=sft_config(tmp_path / "rp", loss_type="dft"), train_dataset=sft_rows(),
                  processing_class=tokenizer, devices=["cpu", "cpu"])
    with trainer.rp_model:
        trainer.train()
        ours = [h for h in trainer.state.log_history if "loss" in h]
        theirs = [h for h in ref.state.log_history if "loss" in h]
        assert len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs):
            assert sorted(a) == sorted(b)
            for key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)
        for (name, p), q in zip(trainer.rp_model.named_parameters(), ref.model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
    assert not trainer.trains_lm_loss()


def test_args_default_to_the_trainers_config_class():
    """args=None gives the Trainer's own config class (DPOConfig for DPOTrainer), as the Trainer itself would."""
    from roundpipe.hf.trainer import default_args, trainer_signature
    assert type(default_args(trainer_signature(DPO))) is trl.DPOConfig
    assert type(default_args(trainer_signature(rp.hf.Trainer))) is TrainingArguments
