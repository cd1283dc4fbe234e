"""The dry run measures each distinct layer once: a layer identical to one measured before (class, parameters,
buffers and settings of every submodule) on an input of identical structure takes that measurement, and the
costs are those of measuring every layer."""
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import roundpipe.engine.dry_run as dry_run
from roundpipe.engine.dry_run import RATES, dry_run_costs, layer_key

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from roundpipe.hf.model import cut_layers  # noqa: E402


def _costs(monkeypatch, layers, sample, device, reuse, loss=None, dtype=torch.bfloat16):
    """dry_run_costs as autoplan.size_costs runs it (CPU: RNG restored, math attention) and how many layers
    it measured (calls of measure_layer)."""
    calls = []
    original = dry_run.measure_layer

    def counting(layer, *args, **kwargs):
        calls.append(type(layer).__name__)
        return original(layer, *args, **kwargs)
    monkeypatch.setattr(dry_run, "measure_layer", counting)
    rates = RATES["cuda" if device == "meta" else "cpu"]
    with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH):
        costs = dry_run_costs(layers, sample, dtype, rates, device, loss, reuse=reuse)
    monkeypatch.setattr(dry_run, "measure_layer", original)
    return costs, calls


def _hf_layers(model_type, **extra):
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)
    torch.manual_seed(0)
    return cut_layers(AutoModelForCausalLM.from_config(cfg))


def _ids(seq=24):
    return ((torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1)),), {})


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_llama_measures_one_decoder_and_its_costs_are_bitwise_those_of_measuring_all(monkeypatch, device):
    """Four Llama decoder layers (they differ only in layer_idx): embedding, one decoder and the head are
    measured, and every LayerCost equals the run that measures all six layers."""
    layers = _hf_layers("llama")
    assert layer_key(layers[1]) == layer_key(layers[4])
    reused, measured = _costs(monkeypatch, layers, _ids(), device, reuse=True)
    every, measured_all = _costs(monkeypatch, layers, _ids(), device, reuse=False)
    assert measured == ["Embed", "Decoder", "Head"] and len(measured_all) == 6
    assert reused == every   # dataclass equality: every float and int field, the LayerMemory included
    assert all(c.memory.recompute > 0 and c.act_bytes > 0 for c in reused[1:5])


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")   # peft asks transformers
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_lora_decoders_share_too(monkeypatch, device):
    """peft LoRA on q_proj and v_proj (with dropout): its layers differ only in the construction arguments it
    records (`kwargs`, naming the target module), so one decoder is measured; the costs equal the unreused run's."""
    peft = pytest.importorskip("peft")
    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    layers = cut_layers(peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), lora).base_model.model)
    reused, measured = _costs(monkeypatch, layers, _ids(), device, reuse=True)
    every, _ = _costs(monkeypatch, layers, _ids(), device, reuse=False)
    assert measured == ["Embed", "Decoder", "Head"] and reused == every
    assert reused[1].grad_bytes < reused[1].param_bytes   # only the adapters train


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_sliding_and_full_attention_layers_do_not_share(monkeypatch, device):
    """Qwen3 with layer_types sliding, full, sliding, full: the two kinds differ only in non-tensor settings
    (Decoder.attention_type, the attention's layer_type and sliding_window), so each kind is measured once,
    and the costs equal the unreused run's."""
    kinds = ["sliding_attention", "full_attention"] * 2
    layers = _hf_layers("qwen3", layer_types=kinds, sliding_window=8, use_sliding_window=True)
    assert layer_key(layers[1]) != layer_key(layers[2]) and layer_key(layers[1]) == layer_key(layers[3])
    reused, measured = _costs(monkeypatch, layers, _ids(), device, reuse=True)
    every, _ = _costs(monkeypatch, layers, _ids(), device, reuse=False)
    assert measured == ["Embed", "Decoder", "Decoder", "Head"]
    assert reused == every


