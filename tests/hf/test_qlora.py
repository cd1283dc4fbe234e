"""QLoRA in the engine (issue 28): rp.hf.wrap over a bitsandbytes 4-bit PEFT model trains as PEFT + bitsandbytes
does on the CPU; the packed base lives once in host memory, is uploaded packed, never downloaded, and its
dequantized weights are made once per stage run, kept as the stage's weights and die with it; fused MoE experts
are quantized per expert."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

import roundpipe as rp
from roundpipe.quant import QuantLinear, from_bnb

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
from test_hf import batch, rel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

V = 96
# widths multiples of 64: bitsandbytes' AVX-512 CPU dequantizer is wrong for rows of 16k but not 64k values
# (docs/quantization.md), and this file compares with its forward
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=V, max_position_embeddings=64)
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(init=False):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=init)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> folder of a tiny fp32 random model (save_pretrained)."""
    out = {}
    for kind in ("llama", "qwen3"):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(kind, tie_word_embeddings=False, **SHAPE)
        path = tmp_path_factory.mktemp(kind)
        AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
        out[kind] = path
    return out


def bnb_model(path, quant_type="nf4", double_quant=True):
    """transformers' BitsAndBytesConfig(load_in_4bit=True) on the CPU (fp32 compute), in train mode: bitsandbytes
    repacks its CPU weights at an eval-mode forward without grad."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32,
                                                     device_map="cpu")
    return model.train()


def qlora(path, quant_type="nf4", double_quant=True, seed=0):
    torch.manual_seed(seed)
    return peft.get_peft_model(bnb_model(path, quant_type, double_quant), _lora()).train()


def reference(model, ids, mask, labels):
    """PEFT + bitsandbytes' loss and LoRA gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _lora_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _assert_trains_as(model, data, ref_loss, ref_grads, count):
    """One fp32 call's loss and its `count` LoRA gradients within 1e-5 relative of the reference's."""
    ids, mask, labels = data
    loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
    model.synchronize()
    assert rel(loss, ref_loss) <= 1e-5
    grads = _lora_grads(model)
    assert grads.keys() == ref_grads.keys() and len(grads) == count
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= 1e-5, (name, rel(g, ref_grads[name]))


@pytest.mark.parametrize("kind, pad, workers", [("llama", "right", 1), ("llama", "left", 2), ("llama", "left", 3),
                                                ("qwen3", "right", 3), ("qwen3", "left", 1)])
def test_loss_and_lora_gradients_equal_peft_bitsandbytes(saved, kind, pad, workers):
    """fp32: loss and every LoRA gradient of rp.hf.wrap over a bitsandbytes 4-bit PEFT model equal PEFT +
    bitsandbytes' within 1e-5 relative; the 14 Linear4bit are taken as they are (no host dequantization)."""
    ref = qlora(saved[kind])
    ids, mask, labels = batch(pad, b=4, t=9)
    ref_loss, ref_grads = reference(ref, ids, mask, labels)
    packed = ref.base_model.model.model.layers[1].mlp.up_proj.weight.data.clone()
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * workers, num_microbatches=workers + 1) as model:
        quantized = [m for m in model.hf_model.modules() if isinstance(m, QuantLinear)]
        assert len(quantized) == 14
        assert torch.equal(model.hf_model.base_model.model.model.layers[1].mlp.up_proj.weight, packed.reshape(-1))
        _assert_trains_as(model, (ids, mask, labels), ref_loss, ref_grads, 12)


def test_bf16_compute_within_bf16_tolerance(saved):
    """bf16 compute: loss and LoRA gradients within bf16 tolerance of PEFT + bitsandbytes in fp32 (the 4-bit
    weights dequantize to fp32 as the bitsandbytes layers' fp32 compute_dtype says, activations are bf16)."""
    ref = qlora(saved["llama"], "fp4", False)
    ids, mask, labels = batch("left", b=4, t=9)
    ref_loss, ref_grads = reference(ref, ids, mask, labels)
    with rp.hf.wrap(copy.deepcopy(ref), devices=["cpu"] * 2, compute_dtype=torch.bfloat16) as model:
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        model.synchronize()
        assert rel(loss, ref_loss) <= 1e-2
        for name, g in _lora_grads(model).items():
            # a bf16 rounding is 2^-9 relative; gradients go through ~10 rounded products
            err = ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert err <= 3e-2, (name, err)


