"""Masters on disk (state tier phase 2): bitwise equal to training in RAM, checkpoints, faults, what cannot move."""
import errno
import os

import pytest
import torch
import torch.nn.functional as F
from test_state_tier import OPTIMIZERS, WIDTH, assert_bitwise, batches, layers, two_steps_and_a_call

import roundpipe as rp

pytest.importorskip("roundpipe._C")
pytestmark = pytest.mark.usefixtures("state_tier_backend")   # each test with io_uring and with threads

BF16 = dict(devices=["cpu"] * 2, num_microbatches=3, compute_dtype=torch.bfloat16)   # fp32 masters, bf16 uploads
NUMEL = WIDTH * WIDTH + WIDTH
MASTER_FILE = -(-4 * NUMEL // 4096) * 4096


def tight(tmp_path, opt_name="AdamW") -> int:
    """A host_memory with room for the upload copies, gradients, the ring and the masters of 2 of the 6 layers."""
    with rp.RoundPipe(layers(), offload_dir=tmp_path, **BF16) as probe:
        kept = probe.offload.fixed["upload_copies"] + probe.offload.fixed["gradients"]
        probe.offload.bind(OPTIMIZERS[opt_name](probe.parameters()))   # every layer's state file: its size
        state_file = max(lay.nbytes for lay in probe.offload.layouts.values())
    return kept + 3 * (state_file + MASTER_FILE) + 2 * 4 * NUMEL + 1024


def masters(model):
    """The masters as trained (read from disk where they live)."""
    if model.offload is None:
        return [p.detach().clone() for p in model.parameters()]
    return [model.offload.master(p) for p in model.parameters()]


def run(opt_name, asynchronous, data, edit_at=None, ckpt=None, sync_every=False, **offload):
    with rp.RoundPipe(layers(), **BF16, **offload) as model:
        opt = OPTIMIZERS[opt_name](model.parameters())
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
            if sync_every:
                model.synchronize()
            if t == edit_at:   # the user halves the last layer's weight: the next update starts from that
                model.synchronize()
                w = model.module[-1][0].weight
                w.data = (model.offload.master(w) if model.offload else w.detach()) * 0.5
            if ckpt is not None and t == 2:
                model.save_checkpoint(ckpt, opt)
        model.synchronize()
        out = masters(model), model.memory_stats(opt)["host"]
        on_disk = [bool(torch.isnan(p).all()) for p in model.parameters()
                   if p.stride() and all(s == 0 for s in p.stride())]   # placeholders between steps
    closed = [p.detach().clone() for p in model.parameters()]   # close() handed the masters back
    return out + (on_disk, closed)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("opt_name", ["AdamW", "AdamW8bit"])
def test_masters_on_disk_train_bitwise_equal_to_ram(tmp_path, opt_name, asynchronous):
    """State and the masters of 4 of 6 layers on disk: the masters of 6 steps equal training in RAM bit for bit,
    between steps those parameters are NaN placeholders, and close() hands the trained masters back."""
    data = batches(6)
    ram, ram_host, _, _ = run(opt_name, asynchronous, data)
    disk, host, on_disk, closed = run(opt_name, asynchronous, data, offload_dir=tmp_path,
                                      host_memory=tight(tmp_path, opt_name))
    assert_bitwise(ram, disk)
    assert_bitwise(ram, closed)
    assert host["offloaded_master_layers"] >= 4 and host["offloaded_layers"] == 6
    assert host["masters_on_disk"] >= 4 * 4 * NUMEL
    assert host["masters"] == ram_host["masters"] - host["masters_on_disk"]
    assert len(on_disk) >= 8 and all(on_disk)


def test_a_replaced_master_wins(tmp_path):
    """A master the user replaces between steps (p.data = t) is what its layer's next update starts from."""
    data = batches(4)
    ram, _, _, _ = run("AdamW", True, data, edit_at=1)
    disk, _, _, _ = run("AdamW", True, data, edit_at=1, offload_dir=tmp_path, host_memory=tight(tmp_path))
    assert_bitwise(ram, disk)


@pytest.mark.parametrize("opt_name,asynchronous", [("AdamW", False), ("AdamW8bit", True)])
def test_checkpoint_with_masters_on_disk_resumes_bitwise(tmp_path, opt_name, asynchronous):
    """Saved after 3 steps (masters streamed from their files), loaded into a fresh offloaded model and into one in
    RAM: 3 more steps equal the run that went on."""
    data = batches(6)
    budget = tight(tmp_path, opt_name)
    went_on, _, _, _ = run(opt_name, asynchronous, data, ckpt=tmp_path / "ckpt", offload_dir=tmp_path,
                           host_memory=budget)
    for offload in ({"offload_dir": tmp_path, "host_memory": budget}, {}):
        with rp.RoundPipe(layers(), **BF16, **offload) as model:
            opt = OPTIMIZERS[opt_name](model.parameters())
            model.load_checkpoint(tmp_path / "ckpt", opt)
            for x, y in data[3:]:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=asynchronous)
            model.synchronize()
            assert_bitwise(went_on, masters(model))
            if offload:
                assert model.memory_stats(opt)["host"]["offloaded_master_layers"] >= 4


