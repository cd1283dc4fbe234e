"""rp.hf.TrainerMixin with TRL: `class SFT(rp.hf.TrainerMixin, trl.SFTTrainer)` logs trl.SFTTrainer's losses."""
import copy

import pytest
import torch

import roundpipe as rp

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from test_hf_trainer import tiny  # noqa: E402
from test_train_hf import TEXT, word_tokenizer  # noqa: E402


def config(out):
    return trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         disable_tqdm=True, use_cpu=True, bf16=False, dataloader_num_workers=0, max_length=16)


class SFT(rp.hf.TrainerMixin, trl.SFTTrainer):
    """The one class a TRL script defines."""


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
        ours = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        theirs = [h["loss"] for h in ref.state.log_history if "loss" in h]
        assert len(ours) == len(theirs) == 3
        assert ours == pytest.approx(theirs, rel=1e-5)
        assert isinstance(trainer.optimizer.optimizer, rp.optim.AdamW)
        # atol: Adam divides by sqrt(v), so where a gradient is near 0 the fp32 summation order (2 workers, the
        # fused linear + cross-entropy) moves an update by up to ~2e-5 (measured); a wrong step moves it ~1e-2
        for (name, p), q in zip(trainer.rp_model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
