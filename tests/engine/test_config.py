"""EngineConfig (roundpipe/engine/config.py): the one list of engine options, checked once, taken by every entry point."""
import dataclasses
import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp
from roundpipe.engine import config as config_module
from roundpipe.engine.config import ENGINE_OPTIONS, EngineConfig

native = pytest.mark.skipif(not rp.native_available(), reason="the state tier needs the native extension")


def layers(n=3, width=8):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def non_default(tmp_path) -> dict:
    """Several engine options at values other than their defaults, all valid together on CPU workers."""
    return {"devices": ["cpu", "cpu"], "num_microbatches": 2, "microbatches_per_round": 2,
            "planning": rp.PlanningConfig(enabled=False), "device_memory": 1 << 30, "batchnorm": "whole-batch",
            "compensation": rp.StalenessCompensation(0.5), "master_dtype": torch.bfloat16,
            "master_rounding": "nearest", "offload_dir": str(tmp_path / "state"), "host_memory": 1 << 30}


def assert_built_with(model, options: dict) -> None:
    cfg = model.engine_config
    assert isinstance(cfg, EngineConfig)
    for name, value in options.items():
        assert getattr(cfg, name) == value, name
    assert model.num_microbatches == options["num_microbatches"] and model.round_size == 2
    assert [str(d) for d in model.devices] == ["cpu", "cpu"]
    assert model.host.master_dtype == torch.bfloat16 and model.host.master_rounding == "nearest"
    assert model.offload is not None and model.offload.directory == options["offload_dir"]
    assert model.compensation is options["compensation"] and model.device_memory == {"cpu:0": 1 << 30, "cpu:1": 1 << 30}


def tiny_hf():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def training_args(out, **over):
    from transformers import TrainingArguments
    kw = dict(output_dir=str(out), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=4,
              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-2, seed=0)
    kw.update(over)
    return TrainingArguments(**kw)


def dataset(n=8, t=8):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 64, (t,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(t, dtype=torch.long), "labels": ids})
    return rows


# ---- (a) every entry point takes the same options

def test_entry_points_derive_their_options_from_engine_config():
    """RoundPipe's keywords are EngineConfig's fields with the same defaults; wrap, the Trainer and the CLI's
    engine builder take their lists from that one definition (WRAP_ARGS is gone)."""
    from roundpipe.commands import train_loops
    from roundpipe.hf import model as hf_model
    from roundpipe.hf import trainer as hf_trainer
    from roundpipe.hf.quantize import HF_OPTIONS, QuantizeConfig

    assert ENGINE_OPTIONS == EngineConfig.field_names() == tuple(
        f.name for f in dataclasses.fields(EngineConfig) if f.init)
    params = inspect.signature(rp.RoundPipe.__init__).parameters
    keywords = [p for name, p in params.items() if name not in ("self", "layers", "config")]
    assert tuple(p.name for p in keywords) == ENGINE_OPTIONS
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}
    assert {p.name: p.default for p in keywords} == defaults
    # rp.hf.wrap: its named engine options are EngineConfig's, the rest pass through; its own are QuantizeConfig's
    wrap_params = inspect.signature(rp.hf.wrap).parameters
    named = [n for n, p in wrap_params.items() if n != "hf_model" and p.kind != p.VAR_KEYWORD]
    assert set(named) - set(HF_OPTIONS) <= set(ENGINE_OPTIONS)
    assert any(p.kind == p.VAR_KEYWORD for p in wrap_params.values())
    assert HF_OPTIONS == tuple(f.name for f in dataclasses.fields(QuantizeConfig)) == ("quantize", "double_quant")
    assert hf_model.WRAP_OPTIONS == ENGINE_OPTIONS + HF_OPTIONS
    assert hf_trainer.WRAP_OPTIONS is hf_model.WRAP_OPTIONS and not hasattr(hf_trainer, "WRAP_ARGS")
    # the CLI: the options its flags set are engine options; its engine takes RoundPipe's own arguments
    from roundpipe.commands.train import TrainConfig
    cli = train_loops.engine_options(TrainConfig(devices=["cpu"], dtype="fp32", compensation=0.5).resolved())
    assert set(cli) <= set(ENGINE_OPTIONS)
    EngineConfig(**cli)
    engine_params = inspect.signature(train_loops.RoundPipeEngine.__init__).parameters
    assert {p.kind for p in engine_params.values()} >= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


