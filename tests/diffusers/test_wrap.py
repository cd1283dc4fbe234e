"""rp.diffusers.wrap: the layers reproduce diffusers' forward, full fine-tuning equals plain diffusers training,
microbatches are split by argument name, and bad input is refused by name.  Tiny random Flux, SD3 and Wan
transformers (fp32, seeded); the tiny configs and the reference loop are shared with test_lora.py."""
import copy
import subprocess
import sys

import pytest

# "diffusers.models", not "diffusers": with tests/ on sys.path (conftest.py) this folder imports as a
# namespace package named diffusers when the real one is missing, and the skip would not happen
pytest.importorskip("diffusers.models")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import roundpipe.diffusers as rpd  # noqa: E402
from roundpipe.diffusers.layers import FluxOutput, check_forward, cut_layers  # noqa: E402
from roundpipe.diffusers.model import SampleSplit  # noqa: E402
from roundpipe.diffusers.presets import FAMILIES, example_inputs  # noqa: E402

# Tiny configs that still take every path: Flux with guidance, SD3 with dual attention (3.5) and qk-norm,
# Wan with an image embedding (I2V) and added k/v projections.
TINY = {
    "flux": ("FluxTransformer2DModel",
             dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
                  axes_dims_rope=(4, 6, 6))),
    "sd3": ("SD3Transformer2DModel",
            dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                 joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
                 pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")),
    "wan": ("WanTransformer3DModel",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, image_dim=8,
                 added_kv_proj_dim=24)),
}
# Pixel sizes chosen so that the batch of 3 equals a conditioning length: Flux 16x48 px -> 3 image tokens,
# and text_len=3 -> txt_ids [3, 3]; SD3 and Wan: 3 text tokens.
SIZES = {"flux": (16, 48, None), "sd3": (16, 32, None), "wan": (16, 32, 5)}
BATCH = 3


def build(kind: str, seed: int = 0, device: str | None = None) -> nn.Module:
    import diffusers
    name, cfg = TINY[kind]
    torch.manual_seed(seed)
    if device == "meta":
        with torch.device("meta"):
            return getattr(diffusers, name)(**cfg)
    return getattr(diffusers, name)(**cfg)


def batch_of(kind: str, transformer: nn.Module, seed: int = 1, batch: int = BATCH) -> tuple[dict, torch.Tensor]:
    """(the transformer's inputs at noisy latents, the flow-matching target), seeded."""
    torch.manual_seed(seed)
    h, w, frames = SIZES[kind]
    inputs = example_inputs(transformer, batch, h, w, frames=frames, text_len=3)
    if kind == "wan":
        inputs["encoder_hidden_states_image"] = inputs["encoder_hidden_states_image"][:, :2]   # 2 CLIP tokens
    x0 = torch.randn_like(inputs["hidden_states"])
    sigmas = torch.rand(batch)
    noisy, target = rpd.flow_matching_inputs(x0, torch.randn_like(x0), sigmas)
    inputs["hidden_states"] = noisy
    inputs["timestep"] = sigmas if kind == "flux" else sigmas * 1000
    return inputs, target


def reference_steps(transformer: nn.Module, batches: list, lr: float = 1e-2) -> tuple[list[float], dict]:
    """Plain diffusers (+ PEFT) training: loss, backward, AdamW step per batch; the losses and the last step's
    gradients of the trainable parameters."""
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses, grads = [], {}
    for inputs, target in batches:
        loss = rpd.diffusion_loss(transformer(**inputs).sample, target)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def roundpipe_steps(model, batches: list, lr: float = 1e-2, **call) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, grads = [], {}
    for inputs, target in batches:
        losses.append(model.forward_backward(target=target, **inputs, **call).item())
        model.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.step(opt)
    return losses, grads


def assert_same_training(ref: tuple, ours: tuple, atol: float = 1e-5) -> None:
    (ref_losses, ref_grads), (losses, grads) = ref, ours
    assert losses == pytest.approx(ref_losses, abs=atol, rel=0)
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=atol, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_layers_give_the_transformers_own_output(kind):
    """The cut layers, run in turn, give transformer(**inputs).sample bit for bit in fp32."""
    t = build(kind).eval()
    inputs, _ = batch_of(kind, t)
    with torch.no_grad():
        expected = t(**inputs).sample
        layers = cut_layers(t)
        x = layers[0](**inputs)
        for layer in layers[1:]:
            x = layer(x)
    assert len(layers) == {"flux": 5, "sd3": 4, "wan": 4}[kind]
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
    check_forward(t, layers)   # wrap's own check (check=True, or another diffusers version) agrees
    with pytest.raises(ValueError, match="another output than its own forward"):
        check_forward(t, layers[:1] + layers[2:])   # a block left out


