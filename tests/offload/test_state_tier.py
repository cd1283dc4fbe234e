"""The optimizer-state tier (offload_dir=, host_memory=): bitwise equal to training in RAM, faults, checkpoints."""
import errno
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe as rp

pytest.importorskip("roundpipe._C")
pytestmark = pytest.mark.usefixtures("state_tier_backend")   # each test with io_uring and with threads

WIDTH = 80   # 6400-element weights take AdamW8bit's 8-bit path, the 80-element biases its fp32 one


def layers(n=6):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, WIDTH, generator=g), torch.randn(6, WIDTH, generator=g)) for _ in range(n)]


OPTIMIZERS = {"AdamW": lambda ps: rp.optim.AdamW(ps, lr=1e-2), "AdamW8bit": lambda ps: rp.optim.AdamW8bit(ps, lr=1e-2)}


def masters(model):
    return [p.detach().clone() for p in model.parameters()]


def run(opt_name, asynchronous, data, sync_at=(), **offload):
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, **offload) as model:
        opt = OPTIMIZERS[opt_name](model.parameters())
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
            if t in sync_at:
                model.synchronize()
        model.synchronize()
        return masters(model), model.memory_stats(opt)["host"], opt


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), (i, (p - q).abs().max())


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("opt_name", ["AdamW", "AdamW8bit"])
def test_offloaded_training_is_bitwise_equal_to_ram(tmp_path, opt_name, asynchronous):
    """6 steps with every layer's optimizer state on disk give the masters of the same steps in RAM, bit for bit."""
    data = batches(6)
    ram, _, _ = run(opt_name, asynchronous, data)
    disk, host, opt = run(opt_name, asynchronous, data, offload_dir=tmp_path)
    assert_bitwise(ram, disk)
    assert host["offloaded_layers"] == 6 and host["optimizer_state_on_disk"] > 0
    assert all(set(st) <= {"step"} for st in opt.state.values())   # between steps only the counts stay in RAM


def test_host_memory_splits_layers_between_ram_and_disk(tmp_path):
    """A host_memory with room for about half the layers' state keeps those in RAM, the rest on disk; still bitwise."""
    data = batches(4)
    ram, _, _ = run("AdamW", True, data)
    probe = rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path)
    fixed = sum(probe.offload.fixed.values())
    probe.close()
    layer_state = 2 * 4 * (WIDTH * WIDTH + WIDTH)
    ring = 3 * -(-(layer_state + 128) // 4096) * 4096
    disk, host, opt = run("AdamW", True, data, offload_dir=tmp_path, host_memory=fixed + ring + 3 * layer_state + 4096)
    assert_bitwise(ram, disk)
    assert 0 < host["offloaded_layers"] < 6
    assert host["optimizer_state"] > 0   # the resident layers' state


@pytest.mark.parametrize("asynchronous", [False, True])
def test_write_failure_keeps_the_layer_and_raises(tmp_path, asynchronous):
    """An injected EIO on a write behind: the step was applied (the layer's new state kept in RAM), the error names
    the file, and training goes on bitwise equal to training in RAM."""
    data = batches(5)
    ram, _, _ = run("AdamW", asynchronous, data, sync_at=(1, 2))   # sync points close the stale window
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        raised = 0
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            if t != 2:
                model.step(opt, asynchronous=asynchronous)
            else:
                with pytest.raises(OSError) as info:   # a synchronous step raises it, else the next sync point
                    model.step(opt, asynchronous=asynchronous)
                    model.synchronize()
                assert "layer" in str(info.value) and str(tmp_path) in str(info.value)
                raised += 1
            if t == 1:
                model.synchronize()   # step 1 written: the fault hits step 2's first write
                model.offload.store._native.inject_fault("write", errno.EIO, 1)
        model.synchronize()
        assert raised == 1
        assert model.memory_stats()["host"]["optimizer_state_resident_after_error"] == 0   # written again since
        assert_bitwise(ram, masters(model))


def gates_in_order(sync, order):
    """sync.wait_gate handing out the pending layers in `order` (each gate still waited for): the schedule a loaded
    machine can give an asynchronous step, deterministic."""
    wait_gate = sync.wait_gate

    def ordered(rec, pending):
        return wait_gate(rec, {next(l for l in order if l in pending)})
    return ordered


@pytest.mark.parametrize("give_up", ["gates_out_of_order", "save_checkpoint"])
def test_write_failure_state_survives_its_read_ahead_slot_given_up(tmp_path, give_up):
    """After a failed write the layer's new state waits, read ahead, in a ring slot for the next step; that slot given
    up (the next step's first gate below the read-ahead layers, or a checkpoint's quiesce) hands it back to RAM: no
    read of the failed region, training (and a checkpoint taken then) bitwise equal to training in RAM."""
    data = batches(5)
    ram, _, _ = run("AdamW", False, data)
    ckpt = tmp_path / "ckpt"
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path / "a") as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            if t != 2:
                model.step(opt, asynchronous=False)
                continue
            model.offload.store._native.inject_fault("write", errno.EIO, 1)   # step 2's first write: layer 5
            with pytest.raises(OSError, match="injected"):
                model.step(opt, asynchronous=False)   # layer 5 then read ahead (from RAM) into ring slot 0
            if give_up == "gates_out_of_order":
                model.sync.wait_gate = gates_in_order(model.sync, [1, 0, 5, 4, 3, 2])   # layer 1 takes a slot first
            else:
                model.save_checkpoint(ckpt, opt)
        model.synchronize()
        assert model.memory_stats()["host"]["optimizer_state_resident_after_error"] == 0   # written again since
        assert_bitwise(ram, masters(model))
    if give_up == "save_checkpoint":
        with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path / "b") as model:
            opt = OPTIMIZERS["AdamW"](model.parameters())
            model.load_checkpoint(ckpt, opt)
            for x, y in data[3:]:
                model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
                model.step(opt, asynchronous=False)
            assert_bitwise(ram, masters(model))


