"""rp.diffusers.max_resolution / max_frames and `roundpipe plan max-resolution`: at the predicted size a real wrap
of a tiny random transformer on CPU workers trains under the cap, and the next size up is refused."""
import functools
import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import torch  # noqa: E402

import roundpipe.diffusers as rpd  # noqa: E402
from roundpipe.commands import plan as plan_cmd  # noqa: E402
from roundpipe.diffusers.context import DiTFit, max_frames, max_resolution  # noqa: E402
from roundpipe.diffusers.presets import example_inputs  # noqa: E402

# Tiny configs as config.json holds them (_class_name): Flux with guidance, SD3.5 with dual attention and qk-norm,
# Wan with its rotary table of 64 positions an axis (so 64 latent frames at most: 253 frames).
TINY = {
    "flux": {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 8, "num_layers": 1,
             "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 24,
             "pooled_projection_dim": 12, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]},
    "sd3": {"_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4,
            "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 24,
            "caption_projection_dim": 16, "pooled_projection_dim": 12, "out_channels": 4, "pos_embed_max_size": 64,
            "dual_attention_layers": [0], "qk_norm": "rms_norm"},
    "wan": {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 2,
            "attention_head_dim": 12, "in_channels": 4, "out_channels": 4, "text_dim": 16, "freq_dim": 16,
            "ffn_dim": 32, "num_layers": 2, "rope_max_seq_len": 64},
}
CAP = 1_000_000
TEXT = 8   # text tokens: the pipelines' 512 / 333 would make the tiny models' costs text-bound
WAN_SIDE = 64


@functools.cache
def fit_of(kind, cap=CAP, lora=False, device="cpu"):
    """The prediction for a TINY config in fp32 for CPU workers (their dtype; they do not prefetch), searched once
    per argument set."""
    if kind == "wan":
        return max_frames(TINY[kind], cap, height=WAN_SIDE, width=WAN_SIDE, dtype=torch.float32, lora=lora,
                          text_len=TEXT, device=device)
    return max_resolution(TINY[kind], cap, dtype=torch.float32, lora=lora, text_len=TEXT, device=device)


def build(kind):
    import diffusers
    cfg = dict(TINY[kind])
    cls = getattr(diffusers, cfg.pop("_class_name"))
    torch.manual_seed(0)
    return cls.from_config(cfg)


def train_once(kind, height, width, frames):
    """One forward_backward of one sample under CAP on a CPU worker; (loss or the ValueError, the worker's peak)."""
    transformer = build(kind)
    torch.manual_seed(1)
    inputs = example_inputs(transformer, 1, height, width, frames=frames, text_len=TEXT)
    x0 = torch.randn_like(inputs["hidden_states"])
    noisy, target = rpd.flow_matching_inputs(x0, torch.randn_like(x0), torch.rand(1))
    inputs["hidden_states"] = noisy
    with rpd.wrap(transformer, devices=["cpu"], num_microbatches=1, device_memory=CAP) as model:
        try:
            out = model.forward_backward(target=target, **inputs)
        except ValueError as e:
            out = e
        peaks = [s["peak_total"] for s in model.memory_stats()["workers"].values()]
    return out, peaks


def sizes(fit: DiTFit):
    """(the predicted size, the next size up) as (height, width, frames)."""
    if fit.question == "frames":
        return (fit.height, fit.width, fit.frames), (fit.height, fit.width, fit.frames + 4)
    return (fit.height, fit.width, None), (fit.height + 16, fit.width + 16, None)


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan"])
def test_the_predicted_size_trains_under_the_cap_and_the_next_is_refused(kind):
    """CPU workers, fp32: at the predicted size one call trains and the worker's peak stays under the cap; one step
    up (16 px a side, or 4 frames) the engine refuses with its device_memory ValueError before any work."""
    fit = fit_of(kind)
    assert isinstance(fit, DiTFit) and not fit.at_search_limit and fit.binding.total <= fit.stage_limit
    assert fit.binding.name.endswith(" 0") and "block" in fit.binding.name
    assert 0 < fit.binding.attention < fit.binding.activations
    fits, refused = sizes(fit)
    assert fit.refused == f"{refused[1]}x{refused[0]}" + ("" if refused[2] is None else f"x{refused[2]}f")
    loss, peaks = train_once(kind, *fits)
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss), loss
    assert all(0 < p <= CAP for p in peaks), (peaks, CAP)
    err, peaks = train_once(kind, *refused)
    assert isinstance(err, ValueError) and "device_memory" in str(err), err
    assert all(p == 0 for p in peaks), peaks


def test_a_larger_cap_never_gives_a_smaller_answer():
    """Monotone in the cap, for images and frames; LoRA (no weight gradients) fits at least as much."""
    for kind in ("flux", "sd3", "wan"):
        answers = [fit_of(kind, cap).answer for cap in (CAP, 2 * CAP)]
        assert answers[0] < answers[1], (kind, answers)
    lora = fit_of("flux", lora=True)
    assert lora.lora and lora.answer >= fit_of("flux").answer and lora.binding.gradients < fit_of("flux").binding.gradients


