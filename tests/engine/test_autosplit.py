"""RoundPipe(module) for a module that is not a list of layers: cut by roundpipe/planner/autosplit.py."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err
from torch import nn

import roundpipe as rp
from roundpipe.planner.autosplit import SplitModule, split_module


class Block(nn.Module):
    """torchvision's BasicBlock, small: the residual spans every child, so a block is one piece."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet forward (conv1, bn1, relu, maxpool, layer1..2, avgpool, flatten, fc), tiny."""

    def __init__(self, width=4, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(Block(width, width), Block(width, width))
        self.layer2 = nn.Sequential(Block(width, 2 * width, 2), Block(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class Residual(nn.Module):
    """A residual across two children (a, b), a parameter used by the forward itself, an unused child."""

    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.head = nn.Linear(width, 3)
        self.unused = nn.Linear(width, width)

    def forward(self, x, shift=0.0):
        h = torch.tanh(self.embed(x) + shift)
        h = h + self.b(torch.relu(self.a(h)))
        return self.head(h * self.scale)


def train_both(module, make_opt, batches, workers=3, microbatches=4, loss_fn=F.cross_entropy, **kw):
    """Trains the module through RoundPipe (synchronous steps) and a deep copy with plain autograd;
    returns (RoundPipe, reference, list of (loss, reference loss))."""
    ref = copy.deepcopy(module)
    ref_opt = make_opt(ref.parameters())
    model = rp.RoundPipe(module, devices=["cpu"] * workers, num_microbatches=microbatches, **kw)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        loss = model.forward_backward(x, labels=y, loss_fn=loss_fn)
        model.step(opt, asynchronous=False)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss, ref_loss.detach()))
    return model, ref, losses


def assert_same_state(model, ref, tol=1e-5):
    ours, theirs = model.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    for name, t in theirs.items():
        if t.is_floating_point():
            assert max_rel_err(ours[name], t) <= tol, (name, max_rel_err(ours[name], t))
        else:
            assert torch.equal(ours[name], t), name


def calls(seq):
    """The submodules each piece calls, in order."""
    return [[n.target for n in piece.graph.nodes if n.op == "call_module"] for piece in seq]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_trains_like_pytorch(net, batches, workers, microbatches):
    """SGD steps through RoundPipe(net) give plain PyTorch's losses, and its state (names and values) after them."""
    model, ref, losses = train_both(net, sgd, batches, workers, microbatches)
    with model:
        for loss, ref_loss in losses:
            assert max_rel_err(loss, ref_loss) <= 1e-5
        assert_same_state(model, ref)


def test_resnet_is_cut_at_its_blocks_and_keeps_its_names():
    """A torchvision-style ResNet is cut at its top-level steps and inside its large stages, one block a
    piece; the RoundPipe presents the module's own parameters under the module's own names."""
    torch.manual_seed(0)
    net = ResNet()
    seq = split_module(net)
    assert calls(seq) == [["conv1"], ["bn1", "relu", "maxpool"], ["layer1.0"], ["layer1.1"], ["layer2.0"],
                          ["layer2.1", "avgpool"], ["fc"]]
    x = torch.randn(2, 3, 8, 8)
    h = seq[0](x)
    for piece in seq[1:]:
        h = piece(h)
    assert torch.equal(h, net(x))
    with rp.RoundPipe(net, devices=["cpu"]) as model:
        assert isinstance(model.module, SplitModule) and len(model.module) == 7
        assert [id(p) for p in model.parameters()] == [id(p) for p in net.parameters()]
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in net.named_parameters()]
        assert "layer1.0.conv1.weight" in model.state_dict()
        assert list(model.named_state()) == list(net.state_dict())   # the checkpoint's names


@pytest.mark.parametrize("workers, microbatches", [(2, 3), (4, 5)])
def test_resnet_trains_like_pytorch(workers, microbatches):
    """Eval-mode BatchNorm (fixed statistics, trained affine): loss and every parameter after 2 SGD
    steps equal plain PyTorch's, over several workers and microbatches."""
    torch.manual_seed(workers)
    net = ResNet().eval()
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(10, 3, 8, 8, generator=g), torch.randint(0, 5, (10,), generator=g)) for _ in range(2)]
    assert_trains_like_pytorch(net, batches, workers, microbatches)


