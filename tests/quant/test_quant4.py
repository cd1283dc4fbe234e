"""roundpipe.quant: the 4-bit format bitwise against bitsandbytes' CPU backend, interop, QuantLinear, conversion."""
import copy
import os
import warnings

import pytest
import torch
from torch import nn

from roundpipe.quant import (
    Quant4State,
    QuantLinear,
    code_table,
    convert_bnb_model,
    dequantize,
    dequantize_4bit_ref,
    dynamic_map,
    from_bnb,
    packed_nbytes,
    quantize_4bit,
    quantize_model,
    state_from_state_dict,
    to_state_dict,
)
from roundpipe.quant.reference import quantize_blockwise_8bit

bnb = pytest.importorskip("bitsandbytes")
bnbf = pytest.importorskip("bitsandbytes.functional")
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(123, 3000), (7, 64), (9, 33), (1,), (3, 1), (300, 257), (5, 80), (2, 3, 130)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, with -0.0 made +0.0 (bitsandbytes' own CPU paths disagree on the sign of FP4's zero)."""
    t = t + 0.0 if t.is_floating_point() else t
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _assert_same_state(ours: Quant4State, packed: torch.Tensor, qs) -> None:
    assert torch.equal(ours.data, packed.view(torch.uint8).reshape(-1))
    assert ours.shape == qs.shape and ours.dtype == qs.dtype and ours.quant_type == qs.quant_type
    assert torch.equal(_bits(ours.absmax), _bits(qs.absmax))
    assert ours.double_quant == qs.nested
    if qs.nested:
        assert torch.equal(_bits(ours.nested_absmax), _bits(qs.state2.absmax))
        assert torch.equal(_bits(ours.nested_code), _bits(qs.state2.code))
        assert torch.equal(_bits(ours.offset), _bits(qs.offset.reshape(())))


def _bnb_dequantize(packed, qs, dtype):
    """bitsandbytes' CPU dequantize_4bit(...).to(dtype), eager.  For a last dim that is a multiple of 16 but
    not of 64 its AVX-512 CPU kernel indexes absmax per row as if rows were whole blocks (wrong values, seen
    with 0.50.2 on this VM), so those shapes use its PyTorch (default) backend, which CUDA agrees with."""
    with torch.compiler.set_stance("force_eager"):
        last = qs.shape[-1]
        if last % 16 == 0 and last % qs.blocksize:
            absmax = qs.absmax
            if qs.nested:
                absmax = bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
            code = bnbf.get_4bit_type(qs.quant_type, device="cpu")
            out = _dequantize_4bit_compute(packed.reshape(-1), absmax, code, qs.blocksize, qs.shape, qs.dtype)
        else:
            out = bnbf.dequantize_4bit(packed, qs)
    return out.to(dtype).reshape(qs.shape)   # its CPU kernel returns [1, n] for a 1-D shape


def test_tables_equal_bitsandbytes():
    """NF4 and FP4 tables and the nested 8-bit dynamic map are bitsandbytes' fp32 values, bit for bit."""
    for quant_type in ("nf4", "fp4"):
        assert torch.equal(code_table(quant_type).view(torch.int32),
                           bnbf.get_4bit_type(quant_type, device="cpu").view(torch.int32))
    assert torch.equal(dynamic_map().view(torch.int32), bnbf.create_dynamic_map().view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_quantize_and_dequantize_equal_bitsandbytes(shape, dtype, quant_type, double_quant):
    """Packed bytes and every statistic are bitwise bitsandbytes.functional.quantize_4bit's (CPU, blocksize
    64, uint8 storage), odd numels included; dequantized fp32/bf16/fp16 values are bitwise its dequantize."""
    w = (torch.randn(shape) * torch.rand(shape[0], *[1] * (len(shape) - 1)) * 3).to(dtype)
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type,
                                    quant_storage=torch.uint8)
    ours = quantize_4bit(w, quant_type, double_quant)
    _assert_same_state(ours, packed, qs)
    for out_dtype in DTYPES:
        assert torch.equal(_bits(dequantize_4bit_ref(ours, out_dtype)), _bits(_bnb_dequantize(packed, qs, out_dtype)))


