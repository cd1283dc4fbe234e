"""rp.hf.max_seq_len and `roundpipe plan max-seq-len`: the predicted length trains under the cap, 10% more is refused."""
import functools
import json

import pytest
import torch

import roundpipe as rp

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from roundpipe.commands import plan as plan_cmd  # noqa: E402
from roundpipe.hf.context import ContextFit  # noqa: E402

V = 128
TINY = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=4096,
                  tie_word_embeddings=False),
    "llama": dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=4096, tie_word_embeddings=True),
}
CAP = 8_000_000


@functools.cache
def fit_of(kind, workers=1, recompute="stage", cap=CAP):
    """rp.hf.max_seq_len of a TINY config in fp32, searched once per argument set for the whole module (each
    search runs a dozen dry runs); the tests only read the ContextFit."""
    return rp.hf.max_seq_len(TINY[kind], cap, workers=workers, dtype=torch.float32, recompute=recompute)


def train_once(kind, seq_len, workers, recompute="stage"):
    """One forward_backward of [1, seq_len] tokens under CAP; returns (loss or the ValueError, per-worker peaks)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[kind])).float()
    with rp.hf.wrap(hf, devices=["cpu"] * workers, num_microbatches=1, device_memory=CAP,
                    recompute=recompute) as model:
        for w in model.workers:
            if hasattr(w, "records_workspace"):   # CPU workers that can record the layers' own workspace
                w.records_workspace = True
        ids = torch.randint(0, V, (1, seq_len), generator=torch.Generator().manual_seed(1))
        try:
            out = model.forward_backward(input_ids=ids, labels=ids)
        except ValueError as e:
            out = e
        peaks = [s["peak_total"] for s in model.memory_stats()["workers"].values()]
    return out, peaks


@pytest.mark.parametrize("kind, workers, recompute", [("qwen3", 1, "stage"), ("llama", 2, "stage"),
                                                     ("llama", 2, "layer")])
def test_the_predicted_length_trains_under_the_cap_and_ten_percent_more_is_refused(kind, workers, recompute):
    """CPU workers, fp32: at the predicted length one call trains and no worker's peak passes the cap; at 10%
    more the engine refuses with its ValueError before any work (nothing ever held on a worker)."""
    fit = fit_of(kind, workers, recompute)
    assert fit.recompute == recompute
    assert isinstance(fit, ContextFit) and 64 < fit.seq_len < 4096 and not fit.at_search_limit
    assert fit.binding.total <= fit.stage_limit and fit.binding.name.startswith("decoder")
    assert 0 < fit.binding.attention < fit.binding.activations
    loss, peaks = train_once(kind, fit.seq_len, workers, recompute)
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss), loss
    assert all(0 < p <= CAP for p in peaks), (peaks, CAP)
    err, peaks = train_once(kind, int(fit.seq_len * 1.1), workers, recompute)
    assert isinstance(err, ValueError) and "device_memory" in str(err) and "needs about" in str(err), err
    assert all(p == 0 for p in peaks), peaks


def test_the_worker_count_does_not_move_the_limit():
    """Only one layer has to fit a stage, so 1 and 3 workers give the same length (their plans differ)."""
    one, three = (fit_of("qwen3", workers=n) for n in (1, 3))
    assert one.seq_len == three.seq_len
    assert one.seq_len < fit_of("qwen3", cap=2 * CAP).seq_len


def test_layer_grain_does_not_move_the_limit():
    """A one-layer backward stage holds the same at either grain, so recompute="layer" predicts the same length
    (hf/context.py); a bad grain is named."""
    stage, layer = (fit_of("llama", workers=2, recompute=r) for r in ("stage", "layer"))
    assert stage.seq_len == layer.seq_len and layer.recompute == "layer" and "recompute='layer'" in layer.table()
    with pytest.raises(ValueError, match="recompute='block'"):
        rp.hf.max_seq_len(TINY["llama"], CAP, recompute="block")


def test_config_forms_and_bad_arguments(tmp_path):
    """A dict, a config object, a config.json and its folder give one answer; bad arguments are named."""
    want = fit_of("qwen3").seq_len
    (tmp_path / "config.json").write_text(json.dumps(TINY["qwen3"]))
    cfg = AutoConfig.for_model(**TINY["qwen3"])
    for form in (cfg, tmp_path / "config.json", str(tmp_path)):
        assert rp.hf.max_seq_len(form, CAP, dtype=torch.float32).seq_len == want
    for kwargs, exc, match in [
        (dict(device_memory=0), ValueError, r"device_memory=0 must be >= 1"),
        (dict(device_memory=1.5e6), TypeError, r"device_memory=1500000.0 must be an int"),
        (dict(device_memory=CAP, workers=0), ValueError, r"workers=0"),
        (dict(device_memory=CAP, dtype=torch.int32), TypeError, r"dtype=torch.int32"),
        (dict(device_memory=10_000), ValueError, r"even one token does not fit.*raise device_memory"),
    ]:
        with pytest.raises(exc, match=match):
            rp.hf.max_seq_len(TINY["qwen3"], **kwargs)
    for config, match in [("no-such-shape", "neither a built-in shape"), ({"hidden_size": 8}, "model_type=None"),
                          ({"model_type": "gpt2"}, "no roundpipe preset"), (3, "config must be")]:
        with pytest.raises((ValueError, TypeError), match=match):
            rp.hf.max_seq_len(config, CAP)


def test_the_command_prints_the_table(tmp_path, capsys):
    """`roundpipe plan max-seq-len` prints one row per config with the length and the binding layer's bytes;
    bad flag values are named."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["qwen3"]))
    want = fit_of("qwen3").seq_len   # the same config, searched through the Python API
    assert plan_cmd.main(["max-seq-len", "--hf-config", str(path), "--device-memory", f"{CAP}B",
                          "--dtype", "fp32", "--details"]) == 0
    out = capsys.readouterr().out
    assert "max seq len" in out and "binding layer" in out and f"{want:,}" in out and "decoder" in out
    assert "stage limit" in out   # --details
    assert plan_cmd.main(["max-seq-len", "--hf-config", "nope", "--device-memory", "1GiB"]) == 2
    assert "--hf-config 'nope'" in capsys.readouterr().err
    for flag, value in [("--device-memory", "24XB"), ("--device-memory", "0"), ("--workers", "0")]:
        argv = ["max-seq-len", "--hf-config", str(path), "--device-memory", "1GiB", flag, value]
        with pytest.raises(SystemExit):
            plan_cmd.main(argv)
        assert f"argument {flag}" in capsys.readouterr().err
    assert plan_cmd.parse_bytes("24GiB") == 24 << 30 and plan_cmd.parse_bytes("1.5 KB") == 1500


def test_builtin_shapes_on_a_24_gib_card():
    """The documented prediction (docs/benchmarks.md): Qwen3-1.7B on a 24 GiB cap, bf16, bound by a decoder
    layer's activations and workspace."""
    fit = rp.hf.max_seq_len("qwen3-1.7b", 24 << 30)
    assert 100_000 < fit.seq_len < 200_000   # 143,355 on 2026-11-25
    assert fit.binding.name.startswith("decoder") and fit.binding.activations > 0.9 * fit.stage_limit


def test_a_cap_too_large_to_bind_reports_the_search_limit():
    """A cap that no length reaches: the search ends at MAX_TOKENS and says so (before, the dry run of token ids
    past 512K, too large to keep real, raised "Cannot copy out of meta tensor")."""
    from roundpipe.hf.context import MAX_TOKENS
    fit = rp.hf.max_seq_len(TINY["llama"], 1 << 60, dtype=torch.float32)
    assert fit.seq_len == MAX_TOKENS and fit.at_search_limit