def test_twenty_synchronous_steps_equal_peft_bitsandbytes_adamw(saved):
    """20 synchronous AdamW steps: losses and LoRA weights equal PEFT + bitsandbytes + torch AdamW within 1e-4."""
    ref = qlora(saved["qwen3"])
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for step in range(20):
        ids, mask, labels = batch("left" if step % 2 else "right", seed=step, b=3, t=8)
        ref_losses.append(reference(ref, ids, mask, labels)[0])
        ref_opt.step()
    with rp.hf.wrap(ours, devices=["cpu"] * 2) as model:
        opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
        for step in range(20):
            ids, mask, labels = batch("left" if step % 2 else "right", seed=step, b=3, t=8)
            loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.step(opt, asynchronous=False)
            assert rel(loss, ref_losses[step]) <= 1e-4, step
        model.synchronize()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert rel(p, ref_params[name]) <= 1e-4, name


def test_quantize_nf4_equals_peft_over_bitsandbytes_quantization(saved):
    """wrap(quantize='nf4') of an fp32 PEFT model quantizes its 14 base layers bitwise as bitsandbytes does (the
    same packed bytes as transformers' BitsAndBytesConfig), and trains as PEFT + bitsandbytes within 1e-5."""
    ref = qlora(saved["llama"])
    torch.manual_seed(0)
    plain = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.float32), _lora())
    ids, mask, labels = batch("right", b=4, t=9)
    ref_loss, ref_grads = reference(ref, ids, mask, labels)
    with rp.hf.wrap(plain, devices=["cpu"] * 2, quantize="nf4") as model:
        for name, m in model.hf_model.named_modules():
            if isinstance(m, QuantLinear):
                theirs = from_bnb(ref.get_submodule(name))
                assert torch.equal(m.weight, theirs.data) and torch.equal(m.absmax, theirs.absmax), name
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        model.synchronize()
        assert rel(loss, ref_loss) <= 1e-5
        for name, g in _lora_grads(model).items():
            assert rel(g, ref_grads[name]) <= 1e-5, name


def _bigger_qlora():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **{**SHAPE, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64})
    return peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), _lora())


def test_packed_base_lives_once_is_uploaded_packed_and_never_downloaded():
    """The packed weights and statistics are constant buffers: one arena block each, <= 0.56 host bytes per base
    weight in memory_stats; a call's parameter uploads carry exactly the stages' packed bytes, statistics and
    (LoRA, norm) upload copies; the downloads carry LoRA gradients and the rotary table only."""
    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    with rp.hf.wrap(_bigger_qlora(), devices=["cpu", "cpu"], plan=plan, quantize="nf4") as model:
        host = model.host
        blocks = [b for st in host.layers for b in st.constants]
        assert len(blocks) == 14 * 5 and all(host.owns(b) for b in blocks)
        assert len({b.data_ptr() for b in blocks}) == len(blocks)
        stats = model.memory_stats()["host"]
        assert stats["constant_buffers"] == sum(b.nbytes for b in blocks)
        assert stats["quantized_numel"] == 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)   # q, o; k, v; mlp
        assert stats["constant_buffers"] / stats["quantized_numel"] <= 0.56
        ids, mask, labels = batch("right", b=3, t=8)
        with model.record_trace() as trace:
            model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        per_layer = [sum(t.nbytes for t in (*st.upload, *st.buffers)) for st in host.layers]   # buffers: + rotary
        uploads = 2 * (per_layer[0] + per_layer[1]) + per_layer[2] + per_layer[3]   # F[0-1], fused[2-3], B[0-1]
        copies = [e for e in trace.events if e.cat == "copy"]
        assert sum(e.args["bytes"] for e in copies if e.worker.endswith("param_up")) == uploads
        lora = sum(p.nbytes for p in model.parameters() if p.requires_grad)   # fp32 compute: fp32 gradients
        rotary = sum(st.buffers[i].nbytes for st in host.layers for i in st.written)
        assert sum(e.args["bytes"] for e in copies if e.worker.endswith("grad_down")) == lora + rotary