def test_resnet_trains_batchnorm_like_pytorch():
    """Training-mode BatchNorm with one microbatch: loss, parameters and running statistics (in the
    user's module, which the RoundPipe's masters are) equal plain PyTorch's after 2 steps."""
    torch.manual_seed(1)
    net = ResNet()
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(2)]
    model, ref, losses = train_both(net, sgd, batches, workers=2, microbatches=1)
    with model:
        for loss, ref_loss in losses:
            assert max_rel_err(loss, ref_loss) <= 1e-5
        model.synchronize()
        assert_same_state(model, ref)
        assert net.bn1.num_batches_tracked.item() == 2
        assert max_rel_err(net.layer2[1].bn2.running_var, ref.layer2[1].bn2.running_var) <= 1e-5


def test_residual_across_children_stays_in_one_piece_and_trains_like_pytorch():
    """The residual h + b(a(h)) keeps a and b in one piece; a parameter read by the forward itself is a
    piece of its own; with a keyword argument and an unused child, Adam trains like plain PyTorch and the unused child's
    parameters are the engine's (in the optimizer, p.grad None)."""
    torch.manual_seed(2)
    net = Residual()
    seq = split_module(net, max_share=1.0)
    assert [sorted(n for n, _ in piece.named_parameters()) for piece in seq] == [
        ["embed.bias", "embed.weight"], ["a.bias", "a.weight", "b.bias", "b.weight"], ["scale"],
        ["head.bias", "head.weight", "unused.bias", "unused.weight"]]
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)) for _ in range(2)]
    model, ref, losses = train_both(net, lambda p: torch.optim.Adam(p, lr=0.01), batches, workers=2, microbatches=3)
    with model:
        for loss, ref_loss in losses:
            assert max_rel_err(loss, ref_loss) <= 1e-5
        assert_same_state(model, ref)
        x = torch.randn(4, 6)
        with torch.no_grad():
            assert max_rel_err(model(x, shift=0.5), ref(x, shift=0.5)) <= 1e-5
        model.synchronize()
        assert net.unused.weight.grad is None
        assert torch.equal(net.unused.weight, ref.unused.weight)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:   # data-dependent: fx cannot trace it
            x = -x
        return self.b(self.a(x))


