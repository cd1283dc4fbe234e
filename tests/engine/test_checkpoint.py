"""Checkpoints: resume bit for bit in both step modes, atomic files, clear errors (roundpipe/engine/state/checkpoint.py)."""
import json
import os
import queue
import subprocess
import sys
import threading

import checkpoint_run as run  # noqa: E402
import pytest
import torch
import torch.nn.functional as F

import roundpipe as rp
from roundpipe.engine.state import tensor_file

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: the scripts
STEPS, SAVE_AT = 6, 3


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    """resume(cfg): a separate process loads cfg["load"] and trains on (checkpoint_run.main); returns None or
    that process's traceback.  One process serves the module's cases in turn, so Python and torch start once;
    it never ran the training that saved the checkpoint it loads."""
    log = tmp_path_factory.mktemp("resume") / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "checkpoint_run.py"), "--serve"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    answers = queue.Queue()

    def read():
        for line in proc.stdout:
            answers.put(line)
        answers.put(None)   # the process ended

    threading.Thread(target=read, daemon=True).start()

    def send(cfg):
        proc.stdin.write(json.dumps(cfg) + "\n")
        proc.stdin.flush()
        try:
            answer = answers.get(timeout=240)
        except queue.Empty:
            answer = None
        if answer is None:   # ended, or stuck: later cases must not read this one's answer
            proc.kill()
            raise AssertionError(f"the resuming process gave no answer; stderr: {log.read_text()[-3000:]}")
        return None if answer.strip() == "ok" else json.loads(answer)

    yield send
    try:
        proc.stdin.close()
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code in (0, -9), log.read_text()[-3000:]   # -9: killed by send() above, which already failed


def uninterrupted(cfg):
    torch.manual_seed(5)
    model, opt, sched = run.build(cfg)
    with model:
        losses = run.train(cfg, model, opt, sched, 0, STEPS)
        return run.masters(model), losses, sched.get_last_lr(), model.loss_scale


