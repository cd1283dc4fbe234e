"""rp.hf.Trainer: a few steps with gradient accumulation, clipping and a scheduler equal transformers.Trainer's."""
import copy

import pytest
import torch

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments  # noqa: E402

V = 64


def dataset(n=16, t=10):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(1, V, (t,), generator=g)
        mask = torch.ones(t, dtype=torch.long)
        mask[t - 1 - i % 6:] = 0   # right padding of varying length: token counts differ per batch
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def args(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
              learning_rate=1e-2, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1, logging_steps=1,
              report_to=[], save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    kw.update(over)
    return TrainingArguments(**kw)


def test_trainer_matches_transformers_trainer(tmp_path):
    """Same logged losses, grad norms and learning rates, same final weights; save_model writes the HF model."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                               tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(cfg)
    ref_model = copy.deepcopy(hf)
    ref = transformers.Trainer(model=ref_model, args=args(tmp_path / "ref"), train_dataset=dataset())
    ref.train()
    with rp.hf.wrap(hf, devices=["cpu", "cpu"], num_microbatches=3) as model:
        trainer = rp.hf.Trainer(model=model, args=args(tmp_path / "rp"), train_dataset=dataset())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        ref_logs = [h for h in ref.state.log_history if "loss" in h]
        assert len(logs) == len(ref_logs) == 3
        for ours, theirs in zip(logs, ref_logs):
            assert ours["learning_rate"] == theirs["learning_rate"]
            for key in ("loss", "grad_norm"):
                assert abs(ours[key] - theirs[key]) <= 1e-4 * abs(theirs[key]), (key, ours, theirs)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
        trainer.save_model(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, p), q in zip(again.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_needs_a_wrapped_model(tmp_path):
    """A plain HF model is a TypeError naming the argument."""
    with pytest.raises(TypeError, match="rp.hf.wrap"):
        rp.hf.Trainer(model=torch.nn.Linear(2, 2), args=args(tmp_path))