def test_truncated_master_file_updates_no_layer_after_it(tmp_path):
    """A master file truncated underneath: the step's error names it; layers updated before it (tail first) keep
    their update, that layer and those after it keep masters and state as before."""
    data = batches(3)
    with rp.RoundPipe(layers(), offload_dir=tmp_path, host_memory=tight(tmp_path), **BF16) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        two_steps_and_a_call(model, opt, data)
        x, y = data[2]
        before = [[model.offload.master(p) for p in layer.parameters()] for layer in model.module]
        victim = min(model.offload.master_layouts)
        region = model.offload.master_regions[victim]
        model.offload.quiesce()
        with open(region.path, "rb") as f:
            saved = f.read()
        os.truncate(region.path, 4096)
        with pytest.raises(OSError) as info:
            model.step(opt, asynchronous=False)
        assert region.path in str(info.value)
        with open(region.path, "wb") as f:   # put back as it was, to read every master for the comparison
            f.write(saved)
        changed = [any(not torch.equal(model.offload.master(p), q) for p, q in zip(layer.parameters(), old))
                   for layer, old in zip(model.module, before)]
        assert changed == [False] * (victim + 1) + [True] * (5 - victim)
        loss = model.forward_backward(x, labels=y, loss_fn=F.mse_loss)   # upload copies not rewritten from NaN
        model.step(opt, asynchronous=False)
        assert torch.isfinite(torch.as_tensor(loss)).all()
        assert all(torch.isfinite(model.offload.master(p)).all() for p in model.parameters())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_master_write_failure_keeps_the_layer(tmp_path, asynchronous):
    """EIO on writes behind (state or master file): the update stays (kept in RAM until written again), the error
    is raised once, and training goes on bitwise equal to training in RAM."""
    data = batches(5)
    ram, _, _, _ = run("AdamW", asynchronous, data, sync_every=True)   # the same stale windows
    with rp.RoundPipe(layers(), offload_dir=tmp_path, host_memory=tight(tmp_path), **BF16) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        raised = 0
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            try:
                model.step(opt, asynchronous=asynchronous)
                model.synchronize()
            except OSError as e:
                assert str(tmp_path) in str(e)
                raised += 1
            if t == 1:
                model.offload.store._native.inject_fault("write", errno.EIO, 2)
        assert raised == 1
        assert_bitwise(ram, masters(model))


def test_state_dict_reads_masters_on_disk(tmp_path):
    """model.state_dict() gives the trained masters (read from disk), not the placeholders."""
    with rp.RoundPipe(layers(), offload_dir=tmp_path, host_memory=tight(tmp_path), **BF16) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        x, y = batches(1)[0]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=True)
        sd = model.state_dict()
        assert model.offload.placeholders
        want = masters(model)
        assert_bitwise(want, [sd[name] for name, _ in model.named_parameters()])


def test_what_cannot_move_and_bad_budgets(tmp_path):
    """fp32 compute (masters are their own upload copies): only the state goes, and a host_memory below the masters
    is a ValueError saying so; bf16 compute: below upload copies + gradients, or no room for the ring of state and
    masters, ValueErrors naming the bytes."""
    with rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path) as model:
        fixed = model.offload.fixed
    with pytest.raises(ValueError, match=r"upload copies \d+ \+ gradients \d+ \+ masters that are their own upload "
                                         r"copies .* \d+ = \d+ bytes"):
        rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path, host_memory=sum(fixed.values()) - 1)
    with rp.RoundPipe(layers(), **BF16, offload_dir=tmp_path) as model:
        kept = model.offload.fixed["upload_copies"] + model.offload.fixed["gradients"]
    with pytest.raises(ValueError, match=rf"upload copies \d+ \+ gradients \d+ = {kept} bytes"):
        rp.RoundPipe(layers(), **BF16, offload_dir=tmp_path, host_memory=kept - 1)
    with rp.RoundPipe(layers(), **BF16, offload_dir=tmp_path, host_memory=kept + 4096) as model:
        x, y = batches(1)[0]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="ring buffers of a layer's optimizer state and fp32 masters"):
            model.step(rp.optim.AdamW(model.parameters()), asynchronous=False)


def test_hf_save_pretrained_refuses_placeholders_and_close_hands_masters_back(tmp_path):
    """save_pretrained with masters on disk is a ValueError saying what to do; after close() the HF model holds the
    trained masters and saves them."""
    pytest.importorskip("transformers")
    from test_hf import tiny

    from roundpipe.offload.masters import master_layout
    ids = torch.randint(1, 96, (3, 8), generator=torch.Generator().manual_seed(0))
    hf_kw = dict(devices=["cpu"], compute_dtype=torch.bfloat16, offload_dir=tmp_path)
    with rp.hf.wrap(tiny("llama", num_hidden_layers=8), **hf_kw) as probe:
        opt = rp.optim.AdamW(probe.parameters())
        probe.offload.bind(opt)
        index = {id(p): i for i, p in enumerate(probe.parameters())}
        ring = 3 * (max(lay.nbytes for lay in probe.offload.layouts.values())
                    + max(master_layout(probe.host, l, index).nbytes for l in range(len(probe.host))))
        budget = probe.offload.fixed["upload_copies"] + probe.offload.fixed["gradients"] + ring
    model = rp.hf.wrap(tiny("llama", num_hidden_layers=8), host_memory=budget, **hf_kw)
    opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
    model.forward_backward(input_ids=ids, labels=ids)
    model.step(opt, asynchronous=True)
    model.synchronize()
    assert model.memory_stats()["host"]["offloaded_master_layers"] > 0
    trained = {n: model.offload.master(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="save_pretrained: some fp32 masters live in offload_dir"):
        model.save_pretrained(tmp_path / "hf")
    model.close()
    for n, p in model.hf_model.named_parameters():
        assert torch.equal(p, trained[n]), n