class Block(nn.Module):
    """A residual linear block; `keep_square` (a plain attribute) makes its forward save one more activation."""

    def __init__(self, width, keep_square=False, layer_idx=0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.keep_square = keep_square
        self.layer_idx = layer_idx

    def forward(self, x):
        y = self.linear(x)
        if self.keep_square:
            y = y * y.sigmoid()
        return x + y


class Scale(nn.Module):
    """No parameters: the same module at every width."""

    def forward(self, x):
        return x * x.sigmoid()


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_flag_that_changes_the_forward_keeps_layers_apart(monkeypatch, device):
    """Blocks that differ only in a bool attribute are each measured; their costs differ and equal the
    unreused run's.  A layer_idx on a module outside transformers' cache-only families also keeps them apart."""
    torch.manual_seed(0)
    layers = [Block(16), Block(16, keep_square=True), Block(16), Block(16, keep_square=True),
              Block(16, layer_idx=7)]
    sample = ((torch.randn(4, 16),), {})
    reused, measured = _costs(monkeypatch, layers, sample, device, reuse=True)
    every, _ = _costs(monkeypatch, layers, sample, device, reuse=False)
    assert reused == every
    assert reused[1].act_bytes > reused[2].act_bytes   # the flag does change the measurement
    assert len(measured) == 4   # layer 0 (the first, never shared), 1, 2, 4; layer 3 takes layer 1's


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_same_layer_on_inputs_of_other_widths_does_not_share(monkeypatch, device):
    """Scale after linears of width 16, 32, 32: measured at 16 and at 32, taken at the second 32; the last
    layer is taken too and still gets the loss's workspace."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), Scale(), nn.Linear(16, 32), Scale(), nn.Linear(32, 32), Scale()]
    sample = ((torch.randn(4, 8),), {})
    loss = (lambda out, labels: nn.functional.mse_loss(out, labels), torch.randn(4, 32))
    reused, measured = _costs(monkeypatch, layers, sample, device, reuse=True, loss=loss, dtype=torch.float32)
    every, _ = _costs(monkeypatch, layers, sample, device, reuse=False, loss=loss, dtype=torch.float32)
    assert reused == every
    assert measured == ["Linear", "Scale", "Linear", "Scale", "Linear"]
    assert reused[1].memory.in_bytes * 2 == reused[3].memory.in_bytes and reused[3] != reused[1]
    assert reused[5].memory.loss > 0 and reused[3].memory.loss == 0
    assert dataclasses.replace(reused[5], memory=reused[3].memory) == reused[3]


class Widen(nn.Module):
    """Repeats the hidden state `count` times in its forward (count: an integer tensor carried along)."""

    def forward(self, x):
        h, count = x
        wide = h.repeat(1, int(count))
        return h + wide[:, :h.shape[1]], count + 1


class Start(nn.Module):
    def forward(self, h):
        return h, torch.ones((), dtype=torch.long)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_an_integer_input_whose_value_decides_the_work_is_compared_by_value(monkeypatch, device):
    """Two Widen layers see inputs of one structure whose counts differ (1, 2): both are measured."""
    layers = [Start(), Widen(), Widen()]
    sample = ((torch.randn(2, 8),), {})
    reused, measured = _costs(monkeypatch, layers, sample, device, reuse=True, dtype=torch.float32)
    every, _ = _costs(monkeypatch, layers, sample, device, reuse=False, dtype=torch.float32)
    assert reused == every and reused[1].memory != reused[2].memory
    assert len(measured) == 3


class TopRows(nn.Module):
    """Keeps the rows whose first feature is positive: the work depends on the values (as MoE routing)."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = self.linear(x)
        kept = y[y[:, 0] > 0]
        return y + kept.sum(0) * kept.shape[0]


def test_on_the_cpu_a_layer_that_reads_values_is_measured_every_time(monkeypatch):
    """Identical TopRows layers with other weights keep other row counts on the CPU: none is taken from another,
    and the costs equal the unreused run's."""
    torch.manual_seed(3)
    layers = [nn.Linear(8, 8)] + [TopRows(8) for _ in range(4)]
    sample = ((torch.randn(64, 8),), {})
    reused, measured = _costs(monkeypatch, layers, sample, "cpu", reuse=True, dtype=torch.float32)
    every, _ = _costs(monkeypatch, layers, sample, "cpu", reuse=False, dtype=torch.float32)
    assert len(measured) == 5 and reused == every
    assert len({c.memory for c in reused[1:]}) > 1   # the values did change the measurement


def test_layers_the_fingerprint_cannot_compare_are_measured():
    """A forward hook or a 4-bit weight gives no key; a bad reuse= is a TypeError naming it."""
    from roundpipe.quant.linear import QuantLinear

    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda m, a, o: o * 2)
    assert layer_key(hooked) is None and layer_key(nn.Linear(4, 4)) is not None
    frozen = nn.Linear(64, 64).requires_grad_(False)
    quant = nn.Sequential(QuantLinear.from_linear(frozen))
    assert layer_key(quant) is None
    with pytest.raises(TypeError, match="reuse"):
        dry_run_costs([nn.Linear(4, 4)], ((torch.zeros(1, 4),), {}), torch.float32, RATES["cpu"], "cpu", reuse="yes")


class Processor:
    """A stand-in for diffusers' attention processors: every block holds an instance of its own."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, x):
        return torch.tanh(x) * self.scale


class ProcessorBlock(nn.Module):
    def __init__(self, processor):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.processor = processor

    def forward(self, x):
        return x + self.processor(self.fc(x))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_blocks_with_equal_objects_of_their_own_share(monkeypatch, device):
    """Blocks whose settings are distinct but equal objects (a Python class keeping its state in __dict__) share
    one measurement, with the costs of measuring each; a different state, or objects whose state a __dict__
    does not hold (functools.partial, functions), keep blocks apart."""
    import functools
    blocks = [nn.Linear(8, 8)] + [ProcessorBlock(Processor(0.5)) for _ in range(3)] + [ProcessorBlock(Processor(2.0))]
    sample = ((torch.randn(2, 8),), {})
    reused, measured = _costs(monkeypatch, blocks, sample, device, reuse=True, dtype=torch.float32)
    every, _ = _costs(monkeypatch, blocks, sample, device, reuse=False, dtype=torch.float32)
    assert measured == ["Linear", "ProcessorBlock", "ProcessorBlock"] and reused == every
    halves = [ProcessorBlock(functools.partial(torch.mul, other=0.5)) for _ in range(2)]
    assert layer_key(halves[0]) != layer_key(halves[1])
    assert layer_key(ProcessorBlock(torch.tanh)) == layer_key(ProcessorBlock(torch.tanh))   # the same function object