def test_wrap_check_refuses_layers_that_differ(monkeypatch):
    """wrap(check=True) runs one tiny forward both ways and refuses a difference (here a patched output layer)."""
    forward = FluxOutput.forward
    monkeypatch.setattr(FluxOutput, "forward", lambda self, x: 2 * forward(self, x))
    with pytest.raises(ValueError, match="FluxTransformer2DModel: roundpipe's layers give another output"):
        rpd.wrap(build("flux"), devices=["cpu"], check=True)


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_meta_transformer_runs_through_the_layers(kind):
    """A transformer built on meta cuts and runs at a pixel size (the planner's dry run), output of the real shape."""
    t = build(kind, device="meta")
    h, w, frames = SIZES[kind]
    inputs = example_inputs(t, 2, h * 2, w * 2, frames=frames, device="meta", text_len=7)
    x = cut_layers(t)[0](**inputs)
    for layer in cut_layers(t)[1:]:
        x = layer(x)
    expected = {"flux": (2, 12, 8), "sd3": (2, 4, 4, 8), "wan": (2, 4, 2, 4, 8)}[kind]
    assert x.device.type == "meta" and tuple(x.shape) == expected


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_full_finetuning_equals_plain_diffusers(devices):
    """SD3 full fine-tuning: two AdamW steps, 3 microbatches, losses and gradients of plain diffusers within 1e-5."""
    t = build("sd3")
    batches = [batch_of("sd3", t, seed=s) for s in (1, 2)]
    ref = reference_steps(copy.deepcopy(t), batches)
    with rpd.wrap(t, devices=devices, num_microbatches=3) as model:
        ours = roundpipe_steps(model, batches)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in build("sd3").named_parameters()]
    assert_same_training(ref, ours)


def test_forward_call_and_conditioning_passed_whole():
    """model(**inputs) is the transformer's sample when the batch (3) equals img_ids' and txt_ids' length (3):
    the ids reach every microbatch whole, the per-sample arguments are split."""
    t = build("flux").eval()
    inputs, _ = batch_of("flux", t)
    assert inputs["img_ids"].shape[0] == inputs["txt_ids"].shape[0] == BATCH
    with torch.no_grad():
        expected = t(**inputs).sample
    parts = SampleSplit(FAMILIES["flux"])((), dict(inputs), {"target": inputs["hidden_states"]}, 3)
    for _, kw, labels in parts:
        assert kw["img_ids"] is inputs["img_ids"] and kw["txt_ids"] is inputs["txt_ids"]
        assert kw["hidden_states"].shape[0] == kw["guidance"].shape[0] == labels["target"].shape[0] == 1
    with rpd.wrap(t, devices=["cpu", "cpu"], num_microbatches=3) as model, torch.no_grad():
        got = model(**inputs)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_async_step_and_checkpoint_resume(tmp_path):
    """The engine's asynchronous step trains, and a checkpoint resumes to the same next loss."""
    t = build("wan")
    batches = [batch_of("wan", t, seed=s) for s in range(1, 5)]
    with rpd.wrap(t, devices=["cpu", "cpu"], num_microbatches=2) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for inputs, target in batches[:3]:
            losses.append(model.forward_backward(target=target, **inputs).item())
            model.step(opt, asynchronous=True)
        model.save_checkpoint(tmp_path / "ckpt", opt)
        inputs, target = batches[3]
        after = model.forward_backward(target=target, **inputs).item()
    assert all(torch.isfinite(torch.tensor(losses)))
    t2 = build("wan", seed=7)
    with rpd.wrap(t2, devices=["cpu"], num_microbatches=2) as resumed:
        opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
        resumed.load_checkpoint(tmp_path / "ckpt", opt2)
        again = resumed.forward_backward(target=target, **inputs).item()
    assert again == pytest.approx(after, abs=1e-6)


def test_bf16_compute_stays_near_fp32():
    """compute_dtype=torch.bfloat16 gives the fp32 loss within bf16's precision."""
    t = build("flux")
    inputs, target = batch_of("flux", t)
    with torch.no_grad():
        expected = rpd.diffusion_loss(t(**inputs).sample, target).item()
    with rpd.wrap(t, devices=["cpu"], compute_dtype=torch.bfloat16, num_microbatches=2) as model:
        loss = model.forward_backward(target=target, **inputs).item()
    assert loss == pytest.approx(expected, rel=3e-2)


