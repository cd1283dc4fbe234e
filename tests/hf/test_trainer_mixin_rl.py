"""rp.hf.TrainerMixin in front of TRL's ORPOTrainer (trl.experimental.orpo) and GRPOTrainer (sampled completions
scored by a reward function), with a LoRA adapter: the metrics TRL logs and the adapter it trains, as under TRL."""
import copy
import warnings

import pytest
import torch

import roundpipe as rp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # TRLExperimentalWarning: the module's API may change
    orpo = pytest.importorskip("trl.experimental.orpo")
from test_hf_trainer import tiny  # noqa: E402
from test_train_hf import word_tokenizer  # noqa: E402
from test_trainer_mixin_trl import assert_same_training, lora, phrases, preference_rows, trained_beside_trl  # noqa: E402


class ORPO(rp.hf.TrainerMixin, orpo.ORPOTrainer):
    pass


def test_orpo_with_lora_equals_trl(tmp_path):
    """ORPOTrainer with peft_config= through the mixin, 2 workers: the same losses (NLL minus the log odds ratio),
    rewards, log-probabilities, logits means and adapter as ORPOTrainer."""
    trainer, ref = trained_beside_trl(tmp_path, orpo.ORPOTrainer, ORPO, orpo.ORPOConfig, preference_rows)
    with trainer.rp_model:
        trainer.train()
        assert_same_training(trainer, ref)


def count_e(completions, **kwargs):
    """GRPO's reward: the letters "e" in each completion (it varies within a prompt's group, so advantages are not 0)."""
    return [float(c.count("e")) for c in completions]


def prompt_rows(n=16):
    return datasets.Dataset.from_dict({"prompt": phrases(n, (3, 4, 5), 0)})


def grpo_config(out, **over):
    """GRPOConfig's defaults (gradient_checkpointing on) but bf16; 2 prompts x 4 completions of up to 6 tokens per
    batch, accumulation 2 (so one generation per step), beta > 0 so the reference (the adapter disabled) is used."""
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=5e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
              use_cpu=True, bf16=False, dataloader_num_workers=0, num_generations=4, max_completion_length=6,
              beta=0.04)
    kw.update(over)
    return trl.GRPOConfig(**kw)


class Reseeded:
    """Seeds the host RNG before each generation from the step.  A RoundPipe call draws its RNG base from the host's
    generator (roundpipe/workers/rng.py), which transformers' forward does not, so after the first step the
    completions TRL samples would differ between the two runs; seeded so, both sample from the same stream."""

    def _generate_and_score_completions(self, inputs):
        torch.manual_seed(self.args.seed + self.state.global_step)
        return super()._generate_and_score_completions(inputs)


class ReseededGRPO(Reseeded, trl.GRPOTrainer):
    pass


class GRPO(rp.hf.TrainerMixin, Reseeded, trl.GRPOTrainer):
    pass


def test_grpo_with_lora_equals_trl(tmp_path):
    """GRPOTrainer with peft_config= through the mixin, 2 workers, both runs sampling from the same seed before each
    generation (Reseeded): the same completions (lengths, rewards), losses, grad norms, KL to the reference,
    entropy, clip ratios and adapter as GRPOTrainer (GRPO's microbatch counter, self._step, and the mixin's optimizer
    step live side by side)."""
    tokenizer = word_tokenizer()
    hf = tiny()
    ref = ReseededGRPO(model=copy.deepcopy(hf), reward_funcs=count_e, args=grpo_config(tmp_path / "ref"),
                       train_dataset=prompt_rows(), processing_class=tokenizer, peft_config=lora())
    ref.train()
    trainer = GRPO(model=hf, reward_funcs=count_e, args=grpo_config(tmp_path / "rp"), train_dataset=prompt_rows(),
                   processing_class=tokenizer, peft_config=lora(), devices=["cpu", "cpu"])
    assert trainer.args.generation_batch_size == ref.args.generation_batch_size == 8
    with trainer.rp_model:
        trainer.train()
        ours = [h for h in trainer.state.log_history if "loss" in h]
        theirs = [h for h in ref.state.log_history if "loss" in h]
        assert len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs):
            assert sorted(a) == sorted(b)
            for key in sorted(set(b) - {"step_time"}):   # step_time: wall-clock seconds
                # abs: the loss and KL are ~1e-4 at step 1 (the adapter starts as the reference)
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)
        assert any(h["kl"] > 1e-4 for h in theirs) and any(h["reward_std"] > 0 for h in theirs)
        adapter = {n: p for n, p in trainer.rp_model.named_parameters() if p.requires_grad}
        ref_adapter = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
        assert sorted(adapter) == sorted(ref_adapter) and all("lora_" in n for n in adapter)
        for name, p in adapter.items():   # atol as in test_trainer_mixin_trl.py: Adam near a zero gradient
            torch.testing.assert_close(p, ref_adapter[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("given", [dict(generation_batch_size=16), dict(steps_per_generation=4)])
def test_grpo_config_copy_keeps_the_generation_batch(tmp_path, given):
    """The mixin's copy of a GRPOConfig (gradient_checkpointing turned off there) keeps generation_batch_size and
    steps_per_generation, whichever of them was given (GRPOConfig derives the other and refuses both); beta=0: no
    reference model to load."""
    trainer = GRPO(model=tiny(), reward_funcs=count_e, args=grpo_config(tmp_path, beta=0.0, **given),
                   train_dataset=prompt_rows(), processing_class=word_tokenizer(), devices=["cpu"])
    with trainer.rp_model:
        assert (trainer.args.generation_batch_size, trainer.args.steps_per_generation) == (16, 4)
        assert trainer.args.gradient_checkpointing is False