CASES = [
    dict(asynchronous=False),
    dict(asynchronous=True),
    dict(asynchronous=True, accum=2, dtype="bfloat16"),     # held bf16 gradients, a window of two calls
    dict(asynchronous=False, dtype="bfloat16"),
    dict(asynchronous=True, optimizer="torch"),              # whole-model update done before the window closed
    dict(asynchronous=True, optimizer="torch", accum=2, dtype="bfloat16"),
    dict(asynchronous=True, dtype="float16"),                # the loss scale grows across the checkpoint
    dict(asynchronous=True, optimizer="torch", dtype="float16"),
    dict(asynchronous=True, compensation=True, dtype="bfloat16"),   # workers read predicted weights
    dict(asynchronous=False, optimizer="adamw8bit"),         # 8-bit blockwise states saved and resumed bitwise
    dict(asynchronous=True, optimizer="adamw8bit", dtype="bfloat16"),
    dict(asynchronous=True, optimizer="adamw8bit", dtype="bfloat16", master="bfloat16"),   # bf16 masters, SR
    dict(asynchronous=False, dtype="bfloat16", master="bfloat16"),
    dict(asynchronous=True, optimizer="torch", dtype="bfloat16", master="bfloat16"),   # a torch optimizer in place
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_save_resume_and_never_save_end_bitwise_equal(tmp_path, case, resume):
    """(A) saves after step 3 and goes on, (B) a new process loads that checkpoint and goes on, (C) never saves:
    equal masters, losses and learning rate, with dropout, clipping, LambdaLR and rp or torch AdamW."""
    cfg = dict(case, path=str(tmp_path / "ckpt"), save_at=SAVE_AT, steps=STEPS, out=str(tmp_path / "b.pt"),
               load=str(tmp_path / "ckpt"))
    c_masters, c_losses, c_lr, c_scale = uninterrupted({k: v for k, v in cfg.items() if k != "save_at"})
    a_masters, a_losses, a_lr, a_scale = uninterrupted(cfg)
    assert os.path.exists(cfg["path"])
    failure = resume(cfg)
    assert failure is None, failure[-3000:]
    b = torch.load(cfg["out"])
    per_step = case.get("accum", 1)
    assert a_losses == c_losses
    assert b["losses"] == c_losses[SAVE_AT * per_step:]
    assert a_lr == c_lr == b["lr"]
    assert a_scale == c_scale == b["scale"]
    if case.get("dtype") == "float16":
        assert c_scale == 2.0 ** 13   # grown at steps 2, 4 and 6 (growth_interval 2)
    for name, t in c_masters.items():
        assert torch.equal(a_masters[name], t), name
        assert torch.equal(b["masters"][name], t), name
    if case.get("optimizer") == "adamw8bit":   # the codes themselves were saved, not a dequantized copy
        saved = torch.load(os.path.join(cfg["path"], "optimizer.pt"))["state"]
        assert sorted(str(s["state1"].dtype) for s in saved.values()) == ["torch.float32"] * 5 + ["torch.uint8"] * 5
    manifest = json.load(open(os.path.join(cfg["path"], "checkpoint.json")))
    pending = manifest["pending_step"]
    if case["asynchronous"]:   # saved right after an asynchronous step: still pending, window open
        # a torch optimizer's whole update ran before the window closed, unless the masters are their own upload
        # copies (fp32 compute): it then waits for the gates, still to come
        before_gates = case.get("optimizer") == "torch" and case.get("dtype", "float32") != case.get("master", "float32")
        assert pending["window"] == per_step and pending["kind"] == ("copy" if before_gates else "update")
    else:
        assert pending is None


def small_model(**kw):
    torch.manual_seed(0)
    return rp.RoundPipe([torch.nn.Linear(4, 4) for _ in range(3)], devices=["cpu"] * 2, **kw)


def test_files_are_safetensors_with_the_models_names(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        model.save_checkpoint(tmp_path / "c", opt)
        with safetensors.safe_open(str(tmp_path / "c" / "model.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(model.state_dict())
            for k in f.keys():
                assert torch.equal(f.get_tensor(k), model.state_dict()[k])


def test_an_rp_adamw_checkpoint_loads_into_torch_adamw_and_back(tmp_path):
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
        model.save_checkpoint(tmp_path / "rp", opt)
        expected = opt.state_dict()
    with small_model() as model:
        topt = torch.optim.AdamW(model.parameters(), lr=1.0)
        model.load_checkpoint(tmp_path / "rp", topt)
        got = topt.state_dict()
        assert got["param_groups"][0]["lr"] == 1e-2
        for i, s in expected["state"].items():
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got["state"][i][k], s[k])
        model.save_checkpoint(tmp_path / "torch", topt)
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        model.load_checkpoint(tmp_path / "torch", opt)
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected["state"][0]["exp_avg"])


def saved(tmp_path, **kw):
    with small_model(**kw) as model:
        opt = rp.optim.AdamW(model.parameters())
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        model.step(opt, asynchronous=True)
        model.save_checkpoint(tmp_path / "c", opt)
    return tmp_path / "c"


def test_a_truncated_file_is_named(tmp_path):
    path = saved(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with small_model() as model:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"model\.safetensors has \d+ bytes but the manifest says"):
            model.load_checkpoint(path, rp.optim.AdamW(model.parameters()))
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # nothing lost


def test_a_truncated_file_without_its_manifest_entry_is_caught_by_the_reader(tmp_path):
    path = saved(tmp_path)
    f = path / "engine.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(ValueError, match="engine.safetensors"):
        tensor_file.TensorFile(str(f))


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    path = saved(tmp_path)
    torch.manual_seed(0)
    with rp.RoundPipe([torch.nn.Linear(4, 4), torch.nn.Linear(4, 5), torch.nn.Linear(5, 4)],
                      devices=["cpu"] * 2) as model:
        with pytest.raises(ValueError, match=r"model\.safetensors: tensor '1\.weight' has shape \[4, 4\] but the "
                                             r"model's is \[5, 4\]"):
            model.load_checkpoint(path, rp.optim.AdamW(model.parameters()))


def test_a_wrong_format_version_is_refused(tmp_path):
    path = saved(tmp_path)
    manifest = json.load(open(path / "checkpoint.json"))
    manifest["version"] = 99
    json.dump(manifest, open(path / "checkpoint.json", "w"))
    with small_model() as model:
        with pytest.raises(ValueError, match="format version 99; this roundpipe reads version 1"):
            model.load_checkpoint(path, rp.optim.AdamW(model.parameters()))


def test_a_pending_step_needs_the_optimizer(tmp_path):
    path = saved(tmp_path)
    with small_model() as model:
        with pytest.raises(ValueError, match="holds a pending step"):
            model.load_checkpoint(path)
        opt = rp.optim.AdamW(model.parameters())
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        model.step(opt, asynchronous=True)
        with pytest.raises(ValueError, match="a step is pending"):
            model.save_checkpoint(tmp_path / "d")
        with pytest.raises(ValueError, match="not the one the pending step uses"):
            model.save_checkpoint(tmp_path / "d", rp.optim.AdamW(model.parameters()))
        assert not (tmp_path / "d").exists()


def test_saving_is_atomic_and_replaces_an_older_checkpoint(tmp_path, monkeypatch):
    path = saved(tmp_path)
    before = (path / "checkpoint.json").read_text()
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters())
        from roundpipe.engine.state import checkpoint

        def boom(*a, **k):
            raise OSError("disk full")
        monkeypatch.setattr(checkpoint, "_save_obj", boom)
        with pytest.raises(OSError, match="disk full"):
            model.save_checkpoint(path, opt)
        assert (path / "checkpoint.json").read_text() == before   # the old one is untouched
        assert [p.name for p in tmp_path.iterdir()] == ["c"]        # no temporary left behind
        monkeypatch.undo()
        model.save_checkpoint(path, opt)
        assert json.load(open(path / "checkpoint.json"))["pending_step"] is None


def test_tied_weights_are_stored_once(tmp_path):
    emb = torch.nn.Linear(4, 4, bias=False)
    head = torch.nn.Linear(4, 4, bias=False)
    head.weight = emb.weight
    with rp.RoundPipe([emb, torch.nn.Tanh(), head], devices=["cpu"] * 2) as model:
        opt = rp.optim.AdamW(model.parameters())
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        model.save_checkpoint(tmp_path / "c", opt)
        w = model.module[0].weight.detach().clone()
    with tensor_file.TensorFile(str(tmp_path / "c" / "model.safetensors")) as f:
        assert list(f.entries) == ["0.weight"]
        assert json.loads(f.metadata["aliases"]) == {"2.weight": "0.weight"}
    emb, head = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    head.weight = emb.weight
    with rp.RoundPipe([emb, torch.nn.Tanh(), head], devices=["cpu"] * 2) as model:
        model.load_checkpoint(tmp_path / "c", rp.optim.AdamW(model.parameters()))
        assert torch.equal(model.module[2].weight, w)


_SAVE_CHILD = r'''
import json, sys, torch
import torch.nn.functional as F
import roundpipe as rp
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
def reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current RSS
torch.manual_seed(0)
model = rp.RoundPipe([torch.nn.Linear(1024, 1024) for _ in range(16)], devices=["cpu"] * 2)
opt = rp.optim.AdamW(model.parameters())
model.forward_backward(torch.randn(4, 1024), labels=torch.randn(4, 1024), loss_fn=F.mse_loss)
model.step(opt, asynchronous=True)   # pending (asynchronous): its fp32 gradients are saved too
out = {"params": sum(p.numel() for p in model.parameters())}
model.save_checkpoint(sys.argv[1] + "/warm", opt)   # code paged in
reset(); before = hwm()
model.save_checkpoint(sys.argv[1] + "/c", opt)
out["save"] = hwm() - before
model.close()
model = rp.RoundPipe([torch.nn.Linear(1024, 1024) for _ in range(16)], devices=["cpu"] * 2)
opt = rp.optim.AdamW(model.parameters())
reset(); before = hwm()
model.load_checkpoint(sys.argv[1] + "/c", opt)
out["load"] = hwm() - before
print("RESULT " + json.dumps(out))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_saving_streams_without_a_second_copy(tmp_path):
    """Saving 16.8M parameters with AdamW state and a pending step's fp32 gradients (269 MB written) grows
    peak RSS by less than a tenth of that (measured 2026-11-25: 4 KB); loading grows it by at most what it
    restores that was not there (optimizer state and gradients, 12 B/param; measured 4.0), never by a copy
    of the masters on top."""
    proc = subprocess.run([sys.executable, "-c", _SAVE_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    n = r["params"]
    print(r, {k: r[k] / n for k in ("save", "load")})
    assert r["save"] <= 16 * n / 10, r
    assert r["load"] <= 14 * n, r


def test_a_wrapped_hf_model_with_lora_and_tied_embeddings_resumes_and_keeps_hf_names(tmp_path):
    """rp.hf.wrap of a PEFT LoRA model with tied embeddings, bf16, asynchronous step: the checkpoint's
    model.safetensors holds the HF model's own names (tied weight once) and a resumed run equals the
    uninterrupted one bit for bit."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    def build():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True)).float()
        model = rp.hf.wrap(get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
                           devices=["cpu"] * 2, compute_dtype=torch.bfloat16)
        return model, rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    ids = torch.randint(1, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    model, opt = build()
    with model:
        hf_names = set(model.hf_model.state_dict())
        for step in range(5):
            model.forward_backward(ids, labels=ids)
            model.step(opt, asynchronous=True)
            if step == 2:
                model.save_checkpoint(tmp_path / "c", opt)
        model.synchronize()
        uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}
    with tensor_file.TensorFile(str(tmp_path / "c" / "model.safetensors")) as f:
        assert set(f.entries) <= hf_names and len(f.entries) == len(hf_names) - 1   # lm_head.weight is tied
    model, opt = build()
    with model:
        model.load_checkpoint(tmp_path / "c", opt)
        for _ in range(2):
            model.forward_backward(ids, labels=ids)
            model.step(opt, asynchronous=True)
        model.synchronize()
        assert all(torch.equal(v, uninterrupted[k]) for k, v in model.state_dict().items())


def _random_run(seed, ops, save_at=None, load=None, path=None):
    """A seeded random sequence of engine calls (the same data whatever happens around it); with save_at,
    a checkpoint after that many operations; with load, the run starts from it at op index load."""
    torch.manual_seed(11)
    model = rp.RoundPipe(run.layers(), devices=["cpu"] * 2, num_microbatches=2, compute_dtype=torch.bfloat16)
    opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.2 * s))
    with model:
        start = 0
        if load is not None:
            model.load_checkpoint(path, opt, sched)
            start = load
        for i, op in enumerate(ops):
            if i < start:
                continue
            x, y = run.batch(i, 0)
            if op == "fb":
                model.forward_backward(x, labels=y, loss_fn=F.cross_entropy)
            elif op == "async":
                model.step(opt, lr_scheduler=sched, max_grad_norm=1.0, asynchronous=True)
            elif op == "sync":
                model.step(opt, asynchronous=False, lr_scheduler=sched)
            elif op == "eval":
                model(x)
            elif op == "synchronize":
                model.synchronize()
            if save_at == i + 1:
                model.save_checkpoint(path, opt, sched)
        model.synchronize()
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("seed", range(6))
def test_a_checkpoint_anywhere_in_a_random_call_sequence_resumes_exactly(tmp_path, seed):
    """Gradient accumulation of varying length, asynchronous and synchronous steps, forward-only calls and
    synchronize in a random order, a checkpoint after a random operation: resumed and uninterrupted runs end
    bitwise equal (windows closed early, landed gradients awaiting their G-copy, pending steps)."""
    import random
    rnd = random.Random(seed)
    ops = [rnd.choice(["fb", "fb", "fb", "async", "async", "sync", "eval", "synchronize"]) for _ in range(16)] + \
        ["fb", "async"]
    save_at = rnd.randrange(1, len(ops) - 1)
    path = str(tmp_path / "c")
    never = _random_run(seed, ops)
    saved = _random_run(seed, ops, save_at=save_at, path=path)
    resumed = _random_run(seed, ops, load=save_at, path=path)
    assert all(torch.equal(a, b) for a, b in zip(saved, never)), (ops, save_at)
    assert all(torch.equal(a, b) for a, b in zip(resumed, never)), (ops, save_at)


def test_a_bad_path_is_a_type_error_naming_it():
    with small_model() as model:
        for bad in (None, "", 3):
            with pytest.raises(TypeError, match="save_checkpoint: path must be"):
                model.save_checkpoint(bad)
            with pytest.raises(TypeError, match="load_checkpoint: path must be"):
                model.load_checkpoint(bad)


class LoadsThenFails(torch.optim.AdamW):
    """An optimizer whose own load_state_dict assigns the state and then raises (a subclass's late check)."""

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        raise RuntimeError("late check failed")


def test_an_optimizer_whose_loader_fails_partway_is_put_back(tmp_path):
    """load_checkpoint with an optimizer whose load_state_dict fails after assigning: a ValueError naming the
    file, and the optimizer's state, step counts and lr are what they were (before: the checkpoint's, half
    loaded while the model kept its own masters)."""
    with small_model() as model:
        opt = rp.optim.AdamW(model.parameters(), lr=1e-2)
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        model.step(opt, asynchronous=False)
        model.save_checkpoint(tmp_path / "c", opt)
    with small_model() as model:
        opt = LoadsThenFails(model.parameters(), lr=5e-3)
        model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
        for _ in range(2):
            model.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=F.mse_loss)
            model.step(opt, asynchronous=False)
        before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        with pytest.raises(ValueError, match="optimizer.*late check failed|late check failed"):
            model.load_checkpoint(tmp_path / "c", opt)
        after = opt.state_dict()
        assert after["param_groups"][0]["lr"] == 5e-3
        assert after["state"].keys() == before.keys()
        for i, s in before.items():
            for k, v in s.items():
                assert torch.equal(after["state"][i][k], v), (i, k)
