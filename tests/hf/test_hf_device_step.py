"""rp.hf.Trainer with device_step=True (roundpipe/engine/step/device_step.py): the decoder layers are stepped on the
worker, the tied embedding and head on the host; the logged losses and grad norms, and the final weights, equal
transformers.Trainer's, and logging the grad norm every step brings no master home."""
import copy

import pytest
from test_hf_trainer import args, compare, dataset, tiny

import roundpipe as rp

transformers = pytest.importorskip("transformers")


def test_trainer_with_the_device_step_matches_transformers_trainer(tmp_path, monkeypatch):
    hf = tiny(tie=True)
    ref_model = copy.deepcopy(hf)
    ref = transformers.Trainer(model=ref_model, args=args(tmp_path / "ref"), train_dataset=dataset())
    ref.train()
    homes = []
    with rp.hf.wrap(hf, devices=["cpu"], device_step=True, resident_layers=4) as model:
        real_home = model.device_step.home
        monkeypatch.setattr(model.device_step, "home", lambda grads: (homes.append(grads), real_home(grads)))
        trainer = rp.hf.Trainer(model=model, args=args(tmp_path / "rp"), train_dataset=dataset())
        trainer.train()
        stats = model.memory_stats()["workers"]["cpu:0"]
        assert stats["device_step_layers"] == 2, stats   # the two decoder layers; the tied pair stays on the host
        assert homes == [True], homes   # once, when train() ends: not at each logged grad norm
        compare(trainer, ref, ref_model)