def test_zero_blocks_and_zero_tail_equal_bitsandbytes():
    """All-zero blocks (absmax 0), an all-zero short tail (stored as 1e-38) and a constant-absmax nested block."""
    for n in (64 * 300 + 5, 64 * 256):
        w = torch.randn(n)
        w[64:256] = 0
        w[64 * 299:] = 0
        for quant_type in ("nf4", "fp4"):
            for double_quant in (True, False):
                packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant,
                                                quant_type=quant_type)
                ours = quantize_4bit(w, quant_type, double_quant)
                _assert_same_state(ours, packed, qs)
                assert torch.equal(_bits(dequantize_4bit_ref(ours)), _bits(_bnb_dequantize(packed, qs, w.dtype)))


def test_nested_absmax_codes_follow_bitsandbytes_lookup_table():
    """The 8-bit absmax codes are bitsandbytes' CPU lookup-table codes, which are not always the nearest
    code: the test includes values where the two differ."""
    code = dynamic_map()
    lut_size = 65535
    k = torch.arange(1, lut_size, dtype=torch.float64)
    near_edges = ((k - 0.5) / lut_size * 2 - 1).float()
    v = torch.cat([near_edges, torch.nextafter(near_edges, torch.tensor(2.0)), torch.rand(50000) * 2 - 1])
    v = v[v.abs() < 1][: 255 * 600].reshape(600, 255)
    x = torch.cat([torch.ones(600, 1), v], 1).reshape(-1) * 0.37   # absmax 0.37 in every block
    theirs, their_absmax = torch.ops.bitsandbytes.quantize_blockwise.default(x, code, 256)
    ours, our_absmax = quantize_blockwise_8bit(x, code)
    assert torch.equal(ours, theirs) and torch.equal(_bits(our_absmax), _bits(their_absmax))
    nearest = (x.view(600, 256) / our_absmax.view(-1, 1)).reshape(-1, 1).sub(code).abs().argmin(1)
    assert (nearest != ours.long()).sum() > 0


def test_dequantized_error_is_within_half_a_code_step():
    """|dequantize(quantize(w)) - w| stays within half the largest gap of the table times the block's absmax."""
    w = torch.randn(37, 129)
    for quant_type in ("nf4", "fp4"):
        state = quantize_4bit(w, quant_type, double_quant=False)
        gap = code_table(quant_type).sort().values.diff().max() / 2
        absmax = state.absmax.repeat_interleave(64)[: w.numel()].view_as(w)
        assert ((dequantize_4bit_ref(state) - w).abs() <= gap * absmax * (1 + 1e-6)).all()


def test_bad_arguments_name_themselves():
    """Unknown quant_type, unsupported dtype, empty input and inconsistent states are ValueError/TypeError."""
    with pytest.raises(ValueError, match=r"quant_type='int4'.*\('nf4', 'fp4'\)"):
        quantize_4bit(torch.randn(8), "int4")
    with pytest.raises(ValueError, match="torch.float64"):
        quantize_4bit(torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty"):
        quantize_4bit(torch.randn(0, 4))
    with pytest.raises(TypeError, match="list"):
        quantize_4bit([1.0, 2.0])
    state = quantize_4bit(torch.randn(10, 64))
    with pytest.raises(ValueError, match="data is torch.uint8 \\(319,\\)"):
        state.replace(data=state.data[1:])
    with pytest.raises(ValueError, match="together"):
        state.replace(offset=None)
    with pytest.raises(ValueError, match="nf5"):
        state.replace(quant_type="nf5")


def test_packed_nbytes_of_a_4096_square_nf4_weight():
    """A 4096 x 4096 NF4 double-quantized weight holds <= 0.52 bytes per parameter (0.5 data + 1/64 + nested)."""
    state = quantize_4bit(torch.randn(4096, 4096), "nf4", double_quant=True)
    per_param = packed_nbytes(state) / (4096 * 4096)
    assert 0.5 < per_param <= 0.52, per_param
    assert packed_nbytes(quantize_4bit(torch.randn(64, 64), "nf4", double_quant=False)) == 64 * 64 // 2 + 64 * 4


# ---- bitsandbytes modules and checkpoints ---------------------------------------------------------------

def _bnb_linear(in_features, out_features, quant_type, double_quant, bias=True):
    torch_linear = nn.Linear(in_features, out_features, bias=bias)
    module = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.float32,
                               compress_statistics=double_quant, quant_type=quant_type)
    module.load_state_dict(torch_linear.state_dict())
    return module.to("cpu"), torch_linear   # .to(device) is where bitsandbytes quantizes


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_from_bnb_takes_the_packed_state_as_is(quant_type, double_quant):
    """from_bnb of a Linear4bit shares bitsandbytes' packed bytes (no copy, no dequantization) and equals our
    quantization of the same weights; QuantLinear.from_bnb computes the same product."""
    module, torch_linear = _bnb_linear(128, 96, quant_type, double_quant)
    state = from_bnb(module)
    assert state.data.data_ptr() == module.weight.data.data_ptr()
    _assert_same_state(quantize_4bit(torch_linear.weight, quant_type, double_quant),
                       module.weight.data, module.weight.quant_state)
    _assert_same_state(state, module.weight.data, module.weight.quant_state)
    ours = QuantLinear.from_bnb(module)
    x = torch.randn(3, 128)
    torch.testing.assert_close(ours(x), module(x), rtol=0, atol=0)


