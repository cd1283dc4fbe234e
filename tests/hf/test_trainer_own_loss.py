"""rp.hf.TrainerMixin in front of any Trainer subclass: its arguments bound to that subclass's own signature, and
a compute_loss of its own (a subclass's, label smoothing, compute_loss_func=) trained as transformers trains it."""
import copy

import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from test_hf_trainer import args, compare, dataset, logged, tiny  # noqa: E402


class RefFirst(transformers.Trainer):
    """A Trainer whose second parameter is not `args` (TRL's DPOTrainer and KTOTrainer: ref_model)."""

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        self.ref = ref_model
        super().__init__(model=model, args=args, **kwargs)


class RPRefFirst(rp.hf.TrainerMixin, RefFirst):
    pass


def test_arguments_bind_to_the_subclass_signature(tmp_path):
    """args given by keyword or in the subclass's own position land in its `args`, not in its second parameter."""
    given = args(tmp_path / "kw")
    by_keyword = RPRefFirst(model=tiny(), args=given, train_dataset=dataset(), devices=["cpu"])
    with by_keyword.rp_model:
        assert by_keyword.ref is None and by_keyword.args.output_dir == given.output_dir
    given = args(tmp_path / "pos")
    by_position = RPRefFirst(tiny(), "ref", given, train_dataset=dataset(), devices=["cpu"])
    with by_position.rp_model:
        assert by_position.ref == "ref" and by_position.args.output_dir == given.output_dir
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_parameter'"):
        RPRefFirst(model=tiny(), args=given, not_a_parameter=1, devices=["cpu"])


def smoothed_loss(logits, labels):
    """A loss of the subclass's own: label-smoothed cross-entropy of the shifted labels, plus a z-loss term."""
    logits = logits.float()[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=0.2)
    return ce + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()


class OwnLoss(transformers.Trainer):
    """A Trainer subclass with its own compute_loss over ordinary batches (input_ids, attention_mask, labels)."""
    loss_is_scaled_for_ga = False   # a per-batch mean: the Trainer divides it by the accumulation steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = smoothed_loss(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


class RPOwnLoss(rp.hf.TrainerMixin, OwnLoss):
    pass


def test_own_compute_loss_trains_that_loss(tmp_path):
    """A subclass's compute_loss calls the model through the RoundPipe, and its loss, not the plain LM loss, is what
    trains: the same logged losses, grad norms and final weights as the transformers.Trainer subclass, 2 workers and
    3 microbatches."""
    hf = tiny()
    ref_model = copy.deepcopy(hf)
    ref = OwnLoss(model=ref_model, args=args(tmp_path / "ref"), train_dataset=dataset())
    ref.train()
    trainer = RPOwnLoss(model=hf, args=args(tmp_path / "rp"), train_dataset=dataset(), devices=["cpu", "cpu"],
                        num_microbatches=3)
    with trainer.rp_model:
        trainer.train()
        compare(trainer, ref, ref_model)


def compute_loss_func(outputs, labels, num_items_in_batch=None):
    """Trainer(compute_loss_func=): the loss of the model's outputs."""
    return smoothed_loss(outputs.logits, labels)


@pytest.mark.parametrize("how", ["label_smoothing_factor", "compute_loss_func"])
def test_base_compute_loss_options_train_their_loss(tmp_path, how):
    """transformers.Trainer's own compute_loss with label smoothing or a compute_loss_func: the loss they define
    trains (not the plain LM loss), as under transformers.Trainer."""
    extra = {"compute_loss_func": compute_loss_func} if how == "compute_loss_func" else {}
    over = {"label_smoothing_factor": 0.2} if how == "label_smoothing_factor" else {}
    hf = tiny()
    ref_model = copy.deepcopy(hf)
    ref = transformers.Trainer(model=ref_model, args=args(tmp_path / "ref", **over), train_dataset=dataset(), **extra)
    ref.train()
    plain = transformers.Trainer(model=copy.deepcopy(hf), args=args(tmp_path / "plain"), train_dataset=dataset())
    plain.train()
    # a loss of its own: other gradients (near-uniform logits make the smoothed loss's value close to the plain one's)
    assert logged(ref)[0]["grad_norm"] != pytest.approx(logged(plain)[0]["grad_norm"], rel=1e-2)
    trainer = rp.hf.Trainer(model=hf, args=args(tmp_path / "rp", **over), train_dataset=dataset(),
                            devices=["cpu", "cpu"], **extra)
    with trainer.rp_model:
        trainer.train()
        compare(trainer, ref, ref_model)


def test_plain_trainer_keeps_the_fast_path(tmp_path, monkeypatch):
    """transformers.Trainer's compute_loss without label smoothing or compute_loss_func: every batch is one
    forward_backward on the workers (the fused loss), no forward-only call."""
    hf = tiny()
    trainer = rp.hf.Trainer(model=hf, args=args(tmp_path), train_dataset=dataset(), devices=["cpu"])
    with trainer.rp_model as model:
        calls = []
        forward_backward = model.forward_backward
        monkeypatch.setattr(model, "forward_backward", lambda **kw: calls.append(1) or forward_backward(**kw))
        monkeypatch.setattr(type(model), "__call__", lambda *a, **kw: pytest.fail("a forward-only call"))
        trainer.train()
    assert len(calls) == 3 * 2   # max_steps 3, gradient accumulation 2
