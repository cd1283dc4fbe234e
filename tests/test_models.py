"""Tests for roundpipe.models.tiny_decoder: the built-in decoder as a list of layers."""
import pytest
import torch
from torch import nn

from roundpipe.models.tiny_decoder import PRESETS, DecoderConfig, build_layers, loss_fn, rotary

SMALL = DecoderConfig(hidden=32, layers=2, heads=4)


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_layer_list_shapes():
    """Embedding -> blocks -> head: [B, T] ids to [B, T, H] hidden states to [B, T, V] logits."""
    layers = build_layers(SMALL, seed=0)
    assert len(layers) == SMALL.layers + 2
    x = torch.randint(0, 256, (3, 11))
    h = layers[0](x)
    assert h.shape == (3, 11, 32)
    for block in layers[1:-1]:
        h = block(h)
        assert h.shape == (3, 11, 32)
    assert layers[-1](h).shape == (3, 11, 256)


def test_parameter_count_matches_the_config():
    """num_parameters() counts exactly the parameters the layers hold, for every preset shape."""
    for cfg in [SMALL, DecoderConfig(hidden=96, layers=3, heads=3, intermediate=100), PRESETS["tiny"]]:
        layers = build_layers(cfg, seed=0)
        assert sum(p.numel() for layer in layers for p in layer.parameters()) == cfg.num_parameters()
    assert 0.5e9 <= PRESETS["0.8b"].num_parameters() <= 1e9


def test_causal_masking():
    """Changing future bytes does not change the logits of earlier positions."""
    layers = build_layers(SMALL, seed=0)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 9:] = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        a, b = _run(layers, x), _run(layers, y)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_list_of_layers_equals_one_sequential():
    """The layer list run one by one equals nn.Sequential of the same layers, outputs and gradients."""
    layers = build_layers(SMALL, seed=0)
    seq = nn.Sequential(*build_layers(SMALL, seed=0))
    x = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    loss_a = loss_fn(_run(layers, x), labels)
    loss_b = loss_fn(seq(x), labels)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    grads_a = [p.grad for layer in layers for p in layer.parameters()]
    grads_b = [p.grad for p in seq.parameters()]
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)


def test_seed_fixes_the_initialisation_without_touching_global_rng():
    """build_layers(seed=s) is reproducible and leaves the global RNG stream as it was."""
    state = torch.random.get_rng_state()
    a = build_layers(SMALL, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = build_layers(SMALL, seed=3)
    c = build_layers(SMALL, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a[1].parameters(), b[1].parameters()))
    assert not torch.equal(a[0].embed.weight, c[0].embed.weight)


def test_initial_loss_is_near_uniform():
    """A fresh model predicts nearly uniformly over 256 bytes: loss ~ ln 256."""
    layers = build_layers(SMALL, seed=0)
    x = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        loss = loss_fn(_run(layers, x), torch.randint(0, 256, (4, 32)))
    assert abs(float(loss) - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_rotary_preserves_norms_and_is_relative():
    """RoPE rotates pairs (norm kept) and q.k depends only on the position difference."""
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    rq, rk = rotary(q, 10000.0), rotary(k, 10000.0)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, 0, :, None, :] * rk[0, 0, None, :, :]).sum(-1)  # [T, T]
    torch.testing.assert_close(dots[3, 1], dots[5, 3])
    torch.testing.assert_close(dots[2, 2], dots[0, 0])


def test_loss_fn_is_mean_cross_entropy():
    """loss_fn is the mean over all B*T positions, in fp32 even for bf16 logits."""
    logits = torch.randn(2, 3, 256)
    labels = torch.randint(0, 256, (2, 3))
    expected = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).mean()
    torch.testing.assert_close(loss_fn(logits, labels), expected)
    assert loss_fn(logits.bfloat16(), labels).dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [({"hidden": 30, "heads": 4}, "hidden=30"), ({"hidden": 36, "heads": 4}, "hidden=36"),
                                           ({"layers": 0}, "layers=0"), ({"intermediate": 0}, "intermediate=0"),
                                           ({"norm_eps": 0.0}, "norm_eps=0.0")])
def test_bad_config_is_rejected(kwargs, match):
    """Indivisible or odd head dims and non-positive sizes raise ValueError naming the field."""
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**kwargs)


def test_unknown_preset_is_rejected():
    """An unknown preset name raises ValueError listing the presets."""
    with pytest.raises(ValueError, match="size='huge' is not a preset"):
        build_layers("huge")