def two_steps_and_a_call(model, opt, data):
    """Two synchronous steps on data[0], data[1], then data[2]'s call, its step not yet taken."""
    for x, y in data[:2]:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
    x, y = data[2]
    model.forward_backward(x, labels=y, loss_fn=F.mse_loss)


def test_read_failure_updates_no_layer_after_it(tmp_path):
    """An injected EIO on a read: the error names the file and reaches step(); the layers updated before it (tail
    first) keep their update, that layer and those after it are unchanged; the next step trains."""
    data = batches(4)
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        two_steps_and_a_call(model, opt, data)
        before = [[p.detach().clone() for p in layer.parameters()] for layer in model.module]
        model.offload.quiesce()   # no read ahead left: the step's own reads meet the fault
        model.offload.store._native.inject_fault("read", errno.EIO, 1)
        with pytest.raises(OSError) as info:
            model.step(opt, asynchronous=False)
        assert str(tmp_path) in str(info.value)
        changed = [any(not torch.equal(p, q) for p, q in zip(layer.parameters(), old))
                   for layer, old in zip(model.module, before)]
        assert changed != [True] * 6
        first_unchanged = max(l for l, c in enumerate(changed) if not c)
        assert all(changed[l] for l in range(first_unchanged + 1, 6))   # tail first: a suffix was updated
        assert not any(changed[:first_unchanged + 1])
        x, y = data[3]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("opt_name", ["AdamW", "AdamW8bit"])
def test_checkpoint_resumes_bitwise(tmp_path, opt_name, asynchronous):
    """Save after 3 steps with the state on disk, load into a fresh offloaded model: 3 more steps equal the run
    that went on."""
    data = batches(6)
    ckpt = tmp_path / "ckpt"
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path) as model:
        opt = OPTIMIZERS[opt_name](model.parameters())
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
            if t == 2:
                model.save_checkpoint(ckpt, opt)
        model.synchronize()
        went_on = masters(model)
    assert os.path.getsize(ckpt / "optimizer_offload.bin") > 0
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path) as model:
        opt = OPTIMIZERS[opt_name](model.parameters())
        model.load_checkpoint(ckpt, opt)
        for x, y in data[3:]:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=asynchronous)
        model.synchronize()
        assert_bitwise(went_on, masters(model))


def test_offloaded_checkpoint_loads_into_ram(tmp_path):
    """A checkpoint of an offloaded run loads into a model without offload_dir (the state into optimizer.state)."""
    data = batches(5)
    ckpt = tmp_path / "ckpt"
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3, offload_dir=tmp_path) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        for t, (x, y) in enumerate(data):
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
            if t == 2:
                model.save_checkpoint(ckpt, opt)
        went_on = masters(model)
    with rp.RoundPipe(layers(), devices=["cpu"] * 2, num_microbatches=3) as model:
        opt = OPTIMIZERS["AdamW"](model.parameters())
        model.load_checkpoint(ckpt, opt)
        for x, y in data[3:]:
            model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
        assert_bitwise(went_on, masters(model))


def test_bad_input(tmp_path):
    """offload_dir a file, host_memory without offload_dir or below the fixed state, a torch optimizer, too little
    free space: ValueErrors that say what and how."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="offload_dir=.*not a directory"):
        rp.RoundPipe(layers(), devices=["cpu"], offload_dir=f)
    with pytest.raises(ValueError, match="offload_dir=.*not a writable directory"):
        rp.RoundPipe(layers(), devices=["cpu"], offload_dir=f / "sub")
    with pytest.raises(ValueError, match="needs offload_dir"):
        rp.RoundPipe(layers(), devices=["cpu"], host_memory=1 << 30)
    with pytest.raises(ValueError, match="upload copies .* gradients"):
        rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path, host_memory=1000)
    with rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path) as model:
        model.forward_backward(*batches(1)[0][:1], labels=batches(1)[0][1], loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="roundpipe.optim optimizer"):
            model.step(torch.optim.AdamW(model.parameters()), asynchronous=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_offload_dir(tmp_path):
    """A directory this process may not write: ValueError naming it."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not a writable directory"):
            rp.RoundPipe(layers(), devices=["cpu"], offload_dir=ro)
    finally:
        ro.chmod(0o700)


def test_not_enough_free_space(tmp_path, monkeypatch):
    """Less free space than the offloaded state needs: a ValueError with both byte counts before any update."""
    import roundpipe.offload.nvme as nvme
    monkeypatch.setattr(nvme, "free_bytes", lambda path: 1000)
    with rp.RoundPipe(layers(), devices=["cpu"], offload_dir=tmp_path) as model:
        before = masters(model)
        x, y = batches(1)[0]
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match=r"needs \d+ bytes .* which has 1000 bytes"):
            model.step(rp.optim.AdamW(model.parameters()), asynchronous=False)
        assert_bitwise(before, masters(model))