@native
def test_entry_points_build_the_same_engine(tmp_path):
    """The same non-default options through rp.RoundPipe (keywords and config=), the CLI's RoundPipeEngine,
    rp.hf.wrap and rp.hf.Trainer reach the engine."""
    from roundpipe.commands.train_loops import RoundPipeEngine

    options = non_default(tmp_path)
    with rp.RoundPipe(layers(), **options) as model:
        assert_built_with(model, options)
        assert model.engine_config == EngineConfig(**options)
    cfg = EngineConfig(**options)
    with rp.RoundPipe(layers(), config=cfg) as model:
        assert model.engine_config is cfg
        assert_built_with(model, options)
    with RoundPipeEngine(layers(), **options) as engine:
        assert_built_with(engine.model, options)
    with RoundPipeEngine(layers(), config=cfg) as engine:
        assert engine.model.engine_config is cfg
    with rp.hf.wrap(tiny_hf(), **options) as model:
        assert_built_with(model, options)
        assert model.engine_config.loss_reduction == "sum"   # wrap's
    trainer = rp.hf.Trainer(tiny_hf(), training_args(tmp_path / "out"), train_dataset=dataset(), **options)
    with trainer.rp_model as model:
        assert_built_with(model, options)


def test_config_and_keywords_together_is_an_error():
    """RoundPipe(layers, config=cfg) takes no other option; a keyword at its default value does not count."""
    cfg = EngineConfig(devices=["cpu"])
    with pytest.raises(ValueError, match="config= and the option.*num_microbatches were both given"):
        rp.RoundPipe(layers(), num_microbatches=2, config=cfg)
    with pytest.raises(TypeError, match="config must be a roundpipe.EngineConfig"):
        rp.RoundPipe(layers(), config={"devices": ["cpu"]})
    with rp.RoundPipe(layers(), loss_reduction="mean", config=cfg) as model:
        assert model.engine_config is cfg


def test_cli_engine_gets_the_flags(tmp_path):
    """`roundpipe train`'s flags reach the engine through EngineConfig: --master-dtype, --microbatches,
    --compensation, --devices, --dtype."""
    from roundpipe.commands.train import TrainConfig
    from roundpipe.commands.train_loops import make_engine
    cfg = TrainConfig(devices=["cpu", "cpu"], microbatches=3, dtype="fp32", master_dtype="bf16", compensation=0.5,
                      layers=2, hidden=32, heads=2, steps=1).resolved()
    from roundpipe.models.tiny_decoder import build_layers
    with make_engine(build_layers(cfg.model_config(), seed=0), cfg) as engine:
        c = engine.model.engine_config
        assert (c.devices, c.num_microbatches, c.compute_dtype, c.master_dtype) == \
            (["cpu", "cpu"], 3, torch.float32, torch.bfloat16)
        assert c.compensation == rp.StalenessCompensation(0.5)


# ---- (b) options that transformers.Trainer used to receive reach the engine through rp.hf.Trainer

@native
def test_offload_dir_reaches_the_engine_through_the_trainer(tmp_path):
    """rp.hf.Trainer(model, args, offload_dir=...): the optimizer state goes to files under that folder."""
    state = tmp_path / "state"
    trainer = rp.hf.Trainer(tiny_hf(), training_args(tmp_path / "out"), train_dataset=dataset(), devices=["cpu"],
                            offload_dir=state)
    with trainer.rp_model as model:
        assert model.offload is not None and model.offload.directory == os.fspath(state)
        trainer.train()
        assert model.memory_stats()["host"]["optimizer_state_on_disk"] > 0
        assert any(files for _, _, files in os.walk(state)), "no file of the state tier under offload_dir"