def test_from_bnb_quantizes_a_params4bit_bitsandbytes_has_not():
    """A float Params4bit not yet quantized is quantized with its own settings, as bitsandbytes would."""
    w = torch.randn(64, 72)
    params = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="fp4", compress_statistics=True)
    state = from_bnb(params)
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="fp4")
    _assert_same_state(state, packed, qs)


def test_from_bnb_refusals():
    """Trainable Params4bit, weights repacked by bitsandbytes' CPU inference path, and non-bnb objects."""
    with pytest.raises(ValueError, match="requires grad"):
        from_bnb(bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=True, quant_type="nf4"))
    module, _ = _bnb_linear(64, 64, "nf4", True)
    module.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="repacked"):
        from_bnb(module)
    with pytest.raises(TypeError, match="Linear"):
        from_bnb(nn.Linear(4, 4))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_state_dict_round_trip_is_bitwise(tmp_path, quant_type, double_quant):
    """A Linear4bit's saved tensors (through a safetensors file) -> Quant4State -> to_state_dict gives the same
    keys in the same order with the same bytes (JSON quant-state blob included)."""
    from safetensors.torch import load_file, save_file

    module, _ = _bnb_linear(200, 72, quant_type, double_quant)
    saved = {f"layer.{k}": v.contiguous() for k, v in module.state_dict().items()}
    save_file(saved, tmp_path / "m.safetensors")
    tensors = load_file(tmp_path / "m.safetensors")
    state = state_from_state_dict(tensors, "layer.weight")
    _assert_same_state(state, module.weight.data, module.weight.quant_state)
    again = to_state_dict(state, "layer.weight")
    expected = {k: v for k, v in saved.items() if k.startswith("layer.weight")}
    assert list(again) == list(expected)
    for key, value in expected.items():
        assert again[key].dtype == value.dtype and torch.equal(_bits(again[key]), _bits(value)), key
    with pytest.raises(KeyError, match="layer.bias"):
        state_from_state_dict(tensors, "layer.bias")


# ---- QuantLinear ---------------------------------------------------------------------------------------------