class TwoStreams(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        z = self.b(x)   # x and y both flow past b, y and z past c
        return self.c(y + z) + y


class ReadsTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(F.dropout(self.a(x), 0.5, training=self.training))


@pytest.mark.parametrize("module, match", [
    (Branchy(), r"split the module \(Branchy\) into layers: torch\.fx could not trace its forward: TraceError: "
                r".*control flow.* at .*test_autosplit\.py:\d+; pass a list of layers"),
    (TwoStreams(), r"\(TwoStreams\) into layers: there is no point in its forward, or inside its heaviest children, "
                   r"where a single value flows on "
                   r"\(at best 2 values .*: x, a after 'a'\); pass a list of layers"),
    (ReadsTraining(), r"\(ReadsTraining\) into layers: its forward reads self\.training.*; pass a list of layers"),
])
def test_a_module_that_cannot_be_split_raises_naming_it(module, match):
    """Untraceable control flow, no single-value point and a forward reading self.training raise
    ValueError naming the module, the reason and the alternative."""
    with pytest.raises(ValueError, match=match):
        rp.RoundPipe(module, devices=["cpu"])


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.big = Branchy()
        self.last = nn.Linear(4, 4)

    def forward(self, x):
        return self.last(self.big(self.first(x)))


def test_large_untraceable_child_is_kept_whole_with_a_warning():
    """A child holding more than its share that fx cannot trace through stays one layer, with a
    warning naming it; the model still trains."""
    with pytest.warns(UserWarning, match=r"keeps submodule 'big' \(Branchy\) whole.*: torch\.fx could not trace its forward: TraceError"):
        seq = split_module(Holder())
    assert len(seq) == 3 and seq[1].big.a is not None


def test_device_cap_splits_deeper():
    """max_share=1 leaves layer1 and layer2 whole; under a device cap whose quarter holds the largest
    block's fp32 weights and gradients (and layer1's) but not layer2's, layer2 is split into blocks."""
    net = ResNet()
    assert len(split_module(net, max_share=1.0)) == 5
    block = sum(p.numel() for p in net.layer2[1].parameters())
    assert sum(p.numel() for p in net.layer1.parameters()) <= block < sum(p.numel() for p in net.layer2.parameters())
    seq = split_module(net, max_share=1.0, device_memory=4 * (4 + 4) * block)
    assert calls(seq) == [["conv1"], ["bn1", "relu", "maxpool"], ["layer1"], ["layer2.0"], ["layer2.1", "avgpool"],
                          ["fc"]]


def test_leaf_module_and_non_module():
    """A module without children is one layer; a non-module is a TypeError naming what was given."""
    lin = nn.Linear(3, 2)
    with rp.RoundPipe(lin, devices=["cpu"]) as model:
        assert len(model.module) == 1 and [n for n, _ in model.named_parameters()] == ["weight", "bias"]
        x = torch.randn(5, 3)
        with torch.no_grad():
            assert torch.allclose(model(x), lin(x))
    with pytest.raises(TypeError, match="layers must be an nn.Module.*got int"):
        rp.RoundPipe(42, devices=["cpu"])


def test_hf_causal_lm_points_to_hf_wrap():
    """A Hugging Face causal LM is not traced: the TypeError points to rp.hf.wrap."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(TypeError, match=r"LlamaForCausalLM is a Hugging Face causal LM: wrap it with rp\.hf\.wrap"):
        rp.RoundPipe(lm, devices=["cpu"])


class OptionalBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, bias=None):
        h = self.a(x)
        if bias is not None:
            h = h + bias
        return self.b(h)


def test_argument_defaulting_to_none_is_traced_as_none():
    """`if bias is not None` takes the None branch (fx cannot see a proxy's value); passing bias is an
    error, not a silently wrong graph."""
    torch.manual_seed(3)
    net = OptionalBias()
    seq = split_module(net)
    x = torch.randn(2, 4)
    assert len(seq) == 2 and torch.equal(seq[1](seq[0](x)), net(x))
    with pytest.raises(AssertionError, match="bias has been specialized to have value None"):
        seq[0](x, torch.ones(4))


class OneStep(nn.Module):
    """The published system's quick-start shape: the whole network in one child, `return self.seq(x)`."""

    def __init__(self, width=4, classes=5):
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(inplace=True), Block(width, width),
                                 Block(width, 2 * width, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(2 * width, classes))

    def forward(self, x):
        return self.seq(x)


def test_a_forward_of_one_step_is_cut_inside_that_step():
    """`return self.seq(x)` is cut inside seq (its heaviest child) and trains like PyTorch, keeping seq's names
    (before: 'its forward has fewer than two steps')."""
    torch.manual_seed(0)
    net = OneStep().eval()
    assert len(split_module(net)) >= 3
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(10, 3, 8, 8, generator=g), torch.randint(0, 5, (10,), generator=g)) for _ in range(2)]
    assert_trains_like_pytorch(net, batches, workers=2, microbatches=2)   # its state_dict's names are seq's too


class OptionalScale(nn.Module):
    """forward(x, scale=None): an argument defaulting to None, traced as None by the cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale=None):
        h = self.a(x)
        if scale is not None:
            h = h * scale
        return self.b(h)


def test_an_argument_traced_as_none_is_refused_by_name():
    """Passing an argument the cut traced as None (by keyword or position) is a TypeError naming it and the rule,
    before any work (before, layer 0 raised `forward() got an unexpected keyword argument`); None itself is fine."""
    x = torch.randn(4, 8)
    with rp.RoundPipe(OptionalScale(), devices=["cpu"]) as model:
        assert model(x, scale=None).shape == (4, 8)
        for call in (lambda: model(x, scale=torch.ones(8)), lambda: model(x, torch.ones(8)),
                     lambda: model.forward_backward(x, scale=torch.ones(8))):
            with pytest.raises(TypeError, match="'scale' defaults to None and was traced as None"):
                call()
        assert model.forward_backward(x, labels=torch.zeros(4, 8), loss_fn=F.mse_loss).dim() == 0   # usable after