def test_bad_input_is_refused_by_name():
    """Unsupported arguments, missing or mis-batched ones, and wrong targets are errors naming the argument."""
    t = build("flux")
    inputs, target = batch_of("flux", t)
    with rpd.wrap(t, devices=["cpu"]) as model:
        cases = [
            (TypeError, "joint_attention_kwargs", dict(inputs, joint_attention_kwargs={"scale": 0.5})),
            (TypeError, "controlnet_block_samples", dict(inputs, controlnet_block_samples=[target])),
            (TypeError, "mystery", dict(inputs, mystery=1)),
            (ValueError, "txt_ids", {k: v for k, v in inputs.items() if k != "txt_ids"}),
            (ValueError, "pooled_projections", dict(inputs, pooled_projections=inputs["pooled_projections"][:2])),
            (ValueError, "timestep", dict(inputs, timestep=torch.tensor(0.5))),
            (ValueError, "guidance", {k: v for k, v in inputs.items() if k != "guidance"}),
            (ValueError, "img_ids", dict(inputs, img_ids=inputs["img_ids"][:2])),
            (ValueError, "hidden_states", dict(inputs, hidden_states=inputs["hidden_states"][0])),
        ]
        for error, name, kwargs in cases:
            with pytest.raises(error, match=name):
                model.forward_backward(target=target, **kwargs)
        with pytest.raises(ValueError, match="target"):
            model.forward_backward(target=target[:, :2], **inputs)
        with pytest.raises(ValueError, match="target"):
            model.forward_backward(**inputs)
        with pytest.raises(ValueError, match="weighting"):
            model.forward_backward(target=target, weighting=torch.ones(2), **inputs)
    with pytest.raises(TypeError, match="split_fn"):
        rpd.wrap(build("flux"), devices=["cpu"], split_fn=lambda *a: None)
    with pytest.raises(TypeError, match="FluxTransformer2DModel"):
        rpd.wrap(nn.Linear(2, 2), devices=["cpu"])
    stray = build("sd3")
    stray.image_proj = nn.Linear(2, 2)   # an IP-adapter projection no layer holds
    with pytest.raises(ValueError, match="image_proj.weight"):
        rpd.wrap(stray, devices=["cpu"])
    with pytest.raises(ValueError, match="frames"):
        example_inputs(build("wan"), 1, 16, 16, frames=4)


def test_flow_matching_inputs():
    """noisy = (1 - s) x0 + s noise; target per prediction; bad sigmas and predictions refused by name."""
    x0, noise, s = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.tensor([0.25, 0.5])
    noisy, target = rpd.flow_matching_inputs(x0, noise, s)
    torch.testing.assert_close(noisy, (1 - s[:, None, None]) * x0 + s[:, None, None] * noise)
    torch.testing.assert_close(target, noise - x0)
    assert rpd.flow_matching_inputs(x0, noise, s, prediction="noise")[1] is noise
    with pytest.raises(ValueError, match="prediction"):
        rpd.flow_matching_inputs(x0, noise, s, prediction="v")
    with pytest.raises(ValueError, match="sigmas"):
        rpd.flow_matching_inputs(x0, noise, torch.rand(3))


def test_importing_roundpipe_does_not_import_diffusers():
    """roundpipe and roundpipe.diffusers load lazily: diffusers is imported only when wrap is reached."""
    code = ("import sys, roundpipe, roundpipe.diffusers as d; assert 'diffusers' not in sys.modules; "
            "d.wrap; assert 'diffusers' not in sys.modules; d.example_inputs; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_wrap_refuses_what_it_fixes_and_what_it_does_not_take():
    """split_fn / loss_reduction, an unknown keyword and a transformer off the CPU: errors naming the argument."""
    with pytest.raises(TypeError, match=r"loss_reduction is fixed by rp.diffusers.wrap \(the loss is the mean"):
        rpd.wrap(build("flux"), devices=["cpu"], loss_reduction="sum")
    with pytest.raises(TypeError, match="split_fn, loss_reduction are fixed by rp.diffusers.wrap .*do not pass them"):
        rpd.wrap(build("flux"), devices=["cpu"], split_fn=lambda *a: None, loss_reduction="mean")
    with pytest.raises(TypeError, match=r"rp.diffusers.wrap got unexpected keyword argument\(s\) \['bogus'\]") as info:
        rpd.wrap(build("flux"), devices=["cpu"], bogus=1)
    said = str(info.value)
    assert "device_memory" in said and said.endswith("and check") and "split_fn" not in said
    with pytest.raises(TypeError, match="transformer must be a diffusers transformer .an nn.Module., got str"):
        rpd.wrap("flux", devices=["cpu"])
    with pytest.raises(ValueError, match="transformer must be on the CPU"):
        rpd.wrap(build("flux", device="meta"), devices=["cpu"])


@pytest.mark.skipif(torch.distributed.is_available() and torch.distributed.is_initialized(),
                    reason="this process is in a process group already")
def test_wrap_under_world_size_joins_torchrun_group_or_says_how(monkeypatch):
    """As rp.hf.wrap: under WORLD_SIZE=2 wrap takes torchrun's group (launched_group), and without the
    rendezvous that is a ValueError naming what is missing and how to launch; process_group=None trains alone."""
    import roundpipe.diffusers.model as dmodel
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not set.*torchrun.*before rp.diffusers.wrap"):
        rpd.wrap(build("flux"), devices=["cpu"])
    with rpd.wrap(build("flux"), devices=["cpu"], process_group=None) as model:
        assert model.dp is None
    asked = []
    monkeypatch.setattr(dmodel, "launched_group", lambda caller: asked.append(caller))
    with rpd.wrap(build("flux"), devices=["cpu"]) as model:
        assert asked == ["rp.diffusers.wrap"] and model.dp is None