def test_quant_linear_is_linear_over_the_dequantized_weight():
    """Forward and the input/bias gradients equal F.linear over the dequantized weight (fp32 exactly; bf16 the
    same ops in bf16); the weight gets no gradient and the [out, in] weight is dequantized again in backward,
    never saved."""
    linear = nn.Linear(130, 70).requires_grad_(False)
    linear.bias.requires_grad_(True)
    module = QuantLinear.from_linear(linear, "nf4")
    assert not any(p.requires_grad for name, p in module.named_parameters() if name != "bias")
    for dtype in (torch.float32, torch.bfloat16):
        w = dequantize(module.quant_state, dtype)
        x = torch.randn(4, 5, 130, dtype=dtype, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        bias_ref = linear.bias.detach().to(dtype).requires_grad_(True)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            y = module(x)
        y_ref = nn.functional.linear(x_ref, w, bias_ref)
        assert y.dtype == dtype and torch.equal(y, y_ref)
        assert (70, 130) not in shapes and (130, 70) not in shapes
        dy = torch.randn_like(y)
        module.bias.grad = None
        y.backward(dy)
        y_ref.backward(dy)
        assert torch.equal(x.grad, x_ref.grad)
        torch.testing.assert_close(module.bias.grad, bias_ref.grad.to(module.bias.dtype), rtol=1e-2, atol=1e-2)


def test_quant_linear_compute_dtype_casts_like_bitsandbytes():
    """With compute_dtype the product runs in it and the output comes back in the input's dtype."""
    linear = nn.Linear(64, 32).requires_grad_(False)
    module = QuantLinear.from_linear(linear, "fp4", compute_dtype=torch.bfloat16)
    x = torch.randn(3, 64)
    y = module(x)
    expected = nn.functional.linear(x.bfloat16(), dequantize(module.quant_state, torch.bfloat16),
                                    linear.bias.bfloat16()).float()
    assert y.dtype == torch.float32 and torch.equal(y, expected)


def test_quant_linear_refusals():
    """A trainable weight is a ValueError, a non-Linear a TypeError naming it, an unknown quant_type a ValueError."""
    with pytest.raises(ValueError, match="requires grad"):
        QuantLinear.from_linear(nn.Linear(8, 8))
    with pytest.raises(TypeError, match="Conv1d"):
        QuantLinear.from_linear(nn.Conv1d(2, 2, 1).requires_grad_(False))
    with pytest.raises(ValueError, match=r"quant_type='q4'.*'nf4', 'fp4'"):
        QuantLinear.from_linear(nn.Linear(8, 8).requires_grad_(False), "q4")
    module, _ = _bnb_linear(64, 64, "nf4", True)
    with pytest.raises(TypeError, match="from_bnb"):
        QuantLinear.from_linear(module)
    with pytest.raises(ValueError, match="in_features=64"):
        QuantLinear.from_bnb(module)(torch.randn(2, 63))


def test_quant_linear_state_follows_its_buffers():
    """The packed weight and statistics are buffers: state_dict carries them and a fresh module loads them."""
    module = QuantLinear.from_linear(nn.Linear(96, 40).requires_grad_(False), "nf4")
    names = set(module.state_dict())
    assert names == {"weight", "absmax", "nested_absmax", "nested_code", "offset", "bias"}
    other = QuantLinear.from_linear(nn.Linear(96, 40).requires_grad_(False), "nf4")
    other.load_state_dict(module.state_dict())
    x = torch.randn(2, 96)
    assert torch.equal(other(x), module(x))


# ---- PEFT LoRA over bitsandbytes vs over QuantLinear -------------------------------------------------------

class _TwoLayers(nn.Module):
    def __init__(self, quant_type, double_quant):
        super().__init__()
        self.fc1, _ = _bnb_linear(128, 192, quant_type, double_quant)
        self.fc2, _ = _bnb_linear(192, 64, quant_type, double_quant, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_peft_lora_over_quant_linear_equals_lora_over_bitsandbytes(quant_type, double_quant):
    """PEFT LoRA over bnb.nn.Linear4bit and the same LoRA with the base layers converted to QuantLinear give
    the same output and LoRA gradients within 1e-5 relative (fp32 compute)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_TwoLayers(quant_type, double_quant), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["fc1", "fc2"], lora_dropout=0.0, init_lora_weights=False))
    ours = copy.deepcopy(model)
    assert convert_bnb_model(ours) == 2
    assert isinstance(ours.base_model.model.fc1.base_layer, QuantLinear)
    x = torch.randn(6, 128)
    results = []
    for m in (model, ours):
        m.train()   # bitsandbytes repacks CPU weights for eval-mode no-grad inference; training is the use here
        y = m(x)
        y.square().mean().backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        results.append((y.detach(), grads))
    (y_bnb, g_bnb), (y_ours, g_ours) = results
    torch.testing.assert_close(y_ours, y_bnb, rtol=1e-5, atol=1e-6)
    assert g_bnb.keys() == g_ours.keys() and len(g_bnb) == 4
    for name in g_bnb:
        torch.testing.assert_close(g_ours[name], g_bnb[name], rtol=1e-5, atol=1e-7, msg=name)


# ---- whole models -----------------------------------------------------------------------------------------------

def _tiny_causal_lm(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).float()


def _dequantized_copy(quantized, original):
    """`original` with each Linear that `quantized` holds as a QuantLinear set to its dequantized weight."""
    ref = copy.deepcopy(original)
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear):
            ref.get_submodule(name).weight.data.copy_(dequantize(module.quant_state, torch.float32))
    return ref


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_quantize_model_tiny_causal_lm(model_type):
    """Every frozen decoder Linear (7 a layer, not the LM head) becomes a QuantLinear; logits equal the model
    whose Linear weights are the dequantized values, bitwise."""
    pytest.importorskip("transformers")
    model = _tiny_causal_lm(model_type).requires_grad_(False)
    original = copy.deepcopy(model)
    assert quantize_model(model, "nf4") == 14
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    ids = torch.randint(0, 128, (2, 9))
    assert torch.equal(model(ids).logits, _dequantized_copy(model, original)(ids).logits)
    assert quantize_model(model) == 0   # nothing left to quantize


def test_quantize_model_peft_base_layers():
    """On a PEFT model the LoRA base layers and the untargeted frozen Linears are quantized, the adapters not;
    loss and LoRA gradients equal the same LoRA over the dequantized weights within 1e-5."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_causal_lm("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False))
    original = copy.deepcopy(model)
    assert quantize_model(model, "fp4", double_quant=False) == 14
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.base_layer, QuantLinear)
    assert type(layer.self_attn.q_proj.lora_A["default"]) is nn.Linear
    reference = _dequantized_copy(model, original)
    ids = torch.randint(0, 128, (2, 7))
    losses, grads = [], []
    for m in (model, reference):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 8
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_quantize_model_explicit_modules_and_refusals():
    """Named modules are quantized exactly; a named non-Linear is a TypeError naming it; tied weights are kept."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10)).requires_grad_(False)
    model[3].weight = model[0].weight   # tied, as an LM head to its embedding
    assert quantize_model(model, skip=()) == 1
    assert isinstance(model[1], QuantLinear) and type(model[3]) is nn.Linear
    with pytest.raises(TypeError, match="'2' is a ReLU"):
        quantize_model(model, modules=["2"])
    with pytest.raises(ValueError, match="quant_type='nf8'"):
        quantize_model(model, "nf8")
    assert quantize_model(model, modules=["3"]) == 1


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", True), ("fp4", False)])
def test_transformers_bnb_4bit_model_converts_without_dequantizing(tmp_path, quant_type, double_quant):
    """A tiny Llama loaded by transformers with BitsAndBytesConfig(load_in_4bit=True) on the CPU converts to
    QuantLinear (14 layers) sharing its packed bytes, with equal logits; its saved checkpoint's quant-state
    keys read back to the same states and write back bitwise."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    _tiny_causal_lm("llama").save_pretrained(tmp_path / "base")
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                             bnb_4bit_use_double_quant=double_quant,
                                             bnb_4bit_compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", quantization_config=config, dtype=torch.float32, device_map="cpu")
    model.save_pretrained(tmp_path / "bnb")
    tensors = load_file(os.path.join(tmp_path / "bnb", "model.safetensors"))
    ours = copy.deepcopy(model)
    bnb_proj = model.model.layers[0].mlp.up_proj
    assert convert_bnb_model(ours) == 14
    ids = torch.randint(0, 128, (2, 8))
    model.train()
    ours.train()
    torch.testing.assert_close(ours(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    for name, module in ours.named_modules():
        if isinstance(module, QuantLinear):
            state = module.quant_state
            bnb_weight = model.get_submodule(name).weight
            _assert_same_state(state, bnb_weight.data, bnb_weight.quant_state)
            _assert_same_state(state_from_state_dict(tensors, f"{name}.weight"), bnb_weight.data,
                               bnb_weight.quant_state)
            written = to_state_dict(state, f"{name}.weight")
            for key, value in written.items():
                assert torch.equal(_bits(value), _bits(tensors[key])), key
    assert torch.equal(ours.model.layers[0].mlp.up_proj.weight, bnb_proj.weight.data.reshape(-1))


class _Experts(nn.Module):
    """transformers 5's fused experts shape (Qwen3MoeExperts' eager forward, without its interface dispatch)."""

    def __init__(self, experts, hidden, inter):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.2, requires_grad=False)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.2, requires_grad=False)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            pos, tok = torch.where(top_k_index.T == e)
            gate, up = nn.functional.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, h * top_k_weights[tok, pos, None])
        return out