def test_wan_frames_are_4k_plus_1_and_the_rotary_table_bounds_the_search():
    """Frames are 4k + 1 (the causal VAE's rule); a cap too large to bind stops at the rotary table's 64 latent
    frames (253 frames) and says so; a bad frame count is named."""
    fit = fit_of("wan")
    assert fit.frames % 4 == 1 and fit.tokens == (1 + (fit.frames - 1) // 4) * (WAN_SIDE // 16) ** 2
    big = max_frames(TINY["wan"], 1 << 40, height=WAN_SIDE, width=WAN_SIDE, dtype=torch.float32, text_len=TEXT)
    assert big.at_search_limit and big.frames == 4 * 63 + 1 and "or more" in big.table() and big.refused == ""
    for frames in (0, 6, 80, 2.0):
        with pytest.raises(ValueError, match=f"frames={frames!r} must be 4k \\+ 1"):
            max_resolution(TINY["wan"], CAP, frames=frames)


def test_a_built_transformer_gives_its_configs_answer_and_is_left_as_it_was():
    """A transformer on the CPU is dry-run through meta copies of its layers: the answer is its config's, and its
    attention processors are not touched (the search shares them only on the transformers it builds)."""
    transformer = build("sd3")
    processors = [m.processor for m in transformer.modules() if hasattr(m, "set_processor")]
    fit = max_resolution(transformer, CAP, dtype=torch.float32, text_len=TEXT, device="cpu")
    assert fit.size == fit_of("sd3").size and fit.model == "SD3Transformer2DModel"
    assert [m.processor for m in transformer.modules() if hasattr(m, "set_processor")] == processors
    with pytest.raises(ValueError, match="lora=: give the transformer with its adapters added"):
        max_resolution(transformer, CAP, lora=True)


def test_bad_arguments_are_named():
    """Each bad argument is named with its value."""
    flux = TINY["flux"]
    for call, exc, match in [
        (lambda: max_resolution(flux, 0), ValueError, r"device_memory=0 must be >= 1"),
        (lambda: max_resolution(flux, 1.5e6), TypeError, r"device_memory=1500000.0 must be an int"),
        (lambda: max_resolution(flux, CAP, batch=0), ValueError, r"batch=0"),
        (lambda: max_resolution(flux, CAP, workers=0), ValueError, r"workers=0"),
        (lambda: max_resolution(flux, CAP, dtype=torch.int32), TypeError, r"dtype=torch.int32"),
        (lambda: max_resolution(flux, CAP, aspect=0), ValueError, r"aspect=0 must be"),
        (lambda: max_resolution(flux, CAP, frames=5), ValueError, r"frames=5 is for video models"),
        (lambda: max_resolution(flux, CAP, lora="yes"), TypeError, r"lora='yes'"),
        (lambda: max_resolution("no-such-model"), ValueError, r"model='no-such-model' is neither a built-in shape"),
        (lambda: max_resolution({"num_layers": 1}), ValueError, r"_class_name"),
        (lambda: max_resolution(3), TypeError, r"model must be"),
        (lambda: max_frames(flux, CAP, height=64, width=64), ValueError, r"max_frames is for video models"),
        (lambda: max_frames(TINY["wan"], CAP, height=100, width=64), ValueError, r"height=100 must be a positive "
                                                                                 r"multiple of 16"),
        (lambda: max_resolution(flux, 10_000, text_len=TEXT), ValueError, r"even 16x16 does not fit.*raise "
                                                                          r"device_memory or train LoRA"),
    ]:
        with pytest.raises(exc, match=match):
            call()


def test_the_command_prints_the_table(tmp_path, capsys):
    """`roundpipe plan max-resolution` prints one row per image model and one per video size, marked predicted and
    unmeasured on GPU; --details adds the per-layer table; bad flags are named."""
    flux, wan = tmp_path / "flux.json", tmp_path / "wan"
    flux.write_text(json.dumps(TINY["flux"]))
    wan.mkdir()
    (wan / "config.json").write_text(json.dumps(TINY["wan"]))
    argv = ["max-resolution", "--model", str(flux), "--model", str(wan), "--device-memory", f"{4 * CAP}B",
            "--dtype", "fp32", "--video-size", "32x48", "--details"]
    assert plan_cmd.main(argv) == 0
    out = capsys.readouterr().out
    want = max_resolution(TINY["flux"], 4 * CAP, dtype=torch.float32)
    assert f"{want.width}x{want.height}" in out and "frames at 48x32" in out and "binding layer" in out
    assert "UNMEASURED ON GPU" in out and "unmeasured on GPU" in out and "stage limit" in out   # --details
    assert plan_cmd.main(["max-resolution", "--model", "nope"]) == 2
    assert "--model 'nope'" in capsys.readouterr().err
    for flag, value in [("--video-size", "480x833"), ("--device-memory", "0"), ("--batch", "0")]:
        with pytest.raises(SystemExit):
            plan_cmd.main(["max-resolution", "--model", str(flux), flag, value])
        assert f"argument {flag}" in capsys.readouterr().err


def test_wan_at_480p_on_a_24_gib_card():
    """The documented prediction: Wan2.1-T2V-14B, full fine-tuning at 832x480 under 24 GiB, bf16, is bound by a
    block's activations (meta device: no memory allocated)."""
    fit = max_frames("wan2.1-14b", 24 << 30, height=480, width=832)
    assert fit.frames % 4 == 1 and 49 <= fit.frames <= 161   # 93 on 2026-12-07
    assert fit.binding.name.startswith("block") and fit.binding.activations > 0.8 * fit.stage_limit
    assert "unmeasured on GPU" in fit.table()