def test_dequantized_weights_are_kept_as_weights_for_the_stage_and_die():
    """Under a device-memory cap a CPU worker's ledger shows a stage's dequantized weights as weights (kept for the
    whole stage run: here one fused stage of both decoder layers, fp32), and nothing of a call is live after it
    but the uploaded weights kept for resident layers (the packed base among them)."""
    with rp.hf.wrap(_bigger_qlora(), devices=["cpu"], quantize="nf4", device_memory=1 << 30) as model:
        ids, mask, labels = batch("left", b=2, t=8)
        model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        stats = model.memory_stats()["workers"]["cpu:0"]
        dequantized = 2 * 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)   # two layers' q, o; k, v; mlp
        assert stats["peak"]["weights"] >= dequantized
        # what stays: the packed 4-bit bytes and other weights kept for resident layers, never a dequantized one
        assert 0 < stats["current"]["weights"] == stats["resident_bytes"] < dequantized, stats
        assert all(v == 0 for k, v in stats["current"].items() if k != "weights"), stats["current"]


def _stage_runs(monkeypatch):
    """[(stage layers, dequantizations its keep made)] of every stage run, and a count of every dequantization."""
    from roundpipe.engine.calls import stage
    from roundpipe.quant import experts, linear

    runs, calls = [], [0]
    release = stage.StageRun.release

    def recorded(run):
        runs.append((run.task.layers, run.keep.made if run.keep is not None else 0))
        release(run)
    monkeypatch.setattr(stage.StageRun, "release", recorded)
    for module, name in ((linear, "dequantize"), (experts, "dequantize")):
        original = getattr(module, name)

        def counted(*args, _original=original, **kwargs):
            calls[0] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return runs, calls


@pytest.mark.parametrize("microbatches", [2, 4])
def test_each_weight_is_dequantized_once_per_stage_run(monkeypatch, microbatches):
    """Every 4-bit weight is dequantized once per stage run that holds it, whatever the microbatch count (7 a
    decoder layer: F[0-1] and B[0-1] hold layer 1, fused[2-3] layer 2), and loss and LoRA gradients are bitwise
    those of dequantizing before every product."""
    from roundpipe.quant.keep import DequantKeep

    plan = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])
    ids, mask, labels = batch("right", b=4, t=8)

    def run():
        with rp.hf.wrap(_bigger_qlora(), devices=["cpu", "cpu"], plan=plan, num_microbatches=microbatches,
                        microbatches_per_round=microbatches, quantize="nf4") as model:
            loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.synchronize()
            return loss, {n: g.clone() for n, g in _lora_grads(model).items()}
    runs, calls = _stage_runs(monkeypatch)
    loss, grads = run()
    assert sorted((r.start, made) for r, made in runs) == [(0, 7), (0, 7), (2, 7)]
    assert calls[0] == 21
    monkeypatch.setattr(DequantKeep, "get", lambda self, key, make: make())   # per product, as before
    runs.clear()
    ref_loss, ref_grads = run()
    assert calls[0] > 21 * microbatches
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
           max_position_embeddings=64, tie_word_embeddings=False)


@pytest.mark.parametrize("pad, workers", [("right", 1), ("left", 2)])
def test_qwen3_moe_experts_are_quantized_and_train_as_their_dequantized_weights(monkeypatch, pad, workers):
    """quantize='nf4' on a tiny Qwen3-MoE with LoRA on attention: the fused experts become QuantExperts (4-bit per
    expert, bitwise bitsandbytes' per-expert quantization: tests/quant/test_quant4.py), the routers stay; loss and every
    LoRA gradient equal the same PEFT model over the dequantized weights (fp32) within 1e-5, and each 4-bit tensor
    (4 attention Linears and 2 expert tensors a layer) is dequantized once per stage run that holds it."""
    from roundpipe.quant import QuantExperts

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **MOE)).float()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    ours = peft.get_peft_model(base, lora).train()
    ref = copy.deepcopy(ours)
    ids, mask, labels = batch(pad, b=4, t=9)
    runs, calls = _stage_runs(monkeypatch)
    with rp.hf.wrap(ours, devices=["cpu"] * workers, num_microbatches=workers + 1, quantize="nf4") as model:
        hf = model.hf_model
        experts = {n: m for n, m in hf.named_modules() if isinstance(m, QuantExperts)}
        linears = {n: m for n, m in hf.named_modules() if isinstance(m, QuantLinear)}
        assert len(experts) == 2 and len(linears) == 8
        assert not any(type(m).__name__ == "Qwen3MoeExperts" and list(m.parameters()) for m in hf.modules())
        assert all(m.weight.dtype == torch.float32 for n, m in hf.named_modules() if n.endswith("mlp.gate"))
        stats = model.memory_stats()["host"]
        # q, o; k, v; experts' gate_up [4, 64, 64] and down [4, 64, 32], two layers
        assert stats["quantized_numel"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 4 * 64 * 64 + 4 * 64 * 32)
        with torch.no_grad():
            for n, m in experts.items():
                for name in m.quantized:
                    getattr(ref.get_submodule(n), name).copy_(m.dequantized(name, torch.float32))
            for n, m in linears.items():
                ref.get_submodule(n).weight.copy_(m.dequantized(torch.float32))
        ref_loss, ref_grads = reference(ref, ids, mask, labels)
        calls[0] = 0
        _assert_trains_as(model, (ids, mask, labels), ref_loss, ref_grads, 16)
    decoder = [sum(1 for l in r if l in (1, 2)) for r, _ in runs]
    assert runs and all(made == 6 * n for (_, made), n in zip(runs, decoder)), runs
    # + the planner's dry run, each of the 12 tensors once: one worker without a cap makes none (autoplan.sized_only)
    assert calls[0] == sum(made for _, made in runs) + (12 if workers > 1 else 0)