def test_master_dtype_reaches_the_engine_through_the_trainer(tmp_path):
    """rp.hf.Trainer(model, args, master_dtype=torch.bfloat16): bf16 masters, trained a step."""
    hf = tiny_hf()
    trainer = rp.hf.Trainer(hf, training_args(tmp_path / "out"), train_dataset=dataset(), devices=["cpu"],
                            master_dtype=torch.bfloat16, master_rounding="nearest")
    with trainer.rp_model as model:
        assert model.host.master_dtype == torch.bfloat16 and model.host.master_rounding == "nearest"
        assert all(p.dtype == torch.bfloat16 for p in hf.parameters() if p.requires_grad)
        before = [p.detach().clone() for p in hf.parameters()]
        trainer.train()
        assert any(not torch.equal(a, p) for a, p in zip(before, hf.parameters()))


def test_trainer_sends_engine_options_to_wrap(tmp_path):
    """loss_reduction is an engine option: wrap refuses it (it fixes it) rather than transformers.Trainer."""
    with pytest.raises(TypeError, match="loss_reduction is fixed by rp.hf.wrap"):
        rp.hf.Trainer(tiny_hf(), training_args(tmp_path / "out"), devices=["cpu"], loss_reduction="sum")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['config'\]"):
        rp.hf.wrap(tiny_hf(), devices=["cpu"], config=EngineConfig())


# ---- (c) bad values: one error, from EngineConfig, naming the argument

BAD = [
    ({"num_microbatches": 0}, ValueError, "num_microbatches=0 must be None or an int >= 1"),
    ({"microbatches_per_round": True}, ValueError, "microbatches_per_round=True"),
    ({"devices": []}, ValueError, r"devices=\[\] is empty"),
    ({"devices": "cpu"}, TypeError, "devices must be a list"),
    ({"compute_dtype": torch.int8}, ValueError, "compute_dtype=torch.int8"),
    ({"plan": "0-1"}, TypeError, "plan must be a roundpipe.Plan"),
    ({"split_fn": 3}, TypeError, "split_fn must be callable"),
    ({"planning": {}}, TypeError, "planning must be a roundpipe.engine.autoplan.PlanningConfig"),
    ({"device_memory": -1}, ValueError, "device_memory=-1"),
    ({"device_memory": {"cuda:7": 10}}, ValueError, "device_memory has key 'cuda:7'"),
    ({"loss_reduction": "max"}, ValueError, "loss_reduction='max'"),
    ({"batchnorm": "global"}, ValueError, "batchnorm='global'"),
    ({"precision": "bf16"}, TypeError, "precision must be a roundpipe.Precision"),
    ({"shard_optimizer": 1}, TypeError, "shard_optimizer must be True or False"),
    ({"shard_optimizer": True}, ValueError, "shard_optimizer=True needs process_group="),
    ({"compensation": 0.5}, TypeError, "compensation must be a roundpipe.StalenessCompensation"),
    ({"master_dtype": torch.float16}, ValueError, "master_dtype=torch.float16 is not supported"),
    ({"master_rounding": "up"}, ValueError, "master_rounding='up'"),
    ({"host_memory": 1 << 30}, ValueError, "host_memory=1073741824 needs offload_dir="),
    ({"offload_dir": "/tmp/x", "shard_optimizer": True, "process_group": object()}, ValueError,
     "offload_dir= and shard_optimizer=True are not supported together"),
]


@pytest.mark.parametrize("bad, exc, match", BAD, ids=[next(iter(b)) for b, _, _ in BAD])
def test_bad_option_raises_once_from_engine_config(bad, exc, match, monkeypatch):
    """A bad option: the same ValueError/TypeError naming it from EngineConfig and from RoundPipe, raised by
    EngineConfig's check (run once) before anything is built."""
    with pytest.raises(exc, match=match):
        EngineConfig(**bad)
    checks = []
    post_init = EngineConfig.__post_init__
    monkeypatch.setattr(EngineConfig, "__post_init__", lambda self: (checks.append(1), post_init(self)))
    model_layers = layers()
    with pytest.raises(exc, match=match) as info:
        rp.RoundPipe(model_layers, **{"devices": ["cpu"], **bad})
    assert checks == [1]
    assert any(str(entry.path) == config_module.__file__ for entry in info.traceback)
    assert all(p.dtype == torch.float32 for layer in model_layers for p in layer.parameters())


