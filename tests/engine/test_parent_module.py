"""RoundPipe is an nn.Module (issue 52 item 2): a parent module sees the real masters, and the loops of
PyTorch Lightning and Accelerate, a torch optimizer right after backward() and no synchronize(), train
as the same loop over the plain layers (losses and parameters within 1e-5 over 10 steps).  Their
checkpoints hold the weights and reload into an equal model; eval() reaches the layers."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from rp_models import Slow, max_rel_err, mlp
from torch import nn

import roundpipe as rp

TOL = 1e-5
PLAN = rp.Plan(forward=[range(0, 2)], backward=[range(2, 4), range(0, 2)])   # recomputing stages, a late tail


def body_layers(seed=0, dropout=False):
    """Four slow Linear/ReLU layers (a gradient landing after backward() returned shows as a wrong number);
    with dropout, a Dropout(0.5) between them (eval() must reach it)."""
    torch.manual_seed(seed)
    layers = [Slow(m, 0.002) for m in mlp(4)]
    return layers[:2] + [nn.Dropout(0.5)] + layers[2:] if dropout else layers


class Net(nn.Module):
    """A parent module: a RoundPipe (or the plain nn.Sequential) between an input scale and a head."""

    def __init__(self, layers, engine: bool, plan=PLAN):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.body = (rp.RoundPipe(layers, devices=["cpu"] * 2, num_microbatches=3, plan=plan) if engine
                     else nn.Sequential(*layers))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x * self.scale))


def pair(dropout=False):
    """The same net over a RoundPipe and over the plain layers (equal initial values)."""
    layers = body_layers(dropout=dropout)
    plain_layers = copy.deepcopy(layers)
    torch.manual_seed(1)
    net = Net(layers, engine=True, plan=None if dropout else PLAN)
    torch.manual_seed(1)
    ref = Net(plain_layers, engine=False)
    return net, ref


def data(n=10, size=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)) for _ in range(n)]


def assert_same_params(net, ref, tol=TOL):
    mine, theirs = dict(net.named_parameters()), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert max_rel_err(p.detach(), theirs[name].detach()) <= tol, (name, max_rel_err(p.detach(), theirs[name]))


def test_a_parent_sees_the_real_parameters_and_state():
    """parameters(), named_parameters(), state_dict() and named_modules() of a parent name the RoundPipe's
    masters themselves under the plain nn.Sequential's names; train()/eval() reach its layers; .to('cpu')
    leaves it as it is, a cast refuses naming compute_dtype."""
    net, ref = pair(dropout=True)
    with net.body:
        assert [n for n, _ in net.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert list(net.state_dict()) == list(ref.state_dict())
        masters = {id(p) for p in net.body.module.parameters()}
        assert {id(p) for n, p in net.named_parameters() if n.startswith("body.")} == masters
        assert [n for n, _ in net.named_modules()] == [n for n, _ in ref.named_modules()]
        net.eval()
        assert not net.body.training and not net.body.module[2].training
        x = torch.randn(6, 8)
        with torch.no_grad():   # dropout off: two calls agree, and equal the plain net in eval()
            out = net(x)
            assert torch.equal(out, net(x))
            assert max_rel_err(out, ref.eval()(x)) <= TOL
        net.train()
        assert net.body.training and net.body.module[2].training
        assert net.to("cpu") is net and all(p.device.type == "cpu" for p in net.body.parameters())
        with pytest.raises(TypeError, match="compute_dtype"):
            net.body.half()
        assert all(p.dtype == torch.float32 for p in net.body.parameters())


def test_a_parent_state_dict_round_trip():
    """A parent's state_dict, after training steps, loads into a fresh parent (its RoundPipe's masters and
    upload copies both): the two give equal outputs and train on equally."""
    net, _ = pair()
    torch.manual_seed(5)
    other = Net(body_layers(seed=7), engine=True)
    with net.body, other.body:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for x, y in data(3):
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        sd = net.state_dict()
        missing = other.load_state_dict(sd)
        assert not missing.missing_keys and not missing.unexpected_keys
        x = torch.randn(6, 8)
        with torch.no_grad():
            assert torch.equal(other(x), net(x))
        with pytest.raises(ValueError, match="assign=True"):
            other.load_state_dict(sd, assign=True)


def test_roundpipes_do_not_nest():
    with rp.RoundPipe(mlp(2), devices=["cpu"]) as inner:
        with pytest.raises(TypeError, match="cannot be nested"):
            rp.RoundPipe(inner, devices=["cpu"])


def lightning_module(net, steps_seen: list):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, _):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            steps_seen.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Module()


def fit_lightning(module, batches, tmp_path=None):
    import lightning as L
    from torch.utils.data import DataLoader

    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Lightning's advice on DataLoader workers
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


def test_lightning_trains_as_plain_pytorch(tmp_path):
    """A LightningModule holding a RoundPipe, Lightning's own loop (AdamW, automatic optimization, no
    synchronize()), 10 steps: losses and parameters equal the same LightningModule over the plain layers;
    trainer.save_checkpoint holds the weights and LightningModule.load_from_checkpoint-style reloading
    (load_state_dict of the checkpoint's state_dict) gives an equal model."""
    pytest.importorskip("lightning")
    net, ref = pair()
    batches = data()
    with net.body:
        mine, theirs = [], []
        trainer = fit_lightning(lightning_module(net, mine), batches, tmp_path)
        fit_lightning(lightning_module(ref, theirs), batches)
        assert len(mine) == len(theirs) == 10
        assert max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, theirs)) <= TOL, (mine, theirs)
        assert_same_params(net, ref)
        path = tmp_path / "last.ckpt"
        trainer.save_checkpoint(path)
        saved = torch.load(path, weights_only=False)["state_dict"]
        assert {k for k in saved if k.startswith("net.body.")} == {f"net.{k}" for k in ref.state_dict()
                                                                    if k.startswith("body.")}
        torch.manual_seed(9)
        fresh = Net(body_layers(seed=9), engine=True)
        with fresh.body:
            reloaded = lightning_module(fresh, [])
            reloaded.load_state_dict(saved)
            assert_same_params(fresh, ref)
            x = torch.randn(6, 8)
            with torch.no_grad():
                assert torch.equal(fresh(x), net(x))


def test_accelerate_trains_as_plain_pytorch(tmp_path):
    """Accelerate's loop (prepare, accelerator.backward, a torch AdamW, no synchronize()), 10 steps: losses and
    parameters equal plain PyTorch's; get_state_dict and save_state hold the weights, load_state restores them."""
    accelerate = pytest.importorskip("accelerate")
    net, ref = pair()
    with net.body:
        acc = accelerate.Accelerator(cpu=True)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net_p, opt_p = acc.prepare(net, opt)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for x, y in data():
            loss = F.mse_loss(net_p(x), y)
            acc.backward(loss)
            opt_p.step()
            opt_p.zero_grad()
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert max_rel_err(loss.detach(), ref_loss.detach()) <= TOL
        assert_same_params(net, ref)
        state = acc.get_state_dict(net_p)
        assert state.keys() == ref.state_dict().keys()
        acc.save_state(str(tmp_path / "state"))
        trained = {k: v.clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        acc.load_state(str(tmp_path / "state"))
        for k, v in net.state_dict().items():
            assert torch.equal(v, trained[k]), k
        x = torch.randn(6, 8)
        with torch.no_grad():   # the reloaded masters reached the workers' upload copies too
            assert max_rel_err(net(x), ref(x)) <= TOL