def test_dry_run_counts_kept_dequantized_weights_as_weight_bytes():
    """The planner's dry run gives a 4-bit layer the packed bytes plus its weight dequantized in the compute dtype
    as weight bytes (kept for the whole stage), not as workspace or saved activations, on the CPU and meta paths."""
    from roundpipe.engine.autoplan import size_costs
    from roundpipe.quant import QuantExperts

    torch.manual_seed(0)
    frozen = nn.Linear(256, 128, bias=False).requires_grad_(False)
    quant = QuantLinear.from_linear(frozen, "nf4")
    packed = sum(b.nbytes for b in quant.buffers())
    sample = ((torch.randn(4, 256),), {})
    for dtype in (torch.float32, torch.bfloat16):
        plain, = size_costs([frozen], sample, dtype, "cpu")
        ours, = size_costs([quant], sample, dtype, "cpu")
        assert ours.param_bytes == packed + 128 * 256 * dtype.itemsize == packed + plain.param_bytes
        assert ours.memory.nograd <= plain.memory.nograd and ours.memory.backward <= plain.memory.backward
        meta, = size_costs([copy.deepcopy(quant).to("meta")], sample, dtype, "cpu")
        assert meta.param_bytes == ours.param_bytes

    class Moe(nn.Module):   # routes every token to experts 0 and 1
        def __init__(self):
            super().__init__()
            cfg = AutoConfig.for_model("qwen3_moe", **MOE)
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
            self.experts = Qwen3MoeExperts(cfg).requires_grad_(False)
            nn.init.normal_(self.experts.gate_up_proj), nn.init.normal_(self.experts.down_proj)

        def forward(self, x):
            idx = torch.tensor([[0, 1]]).expand(x.shape[0], 2)
            return self.experts(x, idx, torch.full((x.shape[0], 2), 0.5, dtype=x.dtype))
    layer = Moe()
    layer.experts = QuantExperts(layer.experts, "nf4")
    cost, = size_costs([nn.Identity(), layer], ((torch.randn(4, 64),), {}), torch.float32, "cpu")[1:]
    packed = sum(b.nbytes for b in layer.buffers())
    assert cost.param_bytes == packed + 4 * 4 * 3 * 64 * 32
    assert cost.act_bytes < 4 * 64 * 32 * 4   # the experts' saved weights are not activations


def test_save_pretrained_writes_the_adapter_and_checkpoints_resume_bitwise(saved, tmp_path):
    """save_pretrained writes the adapter only; save_checkpoint leaves the packed base out, and a fresh wrap
    that loads it goes on bitwise, its base blocks untouched."""
    def run(model, opt, steps):
        for step in steps:
            ids, mask, labels = batch("right", seed=step, b=3, t=8)
            model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
            model.step(opt, asynchronous=True)
        model.synchronize()
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def fresh():
        model = rp.hf.wrap(qlora(saved["llama"]), devices=["cpu"] * 2)
        return model, rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = fresh()
    with model:
        run(model, opt, range(2))
        model.save_pretrained(tmp_path / "adapter")
        model.save_checkpoint(tmp_path / "ckpt", opt)
        expected = run(model, opt, range(2, 4))
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    from safetensors import safe_open
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if "base_layer" in k and f.get_slice(k).get_dtype() == "U8"]
    model, opt = fresh()
    with model:
        base = {n: (b.data_ptr(), b.clone()) for n, b in model.named_buffers() if b.dtype == torch.uint8}
        model.load_checkpoint(tmp_path / "ckpt", opt)
        assert all(b.data_ptr() == base[n][0] and torch.equal(b, base[n][1])
                   for n, b in model.named_buffers() if n in base)
        got = run(model, opt, range(2, 4))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in got)