def test_each_check_runs_once(monkeypatch, tmp_path):
    """master_dtype is checked once (EngineConfig; HostState only asserts), quantize once along rp.hf.from_pretrained,
    the engine options once along rp.hf.Trainer."""
    from roundpipe.engine.step import host_state
    from roundpipe.hf import quantize as hf_quantize

    assert not hasattr(host_state, "check_master_dtype")
    counted = {"master_dtype": 0, "quantize": 0, "engine": 0}
    check = config_module.check_master_dtype
    monkeypatch.setattr(config_module, "check_master_dtype",
                        lambda v: (counted.__setitem__("master_dtype", counted["master_dtype"] + 1), check(v))[1])
    q_init, e_init = hf_quantize.QuantizeConfig.__post_init__, EngineConfig.__post_init__
    monkeypatch.setattr(hf_quantize.QuantizeConfig, "__post_init__",
                        lambda self: (counted.__setitem__("quantize", counted["quantize"] + 1), q_init(self))[1])
    monkeypatch.setattr(EngineConfig, "__post_init__",
                        lambda self: (counted.__setitem__("engine", counted["engine"] + 1), e_init(self))[1])
    with rp.RoundPipe(layers(), devices=["cpu"], master_dtype=torch.bfloat16):
        pass
    assert counted == {"master_dtype": 1, "quantize": 0, "engine": 1}
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "saved")
    counted.update(master_dtype=0, engine=0)
    with rp.hf.from_pretrained(tmp_path / "saved", devices=["cpu"]):
        pass
    assert counted == {"master_dtype": 1, "quantize": 1, "engine": 1}
    counted.update(master_dtype=0, quantize=0, engine=0)
    trainer = rp.hf.Trainer(tiny_hf(), training_args(tmp_path / "out"), devices=["cpu"], microbatches_per_round=2)
    trainer.rp_model.close()
    assert counted == {"master_dtype": 1, "quantize": 1, "engine": 1}


def test_bad_quantize_raises_before_loading(tmp_path):
    """rp.hf.from_pretrained(quantize='int3') names it before reading the folder; wrap names it too."""
    with pytest.raises(ValueError, match="quantize='int3' is not a 4-bit type"):
        rp.hf.from_pretrained(tmp_path, quantize="int3")
    with pytest.raises(TypeError, match="double_quant must be True or False"):
        rp.hf.wrap(tiny_hf(), devices=["cpu"], quantize="nf4", double_quant="yes")


def test_engine_config_is_frozen_and_replace_rechecks():
    """A checked config cannot be changed unchecked; dataclasses.replace checks the new one and re-derives."""
    cfg = EngineConfig(devices=["cpu"] * 3)
    assert cfg.round_size == 4 and cfg.resolved_precision.compute_dtype == torch.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_microbatches = 0
    assert dataclasses.replace(cfg, devices=["cpu"]).round_size == 2
    with pytest.raises(ValueError, match="num_microbatches=0"):
        dataclasses.replace(cfg, num_microbatches=0)
    assert cfg.options()["devices"] == ["cpu"] * 3 and set(cfg.options()) == set(ENGINE_OPTIONS)
    rp.RoundPipe(layers(), **cfg.options()).close()


def test_training_through_config_equals_keywords():
    """A model built with config= trains exactly as one built with the same keywords."""
    def run(**kw):
        with rp.RoundPipe(layers(), **kw) as model:
            opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(1)
            for _ in range(2):
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False)
            return [p.detach().clone() for p in model.parameters()]
    a = run(devices=["cpu", "cpu"], num_microbatches=3)
    b = run(config=EngineConfig(devices=["cpu", "cpu"], num_microbatches=3))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