@pytest.mark.parametrize("quant_type, double_quant", [("nf4", True), ("fp4", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_experts_store_each_expert_as_bitsandbytes_and_dequantize_whole(quant_type, double_quant, dtype):
    """Each expert's matrix is bitwise bitsandbytes' quantize_4bit of that 2-D matrix (its own offset and nested
    blocks), stacked; the whole-tensor dequantization is bitwise the per-expert one, for a per-expert numel that is a
    multiple of 64 (one flattened state) and one that is not (expert by expert)."""
    from roundpipe.quant import QuantExperts

    torch.manual_seed(0)
    for hidden, inter in ((64, 96), (40, 9)):   # 9 x 40 = 360 values an expert: blocks straddle experts
        base = _Experts(3, hidden, inter).to(dtype)
        weights = {n: getattr(base, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
        q = QuantExperts(base, quant_type, double_quant)
        assert not list(q.parameters()) and q.quantized_numel == sum(w.numel() for w in weights.values())
        assert q.constant_buffers == {n for n, _ in q.named_buffers()}
        for name, w in weights.items():
            for e in range(w.shape[0]):
                packed, qs = bnbf.quantize_4bit(w[e], blocksize=64, compress_statistics=double_quant,
                                                quant_type=quant_type, quant_storage=torch.uint8)
                _assert_same_state(q.expert_state(name, e), packed, qs)
            for out in (torch.float32, dtype):
                whole = q.dequantized(name, out)
                assert whole.shape == w.shape and whole.dtype == out
                each = torch.stack([dequantize(q.expert_state(name, e), out) for e in range(w.shape[0])])
                assert torch.equal(_bits(whole), _bits(each)), (hidden, name, out)


def test_quant_experts_forward_is_the_base_forward_over_dequantized_weights():
    """QuantExperts runs the experts module's own forward with the dequantized tensors: outputs and the input's
    gradient equal it bitwise; the base's parameters stay removed after the call."""
    from roundpipe.quant import QuantExperts

    torch.manual_seed(1)
    base = _Experts(4, 64, 32)
    ref = copy.deepcopy(base)
    q = QuantExperts(base, "nf4")
    for name in q.quantized:
        getattr(ref, name).data.copy_(q.dequantized(name, torch.float32))
    x = torch.randn(10, 64, requires_grad=True)
    idx = torch.randint(0, 4, (10, 2))
    w = torch.rand(10, 2)
    out = q(x, idx, w)
    out.square().sum().backward()
    gx, x.grad = x.grad, None
    expect = ref(x, idx, w)
    expect.square().sum().backward()
    assert torch.equal(out, expect) and torch.equal(gx, x.grad)
    assert "gate_up_proj" not in base.__dict__ and "gate_up_proj" not in base._parameters


def test_dequant_keep_dequantizes_once_per_dtype_until_released():
    """Under a DequantKeep a QuantLinear dequantizes once per compute dtype over forwards and backwards (the same
    bits as per product), registers the kept weight in the ledger as weights, and after release it is gone from the
    ledger and products dequantize afresh."""
    from roundpipe.quant import DequantKeep
    from roundpipe.quant.keep import attach
    from roundpipe.workers.ledger import DeviceLedger

    torch.manual_seed(2)
    layer = QuantLinear.from_linear(nn.Linear(64, 48).requires_grad_(False), "nf4")
    x = torch.randn(5, 64, requires_grad=True)
    per_product = layer(x)
    per_product.sum().backward()
    g_ref, x.grad = x.grad, None
    ledger = DeviceLedger()
    keep = DequantKeep(ledger)
    attach([layer], keep)
    for _ in range(3):
        y = layer(x)
        y.sum().backward()
        assert torch.equal(y, per_product) and torch.equal(x.grad, g_ref)
        x.grad = None
    layer(x.detach().double().float().bfloat16())
    assert keep.made == 2 and ledger.stats()["current"]["weights"] == keep.nbytes == 48 * 64 * (4 + 2)
    attach([layer], None)
    keep.release()
    del y
    assert ledger.live_bytes() == 0 and layer.dequant_keep is None
    assert keep.get("k", lambda: torch.ones(1)) is not keep.get("k", lambda: torch.ones(1))
