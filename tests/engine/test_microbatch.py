"""Splitting call arguments into microbatches and merging outputs."""
import pytest
import torch

from roundpipe.engine.calls.microbatch import even_sizes, merge, split


def test_uneven_sizes_put_the_remainder_first():
    """B=10 in 4 microbatches gives 3, 3, 2, 2 and weights size/B."""
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    mb = split((torch.zeros(10, 2),), {}, None, 4, default=2)
    assert mb.sizes == [3, 3, 2, 2]
    assert mb.weights == [0.3, 0.3, 0.2, 0.2]


def test_only_batch_sized_leaves_are_split_in_nests():
    """Tensors with dim 0 == B are split, other leaves reach every microbatch whole."""
    x, mask, scale = torch.arange(12.).view(6, 2), torch.ones(3, 3), torch.tensor(2.0)
    mb = split(({"x": x, "pair": (mask, 7)},), {"scale": scale, "ids": torch.arange(6)}, torch.arange(6) * 10, 3, 4)
    assert len(mb) == 3
    assert torch.equal(mb.args[1][0]["x"], x[2:4])
    assert mb.args[2][0]["pair"][0] is mask and mb.args[2][0]["pair"][1] == 7
    assert mb.kwargs[0]["scale"] is scale and torch.equal(mb.kwargs[2]["ids"], torch.tensor([4, 5]))
    assert torch.equal(mb.labels[1], torch.tensor([20, 30]))


def test_default_count_is_clamped_to_the_batch():
    """Without num_microbatches the round size is used, but never more than B."""
    assert len(split((torch.zeros(2, 1),), {}, None, None, default=5)) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(args=(3, "x"), num=1), "nothing to split"),
    (dict(args=(torch.zeros(4, 2),), num=0), "num_microbatches=0"),
    (dict(args=(torch.zeros(4, 2),), num=2, labels=torch.zeros(3)), "labels have batch size 3"),
])
def test_bad_inputs_name_the_argument(kwargs, match):
    """Bad splits raise ValueError naming the argument and its value."""
    with pytest.raises(ValueError, match=match):
        split(kwargs["args"], {}, kwargs.get("labels"), kwargs["num"], 2)


def test_custom_split_fn_sets_sizes():
    """A custom split function's microbatch sizes are read from its first tensor."""
    def halves(args, kwargs, labels, n):
        x = args[0]
        return [((x[:1],), kwargs, labels[:1]), ((x[1:],), kwargs, labels[1:])]
    mb = split((torch.zeros(4, 2),), {}, torch.zeros(4), 2, 2, split_fn=halves)
    assert mb.sizes == [1, 3]


def test_merge_concatenates_nests():
    """Outputs are concatenated along dim 0 leaf by leaf; scalars are stacked."""
    outs = [{"h": torch.ones(2, 3), "s": torch.tensor(1.0), "n": 4}, {"h": torch.zeros(1, 3), "s": torch.tensor(2.0), "n": 5}]
    m = merge(outs)
    assert m["h"].shape == (3, 3) and torch.equal(m["s"], torch.tensor([1.0, 2.0])) and m["n"] == [4, 5]


def test_batch_smaller_than_the_microbatch_count_gets_one_sample_each():
    """A DataLoader's last batch (2 samples, 3 microbatches asked for) splits into 2 microbatches of one;
    an empty batch and a bad count stay errors."""
    x = torch.arange(4.0).reshape(2, 2)
    mb = split((x,), {}, x[:, :1], 3, 3)
    assert len(mb) == 2 and mb.sizes == [1, 1] and mb.weights == [0.5, 0.5]
    assert torch.equal(mb.args[1][0], x[1:]) and torch.equal(mb.labels[0], x[:1, :1])
    with pytest.raises(ValueError, match="batch is empty"):
        split((torch.zeros(0, 2),), {}, None, 3, 3)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        split((x,), {}, None, 0, 3)
