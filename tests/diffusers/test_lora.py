"""LoRA on wrapped diffusion transformers: losses and LoRA gradients equal plain diffusers + PEFT training, the
adapter written by save_lora_weights loads with diffusers' own LoRA loader to equal outputs, a user loss_fn
and per-sample weighting, and PEFT's adapter switch reaching the workers.  Tiny random Flux, SD3 and Wan
(test_wrap.py's configs), fp32, seeded; batch 3 equals a conditioning tensor's length."""
import copy

import pytest

# "diffusers.models", not "diffusers": with tests/ on sys.path (conftest.py) this folder imports as a
# namespace package named diffusers when the real one is missing, and the skip would not happen
pytest.importorskip("diffusers.models")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
from test_wrap import assert_same_training, batch_of, build, reference_steps, roundpipe_steps  # noqa: E402

import roundpipe.diffusers as rpd  # noqa: E402

TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"],
           "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj"],
           "wan": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj"]}


def with_lora(kind: str, seed: int = 0):
    t = build(kind, seed)
    torch.manual_seed(100 + seed)   # B nonzero: every LoRA weight has a gradient from the first step
    t.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=TARGETS[kind]))
    for name, p in t.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return t


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1worker", "2workers"])
@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_lora_training_equals_diffusers_peft(kind, devices):
    """Two AdamW steps over 3 microbatches: losses and LoRA gradients of diffusers + PEFT within 1e-5, the base
    frozen (no gradient), the trained adapter weights equal."""
    t = with_lora(kind)
    batches = [batch_of(kind, t, seed=s) for s in (1, 2)]
    ref_model = copy.deepcopy(t)
    ref = reference_steps(ref_model, batches)
    with rpd.wrap(t, devices=devices, num_microbatches=3) as model:
        ours = roundpipe_steps(model, batches)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in ours[1])
    assert_same_training(ref, ours)
    for n, p in ref_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n], p.detach(), atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_adapter_round_trip_through_diffusers_loader(kind, tmp_path):
    """save_lora_weights writes diffusers' LoRA file; diffusers' loader (the family's lora_state_dict, then the
    transformer's load_lora_adapter, as FluxPipeline.load_lora_weights runs them) puts it into a fresh
    transformer with the same base, whose output then equals the trained one's."""
    from diffusers.loaders import FluxLoraLoaderMixin, SD3LoraLoaderMixin, WanLoraLoaderMixin
    loader = {"flux": FluxLoraLoaderMixin, "sd3": SD3LoraLoaderMixin, "wan": WanLoraLoaderMixin}[kind]
    t = with_lora(kind)
    inputs, target = batch_of(kind, t)
    with rpd.wrap(t, devices=["cpu", "cpu"], num_microbatches=2) as model:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.forward_backward(target=target, **inputs)
        model.step(opt)
        model.save_lora_weights(tmp_path)
        with torch.no_grad():
            trained = model(**inputs)
    state, metadata = loader.lora_state_dict(tmp_path, return_lora_metadata=True)
    fresh = build(kind)
    fresh.load_lora_adapter(state, prefix="transformer", metadata=metadata)
    with torch.no_grad():
        loaded = fresh(**inputs).sample
        base = build(kind)(**inputs).sample
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)
    assert (loaded - base).abs().max() > 1e-3   # the adapter changed the output


def test_user_loss_fn_weighting_and_noise_prediction():
    """A user loss_fn gets the microbatch's output and labels; weighting= and prediction="noise" give the
    weighted mean diffusers' scripts compute, on the whole batch."""
    t = with_lora("flux")
    inputs, _ = batch_of("flux", t)
    torch.manual_seed(5)
    x0 = torch.randn_like(inputs["hidden_states"])
    noise = torch.randn_like(x0)
    noisy, target = rpd.flow_matching_inputs(x0, noise, inputs["timestep"], prediction="noise")
    inputs["hidden_states"] = noisy
    weighting = torch.tensor([0.5, 1.0, 2.0])
    ref = copy.deepcopy(t)
    expected = rpd.diffusion_loss(ref(**inputs).sample, {"target": target, "weighting": weighting})
    expected.backward()
    seen = []

    def loss_fn(pred, labels):
        seen.append(pred.shape[0])
        return rpd.diffusion_loss(pred, labels)
    with rpd.wrap(t, devices=["cpu"], num_microbatches=3) as model:
        loss = model.forward_backward(target=target, weighting=weighting, loss_fn=loss_fn, **inputs)
        model.synchronize()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(seen) == {1} and len(seen) >= 3   # 3 microbatches of one sample (and the planner's dry run)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_disable_adapters_reaches_the_workers():
    """transformer.disable_adapters() (diffusers' PEFT switch) before a call runs the base model on the workers."""
    t = with_lora("sd3").eval()
    inputs, _ = batch_of("sd3", t)
    with torch.no_grad():
        base = build("sd3")(**inputs).sample
        adapted = t(**inputs).sample
    with rpd.wrap(t, devices=["cpu"]) as model, torch.no_grad():
        t.disable_adapters()
        off = model(**inputs)
        t.enable_adapters()
        on = model(**inputs)
    torch.testing.assert_close(off, base, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(on, adapted, atol=1e-6, rtol=1e-5)
