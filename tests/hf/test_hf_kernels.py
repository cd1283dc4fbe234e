"""patch_kernels: tiny random Llama/Qwen3 models run our kernels (Triton interpreter) with HF's logits and gradients."""
import copy

import pytest
import torch
from _kernel_util import assert_launched, assert_within_torch_error, spy_launches
from torch import nn

transformers = pytest.importorskip("transformers")

from roundpipe.hf.kernels import patch_kernels, unpatch_kernels  # noqa: E402


def _config(family: str):
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attn_implementation="eager")
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                           **common)
    if family == "gemma":
        return transformers.GemmaConfig(head_dim=16, **common)
    return transformers.Qwen3Config(head_dim=16, **common)


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).float()
    with torch.no_grad():   # HF initialises norm weights to ones, which would hide a weight-indexing bug
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


# per decoder layer: input/post-attention norms, the MLP, the attention (Qwen3 adds q_norm, k_norm); + the final norm.
# Qwen3-MoE's experts are one fused module (no gate_proj/up_proj/down_proj submodules): its MLPs stay HF's.
# Gemma's norms compute x * (1 + weight) and its MLP is GELU: only its rotary application is ours.
EXPECTED = {"llama": {"rms_norm": 2 * 2 + 1, "swiglu": 2, "rope": 2},
            "qwen2": {"rms_norm": 2 * 2 + 1, "swiglu": 2, "rope": 2},
            "qwen3": {"rms_norm": 4 * 2 + 1, "swiglu": 2, "rope": 2},
            "qwen3_moe": {"rms_norm": 4 * 2 + 1, "rope": 2},
            "gemma": {"rope": 2}}


def _batch():
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                      # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_patched_model_matches_hf_logits_loss_and_gradients(monkeypatch, family):
    """With force=True the patched fp32 model's logits, loss and every gradient equal the unpatched model's."""
    launched = spy_launches(monkeypatch)
    model = _model(family)
    reference = copy.deepcopy(model)
    count = patch_kernels(model, force=True)
    kinds = {}
    for module in model.modules():
        kind = getattr(module, "_roundpipe_kernel", None)
        if kind:
            kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds == EXPECTED[family] and count == sum(kinds.values()), kinds
    batch = _batch()
    out, ref = model(**batch), reference(**batch)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    kernel_names = {"rms_norm": "_rms_norm_fwd_kernel", "swiglu": "_swiglu_fwd_kernel", "rope": "_rope_kernel"}
    assert {kernel_names[k] for k in kinds} == set(launched), set(launched)
    out.loss.backward()
    ref.loss.backward()
    backward_names = {"rms_norm": "_rms_norm_bwd_kernel", "swiglu": "_swiglu_bwd_kernel", "rope": "_rope_kernel"}
    assert_launched(launched, *{backward_names[k] for k in kinds})
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def test_cpu_devices_patch_nothing_unless_forced():
    """Without a CUDA device among the targets nothing is patched; a second forced call patches nothing new."""
    model = _model("llama")
    assert patch_kernels(model, devices=["cpu"]) == 0
    if not torch.cuda.is_available():
        assert patch_kernels(model) == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert patch_kernels(model, force=True) == 9
    assert patch_kernels(model, force=True) == 0
    assert unpatch_kernels(model) == 9
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_deepcopy_rebinds_patches_to_the_copy():
    """roundpipe's replicas are deep copies: each patched forward runs on the copy's own weights."""
    model = _model("llama")
    patch_kernels(model, force=True)
    replica = copy.deepcopy(model)
    for original, copied in zip(model.modules(), replica.modules()):
        if "forward" in original.__dict__:
            assert copied.forward.__self__ is copied
    with torch.no_grad():
        replica.model.norm.weight.mul_(2)
    ids = torch.randint(0, 97, (1, 5))
    assert not torch.allclose(model(input_ids=ids).logits, replica(input_ids=ids).logits)