def test_from_pretrained_reads_a_bitsandbytes_4bit_checkpoint(saved, tmp_path):
    """A checkpoint transformers saved from a bitsandbytes 4-bit model loads without bitsandbytes' loader: the
    same packed states, the same loss; with peft_config the adapters wrap its base layers."""
    bnb = bnb_model(saved["llama"], "fp4", True)
    bnb.save_pretrained(tmp_path / "bnb")
    ids, mask, labels = batch("left", b=3, t=8)
    with torch.no_grad():
        expected = bnb(input_ids=ids, attention_mask=mask, labels=labels).loss
    with rp.hf.from_pretrained(tmp_path / "bnb", devices=["cpu"]) as model:
        for name, m in model.hf_model.named_modules():
            if isinstance(m, QuantLinear):
                theirs = from_bnb(bnb.get_submodule(name))
                assert torch.equal(m.weight, theirs.data) and torch.equal(m.absmax, theirs.absmax), name
        assert sum(isinstance(m, QuantLinear) for m in model.hf_model.modules()) == 14
        model.eval()
        logits = model(input_ids=ids, attention_mask=mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        assert rel(loss, expected) <= 1e-5
    with rp.hf.from_pretrained(tmp_path / "bnb", devices=["cpu"], peft_config=_lora(init=True)) as model:
        layer = model.hf_model.base_model.model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj.base_layer, QuantLinear)
        assert sum(p.requires_grad for p in model.parameters()) == 12
        loss = model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        assert rel(loss, expected) <= 1e-5   # B = 0: the adapter adds nothing yet


def test_bad_quantize_arguments_name_themselves(saved):
    """Unknown quantize values, a 4-bit weight that requires grad, a frozen matrix quantize= cannot take and a
    model with nothing frozen to quantize are errors naming them."""
    with pytest.raises(ValueError, match=r"quantize='nf8'.*\(None, 'nf4', 'fp4'\)"):
        rp.hf.wrap(_bigger_qlora(), quantize="nf8")
    import bitsandbytes
    model = _bigger_qlora()
    model.base_model.model.model.layers[0].mlp.up_proj = bitsandbytes.nn.Linear4bit(256, 512, bias=False)
    model.base_model.model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)   # not yet quantized: float
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: the Params4bit requires grad"):
        rp.hf.wrap(model)

    class Proj(nn.Module):   # a Linear-like layer that is not an nn.Linear
        def __init__(self, linear):
            super().__init__()
            self.weight = linear.weight

        def forward(self, x):
            return x @ self.weight.t()
    model = _bigger_qlora()
    mlp = model.base_model.model.model.layers[1].mlp
    mlp.up_proj = Proj(mlp.up_proj)
    with pytest.raises(TypeError, match=r"model.layers.1.mlp.up_proj.weight is a frozen \(512, 256\) weight of a Proj"):
        rp.hf.wrap(model, quantize="fp4")
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE))
    with pytest.raises(ValueError, match=r"no frozen Linear.*model.layers.0.self_attn.q_proj.weight requires grad"):
        rp.hf.wrap(full, quantize="nf4")


