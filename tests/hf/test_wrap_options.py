"""What rp.hf.wrap checks before it needs transformers (engine/config.py check_wrap_options, shared with
rp.diffusers.wrap), how it finds torchrun's group (engine/data_parallel.py launched_group) and the lazy names of
roundpipe.hf (core/lazy.py).  No model is cut: a plain nn.Module reaches every check."""
import pytest
import torch
from torch import nn

import roundpipe as rp
import roundpipe.hf.model as hf_model
from roundpipe.engine import data_parallel
from roundpipe.engine.data_parallel import launched_group

alone = pytest.mark.skipif(torch.distributed.is_available() and torch.distributed.is_initialized(),
                           reason="this process is in a process group already")


def test_wrap_refuses_what_it_fixes_and_what_it_does_not_take():
    """loss_reduction, an unknown keyword, a non-module and a module off the CPU: each error names the argument."""
    with pytest.raises(TypeError, match=r"loss_reduction is fixed by rp.hf.wrap \(HF's token-weighted loss\); "
                                        "do not pass it"):
        rp.hf.wrap(nn.Linear(2, 2), devices=["cpu"], loss_reduction="sum")
    with pytest.raises(TypeError, match=r"rp.hf.wrap got unexpected keyword argument\(s\) \['bogus'\]") as info:
        rp.hf.wrap(nn.Linear(2, 2), devices=["cpu"], bogus=1)
    said = str(info.value)
    assert "device_memory" in said and said.endswith("and quantize, double_quant") and "loss_reduction" not in said
    with pytest.raises(TypeError, match="hf_model must be a transformers causal LM .an nn.Module., got str"):
        rp.hf.wrap("gpt2", devices=["cpu"])
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"hf_model must be on the CPU .*device_map"):
        rp.hf.wrap(meta, devices=["cpu"])


def test_launched_group_is_the_engine_one():
    """roundpipe.hf.model still exports launched_group, which now lives with data parallelism in the engine."""
    assert hf_model.launched_group is data_parallel.launched_group


@alone
@pytest.mark.parametrize("world", [None, "", "1"])
def test_launched_group_is_none_for_one_process(monkeypatch, world):
    """No WORLD_SIZE, an empty one or 1: this process trains alone."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert launched_group("rp.hf.wrap") is None


@alone
def test_launched_group_errors_say_what_and_how(monkeypatch):
    """A WORLD_SIZE that is no number, and WORLD_SIZE=2 without the rendezvous, are ValueErrors naming the call."""
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' in the environment must be a positive integer"):
        launched_group("rp.hf.wrap")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT is not set.*torchrun.*init_process_group.. before rp.hf.wrap"):
        launched_group("rp.hf.wrap")


def test_lazy_names():
    """roundpipe.hf lists its lazy names, loads one when read and refuses another name as a module does."""
    import roundpipe.hf as hf
    assert {"wrap", "from_pretrained", "Trainer", "max_seq_len"} <= set(dir(hf))
    assert hf.wrap is hf_model.wrap
    with pytest.raises(AttributeError, match="module 'roundpipe.hf' has no attribute 'nope'"):
        hf.nope  # noqa: B018 (the read is the test)