class OffsetRMSNorm(nn.Module):
    """Gemma's form: x / rms * (1 + weight); an RMSNorm by name that our kernel does not compute."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class GeluMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, 8), nn.Linear(hidden, 8)
        self.down_proj, self.act_fn = nn.Linear(8, hidden), nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SiluMLPWithScale(GeluMLP):
    """SiLU, but its forward doubles the result: the probe, not the attributes, decides."""

    def __init__(self, hidden):
        super().__init__(hidden)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return 2 * super().forward(x)


def test_look_alikes_with_other_semantics_stay_unpatched():
    """An offset RMSNorm, a GELU MLP and a SiLU MLP with a different forward are left alone."""
    model = nn.Sequential(OffsetRMSNorm(6), GeluMLP(6), SiluMLPWithScale(6))
    assert patch_kernels(model, force=True) == 0


def test_bad_arguments_name_the_argument():
    """A non-module, a bad force flag and a bad device list raise errors naming them."""
    with pytest.raises(TypeError, match="hf_model must be a torch.nn.Module"):
        patch_kernels("Qwen/Qwen3-0.6B")
    with pytest.raises(TypeError, match="force='yes'"):
        patch_kernels(nn.Linear(2, 2), force="yes")
    with pytest.raises(ValueError, match="devices entry 'tpu:0'"):
        patch_kernels(nn.Linear(2, 2), devices=["tpu:0"])


def test_patched_model_through_rp_hf_wrap_on_cpu_workers(monkeypatch):
    """A patched model wrapped by rp.hf.wrap (per-worker deep-copied replicas, 2 microbatches) keeps HF's loss and
    gradients, and the kernels run inside the workers."""
    import roundpipe as rp

    launched = spy_launches(monkeypatch)
    model = _model("qwen3")
    reference = copy.deepcopy(model)
    assert patch_kernels(model, force=True) == 13
    batch = _batch()
    wrapped = rp.hf.wrap(model, devices=["cpu", "cpu"], num_microbatches=2, compute_dtype=torch.float32)
    try:
        loss = wrapped.forward_backward(**batch)
        wrapped.synchronize()
        grads = {name: p.grad for name, p in wrapped.named_parameters()}
    finally:
        wrapped.close()
    ref = reference(**batch)
    ref.loss.backward()
    torch.testing.assert_close(loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert_launched(launched, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_swiglu_bwd_kernel", "_rope_kernel")


@pytest.mark.cuda
def test_cuda_patch_without_force_runs_compiled_kernels_close_to_hf(monkeypatch):
    """On a GPU patch_kernels needs no force; in bf16 the patched model's logits and gradients are at most ~2x as
    far from the fp32 model as HF's own bf16 model (STYLE.md point 4)."""
    launched = spy_launches(monkeypatch, "cuda")
    fp32 = _model("qwen3").cuda()
    hf_bf16, ours = copy.deepcopy(fp32).bfloat16(), copy.deepcopy(fp32).bfloat16()
    assert patch_kernels(ours) == sum(EXPECTED["qwen3"].values())
    batch = {k: v.cuda() for k, v in _batch().items()}
    outs = {name: m(**batch) for name, m in (("fp32", fp32), ("hf", hf_bf16), ("ours", ours))}
    for out in outs.values():
        out.loss.backward()
    assert_within_torch_error("logits", outs["ours"].logits.float(), outs["hf"].logits.float(), outs["fp32"].logits,
                              atol=1e-2)
    hf_grads, our_grads = dict(hf_bf16.named_parameters()), dict(ours.named_parameters())
    for name, p in fp32.named_parameters():
        assert_within_torch_error(name, our_grads[name].grad.float(), hf_grads[name].grad.float(), p.grad, atol=1e-3)
    assert_launched(launched, "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_swiglu_fwd_kernel",
                    "_swiglu_bwd_kernel", "_rope_kernel")
