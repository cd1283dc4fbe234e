"""rp.hf.wrap of MoE models with output_router_logits: HF's loss + coef * load-balancing loss, exactly (CPU, fp32)."""
import copy

import pytest
import torch

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from hf_grads import check_grads, rel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 64
BASE = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V, num_experts_per_tok=2, tie_word_embeddings=False, output_router_logits=True,
            router_aux_loss_coef=0.5)   # a large coefficient, so that a wrong aux term shows in every router gradient
CONFIGS = {
    "qwen3_moe": dict(num_experts=4, head_dim=8, moe_intermediate_size=16, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4),
}


def tiny(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(kind, **{**BASE, **CONFIGS[kind], **over})
    return AutoModelForCausalLM.from_config(cfg).float()


def batch(pad: str | None, b: int = 5, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (b, t), generator=g)
    if pad is None:
        return ids, None, ids.clone()
    mask = torch.ones_like(ids)
    for i, n in enumerate([t, 4, t - 1, 2, 6][:b]):
        if pad == "right":
            mask[i, n:] = 0
        else:
            mask[i, :t - n] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def router_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if ".gate.weight" in n and p.grad is not None}


@pytest.mark.parametrize("kind, pad, workers, over", [
    ("qwen3_moe", "right", 1, {}), ("qwen3_moe", "left", 2, {}),
    ("qwen3_moe", None, 2, dict(num_hidden_layers=3, mlp_only_layers=[1])),   # a dense layer: no router rows
    ("mixtral", "right", 2, {})])
def test_one_microbatch_equals_hf(kind, pad, workers, over):
    """One microbatch: the loss (LM + coef * aux) and every gradient, routers and experts included, are HF's."""
    ref = tiny(kind, **over)
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=1)
    ids, mask, labels = batch(pad)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    plain = tiny(kind, **over, output_router_logits=False)   # the same weights, no aux term
    plain(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
        model.synchronize()
        check_grads(model, ref)
        got, without = router_grads(model), router_grads(plain)
        assert got and all(rel(got[n], without[n]) > 1e-3 for n in got)   # the aux term reached every router
        logits = model(input_ids=ids, attention_mask=mask)   # forward only: logits, no aux
        keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        assert rel(logits[keep], out.logits.detach()[keep]) <= 1e-5


@pytest.mark.parametrize("kind, pad, workers, mbs", [("qwen3_moe", "left", 2, 2), ("mixtral", "right", 1, 3)])
def test_several_microbatches_add_per_microbatch_aux_weighted_by_size(kind, pad, workers, mbs):
    """Several microbatches: the LM loss is the batch's; the aux loss is each microbatch's own (HF run on that
    microbatch alone), weighted by its share of the batch's sequences b_m / B; gradients likewise."""
    ref = tiny(kind)
    model = rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=mbs)
    ids, mask, labels = batch(pad)
    b = ids.shape[0]
    n_items = int((labels[:, 1:] != -100).sum())
    sizes = [b // mbs + (1 if m < b % mbs else 0) for m in range(mbs)]   # the engine's split (uneven: first larger)
    coef, expected, start = ref.config.router_aux_loss_coef, 0.0, 0
    for size in sizes:
        part = slice(start, start + size)
        start += size
        out = ref(input_ids=ids[part], attention_mask=None if mask is None else mask[part], labels=labels[part],
                  num_items_in_batch=n_items)   # HF: this microbatch's summed CE / N + coef * its own aux
        term = out.loss + coef * (size / b - 1) * out.aux_loss
        term.backward()
        expected += term.item()
    with model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - expected) <= 1e-5 * expected
        model.synchronize()
        check_grads(model, ref)


def test_a_model_without_what_the_loss_needs_is_refused():
    """output_router_logits on a model lacking the loss's constants is a ValueError naming the missing part;
    with the flag off the model wraps and trains without the aux term."""
    moe = tiny("qwen3_moe")
    del moe.router_aux_loss_coef
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        rp.hf.wrap(moe, devices=["cpu"])
    ref = tiny("qwen3_moe", output_router_logits=False)
    ids, mask, labels = batch("right")
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"]) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()


def test_kept_graphs_carry_the_router_loss():
    """Under a roomy cap the backward stage on its forward's worker keeps that forward's graph (docs/planner.md,
    "Kept graphs"); the router statistics ride in the activation with their gradient, so the aux term still
    reaches every router: the loss and every gradient equal the recomputing, uncapped run's, bitwise."""
    ids, mask, labels = batch("right")
    plan = rp.Plan(forward=[range(0, 1), range(1, 3)], backward=[range(3, 6), range(1, 3), range(0, 1)])

    def run(cap):
        with rp.hf.wrap(tiny("qwen3_moe", num_hidden_layers=4), devices=["cpu"], num_microbatches=2, plan=plan,
                        device_memory=cap, resident_layers=0) as model:
            loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.synchronize()
            return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, model.memory_stats()["kept_graphs"]
    want_loss, want, none = run(None)
    loss, got, kept = run(1 << 30)
    assert none == [] and kept == [[1, 2]]
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