def test_train_hf_lora_quantize_command(tmp_path, capsys):
    """`roundpipe train --hf DIR --lora 4 --quantize nf4` trains a LoRA adapter over a 4-bit base and --save writes
    the adapter only; --quantize without --lora is a usage error naming it."""
    from test_train_hf import local_checkpoint, text_folder

    from roundpipe.commands.train import main

    local_checkpoint(tmp_path / "model")
    data = text_folder(tmp_path / "data")
    out = tmp_path / "adapter"
    rc = main(["--hf", str(tmp_path / "model"), "--data", str(data), "--steps", "6", "--batch-size", "2",
               "--seq-len", "12", "--lr", "0.01", "--devices", "cpu,cpu", "--eval-batches", "1", "--no-progress",
               "--lora", "4", "--quantize", "nf4", "--save", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "trained, base nf4)" in text and "tokens/s" in text
    start, end = (float(w) for w in text.split("held-out loss: start ")[1].split("  (")[0].split("  end "))
    assert end < start
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(SystemExit) as e:
        main(["--hf", str(tmp_path / "model"), "--steps", "1", "--quantize", "fp4"])
    assert e.value.code == 2 and "give lora" in capsys.readouterr().err


def test_quant_state_is_cached_without_holding_the_buffers():
    """quant_state is the same object while its buffers are; a rebinding (as a worker's replica does) gives a
    state over the new buffers, and the cache keeps neither the old buffers nor the state alive."""
    import pickle
    import weakref

    torch.manual_seed(0)
    q = QuantLinear.from_linear(nn.Linear(64, 96, bias=False).requires_grad_(False))
    first = q.quant_state
    assert q.quant_state is first
    expected = rp.quant.dequantize(first, torch.float32)
    old = weakref.ref(q._buffers["weight"])
    q._buffers["weight"] = q._buffers["weight"].clone()
    rebound = q.quant_state
    assert rebound is not first and rebound.data is q._buffers["weight"]
    del first
    assert old() is None
    gone = weakref.ref(rebound)
    del rebound
    assert gone() is None
    again = q.quant_state   # rebuilt over the same buffers without re-validation
    assert again.data is q._buffers["weight"] and again.absmax is q._buffers["absmax"]
    assert again.shape == torch.Size([96, 64]) and again.quant_type == "nf4" and again.double_quant
    torch.testing.assert_close(rp.quant.dequantize(again, torch.float32), expected, rtol=0, atol=0)
    x = torch.randn(3, 64)
    for other in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        torch.testing.assert_close(other(x), q(x), rtol=0, atol=0)


def test_constant_fingerprint_sees_dtype_shape_and_sampled_bytes():
    """The fingerprint of a constant buffer changes with its dtype, its shape and a byte it samples."""
    from roundpipe.engine.state.base_tensors import fingerprint

    t = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    base = fingerprint(t)
    assert fingerprint(t.clone()) == base
    assert fingerprint(t.view(torch.int8)) != base
    assert fingerprint(t.view(1024, 1024)) != base
    for i in (0, t.numel() - 1, 5 * (t.numel() - 1024) // 63):
        u = t.clone()
        u[i] ^= 1
        assert fingerprint(u) != base, i
    small = torch.zeros(300, dtype=torch.float32)
    changed = small.clone()
    changed[137] = 1.0
    assert fingerprint(small) != fingerprint(changed)   # small tensors are hashed whole


def test_checkpoint_refuses_a_model_over_another_base(saved, tmp_path):
    """A checkpoint records fingerprints of the base it left out: loading it into a model over another base (FP4
    instead of NF4) is a ValueError naming the layer and the buffer before anything changes; without the record
    (an older checkpoint) it loads."""
    with rp.hf.wrap(qlora(saved["llama"]), devices=["cpu"]) as model:
        ids, mask, labels = batch("right", b=2, t=8)
        model.forward_backward(input_ids=ids, attention_mask=mask, labels=labels)
        model.synchronize()
        model.save_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    constants = manifest["constants"]
    assert constants and all(set(v) == {"layer", "fingerprint"} for v in constants.values())
    assert any(n.endswith("q_proj.base_layer.weight") for n in constants)
    with rp.hf.wrap(qlora(saved["llama"], quant_type="fp4"), devices=["cpu"]) as other:
        before = {n: p.detach().clone() for n, p in other.named_parameters()}
        with pytest.raises(ValueError, match=r"layer \d+: the base tensor '[^']*base_layer\.weight' differs"):
            other.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    with rp.hf.wrap(qlora(saved["llama"]), devices=["cpu"]) as same:
        same.load_checkpoint(tmp_path / "ckpt")
    del manifest["constants"]
    (tmp_path / "ckpt" / "checkpoint.json").write_text(json.dumps(manifest))
    with rp.hf.wrap(qlora(saved["llama"], quant_type="fp4"), devices=["cpu"]) as other:
        other.load_checkpoint(tmp_path / "ckpt")
