"""Random orderings of the whole API over every model kind: the runner of the feature soak.

Three modules, by concept: the cases (tests/soak_case.py: models, draws, batches, optimizers), the check against
plain PyTorch with its allowances and twins (tests/soak_checker.py), and this runner (run_case, check_case, the
watchdog, the data-parallel launch), which names what the other two define for tools/soak.py and the tests.

A case is drawn from its seed alone (`draw_case(seed)`): a model kind, 1-3 workers, a default microbatch
count, an optimizer and a list of operations, printed whole on failure (`Case.describe`) so that
`python tools/soak.py --seed S --cases 1` replays it.  The operations (`OPS`):

    fb          forward_backward, with or without return_outputs, with or without a per-call num_microbatches
    composed    out = model(x) with grad enabled, loss_fn(out, y).backward() (the composed autograd call)
    eval        model(x) under torch.no_grad() or in eval(), per-call num_microbatches or not
    step        asynchronous or synchronous, with an lr scheduler, max_grad_norm 0.5 or none
    late_bwd    out = model(x); step; backward through out: a RuntimeError, the model usable after
    sync        synchronize()
    state_dict  state_dict()
    load_sd     load_state_dict(0.9 x state_dict())
    edit        an in-place edit of a master after synchronize()
    save        save_checkpoint(name, opt, sched)      load   load_checkpoint of a name saved before
    fail        a layer (or loss_fn) raises in a forward_backward or model(x): that error once, no effect.
                The Fail layer raises on a NaN input and the failing call's batch is all NaN: a global
                switch would also fail the call before it, whose last backward stages recompute the
                layer after it returned (the continuous pipeline; tests/engine/test_soak_regressions.py)
    plan        autoplan.request(a random valid plan): the next call switches plans; most hold a backward
                stage of several layers below the fused tail

A case also draws RoundPipe(recompute=): "stage" or, half the time, "layer" (a backward stage recomputes
and backpropagates one layer at a time; the default plans of these small models have one-layer backward
stages, so the plan operations' multi-layer ones are what it splits), and half the time a roomy device_memory
cap, under which backward stages on their forward stage's worker keep its graph instead of recomputing.

Model kinds (`KINDS`) and what each is checked against:

    fp32, adamw8bit, nvme, lora4, dp2   plain PyTorch through `StaleReference` (tests/stale_reference.py): every
        loss, output and gradient seen and the final masters within TOL (less what fp32 noise may move an
        element in Adam's eps region: tests/soak_checker.py).  Synchronous steps are plain PyTorch;
        asynchronous ones the documented window protocol.  adamw8bit: its reference steps the same
        rp.optim.AdamW8bit on plain parameters; nvme: every layer's optimizer state on disk; lora4: QuantLinear (NF4) bases frozen, LoRA adapters trained; dp2: 2 ranks, each
        its half of every batch, against one process on the whole batch.
    bf16, fp16, bf16master   exact equality to PyTorch is not defined in low precision: the engine against
        itself, the same case rerun in its canonical form (`canonical`): plan changes and saves removed,
        each load replaced by the operations that led to its save.  Saving changes nothing later calls
        compute, a load restores bitwise and results do not depend on the plan (docs/training_state.md, docs/semantics.md), so every loss and output of the
        kept operations and the final masters must be bitwise equal.  The rerun recomputes a stage at a time
        (the layer grain's results are the stage grain's, bit for bit), and its forward_backward calls without
        a count of their own split their batch as the first run's did: the model's first training call decides once
        whether they run as one microbatch per worker (docs/planner.md), and the rerun may lack that call
        (`run_case`'s split).

Every run: no hang (the caller's watchdog; the engine's own stall_timeout names a stalled stage first),
finite losses, an injected error raised once by its call and the model usable after.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err  # noqa: F401 - named here for the tests
from soak_case import (  # noqa: F401 - named here for tools/soak.py and the tests
    BATCH,
    CANONICAL_KINDS,
    KINDS,
    LR,
    WIDTH,
    Case,
    _keys,
    canonical,
    data,
    draw_case,
    make_layers,
    make_optimizer,
    make_scheduler,
    poisoned,
)
from soak_checker import TOL, Checker  # noqa: F401 - named here for the tests

import roundpipe as rp
from roundpipe.engine.calls.microbatch import split as split_batch

CASE_TIMEOUT_S = 150   # the watchdog; calls take ~10-50 ms here, a case's first call in a process up to ~10 s
STALL_S = 90           # the engine's stall_timeout: names the stalled stage before the watchdog fires
# A failed training call counts as a call of the stale window (failed_call); False: as if it never happened.
FAILED_CALL_USES_WINDOW = True


def run_with_watchdog(fn, timeout_s=CASE_TIMEOUT_S):
    """Runs fn on a thread; a hang fails the test with every thread's stack (the threads are left behind)."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e
    t = threading.Thread(target=target, name="sequence-case", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        names = {th.ident: th.name for th in threading.enumerate()}
        stacks = "\n".join(f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                           for ident, frame in sys._current_frames().items())
        pytest.fail(f"hang: no progress within {timeout_s} s\n{stacks}", pytrace=False)
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ---- running a case

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def engine_options(case: Case, tmp: str) -> dict:
    kw = dict(devices=["cpu"] * case.workers, num_microbatches=case.num_mb, stall_timeout=STALL_S,
              recompute=case.options.get("recompute", "stage"), resident_layers=case.options.get("resident_layers", 0),
              device_step=case.options.get("device_step", False), device_memory=case.options.get("device_memory"))
    for name in ("compute_dtype", "master_dtype"):
        if name in case.options:
            kw[name] = DTYPES[case.options[name]]
    if case.kind == "fp16":   # a small scale that grows every 2 good steps: growth and backoff both happen
        kw["precision"] = rp.Precision(kw.pop("compute_dtype"), loss_scale=rp.LossScale(init_scale=2.0 ** 8,
                                                                                         growth_interval=2))
    if case.kind == "nvme":
        kw["offload_dir"] = os.path.join(tmp, "state")   # no host_memory: every layer's state on disk
    return kw


def failed_call(ref, training: bool) -> None:
    """What a failed call leaves in the reference.  A forward-only call is a sync point whether it fails or
    not.  A failed training call changes no weight or gradient, but the engine counts it as begun: it uses up
    one call of an open stale window (the call that retries its batch reads the new weights) and counts
    toward the next step's window (roundpipe/engine/step/async_step.py, begin of a call)."""
    if not training:
        ref.flush()
    elif FAILED_CALL_USES_WINDOW:
        ref.window = max(0, ref.window - 1)
        ref.calls_since += 1


def failing_loss(out, y):
    raise RuntimeError("injected loss_fn failure")


def run_case(case: Case, tmp: str, *, kept: set | None = None, group=None, rank: int = 0, world: int = 1,
             split: dict | None = None) -> dict:
    """Runs `case` (only the operations with an index in `kept`, when given); returns what it recorded:
    {(op index, name): tensor} and the final masters under "final".

    split: how a forward_backward without a per-call count splits its batch, shared by a case's two runs.
    No num_microbatches: the model's first training call decides once whether such calls run as one
    microbatch per worker (docs/planner.md "No penalty when the model fits"; any call before it, one with a count of
    its own or a model(x), rules it out), and the canonical run, which drops the calls before a load, may
    have another first call.  An empty dict: the run records the decision in split["unsplit"]; one
    holding it: the run starts from that decision, as a model loading a checkpoint does."""
    layers = make_layers(case)
    b = BATCH // world
    rows = None if world == 1 else slice(rank * b, (rank + 1) * b)
    chk = Checker(case, layers, rows)
    ref = chk.ref
    where = case.describe()
    kw = engine_options(case, tmp)
    if group is not None:
        kw["process_group"] = group
    loss_fn = F.mse_loss
    default_count = case.num_mb is None   # the calls the rule of a microbatch per worker covers (split, above)
    with rp.RoundPipe(layers, **kw) as model:
        if split and default_count:   # the decision the first run's first training call made (as a load does)
            model.autoplan.restore_whole_decision((split["unsplit"], b))
        opt = make_optimizer(case.optimizer, model.parameters())
        sched = make_scheduler(opt)
        for i, op in enumerate(case.ops):
            if kept is not None and i not in kept:
                continue
            at = f"{where}\n  at op {i} {op}"
            x, y = data(case, i)
            lx, ly = chk.local(x), chk.local(y)
            name = op[0]
            if name == "fb":
                _, mb, outputs = op
                got = model.forward_backward(lx, labels=ly, loss_fn=loss_fn, return_outputs=outputs,
                                             num_microbatches=mb)
                loss, out = got if outputs else (got, None)
                chk.call_value(at, i, x, ly, loss, out, chk.forward_backward(x, y))
            elif name == "composed":
                out = model(lx, num_microbatches=op[1])
                assert out.requires_grad, at
                loss_fn(out, ly).backward()
                chk.forward_value(at, i, out.detach(), x, chk.composed(x, y)[1] if ref is not None else None, model)
            elif name == "eval":
                _, mb, how = op
                if how == "no_grad":
                    with torch.no_grad():
                        out = model(lx, num_microbatches=mb)
                else:
                    model.eval()
                    out = model(lx, num_microbatches=mb)
                    model.train()
                assert not out.requires_grad, at
                chk.forward_value(at, i, out, x, None if ref is None else chk.forward(x), model)
            elif name == "step":
                _, asynchronous, clip = op
                model.step(opt, asynchronous=asynchronous, lr_scheduler=sched, max_grad_norm=clip)
                if ref is not None:
                    chk.step(asynchronous, max_grad_norm=clip, follow=None if asynchronous else (at, model, opt))
            elif name == "late_bwd":
                out = model(lx)
                model.step(opt, asynchronous=op[1], lr_scheduler=sched)
                with pytest.raises(RuntimeError, match="after a step"):
                    loss_fn(out, ly).backward()
                if ref is not None:
                    chk.flush()
                    chk.step(op[1])
            elif name == "sync":
                model.synchronize()
                if ref is not None:
                    chk.flush()
                    chk.grads_value(at, model)
            elif name == "state_dict":
                sd = model.state_dict()
                if ref is not None:
                    chk.flush()
                    chk.masters_value(at, {k: sd[k].float() for k, v in ref.cur.state_dict().items() if v.is_floating_point()})
            elif name == "load_sd":
                trained = {n for n, p in model.named_parameters() if p.requires_grad}   # not a 4-bit base's buffers
                sd = {k: v * 0.9 if k in trained else v for k, v in model.state_dict().items()}
                model.load_state_dict(sd)
                if ref is not None:
                    chk.load_state_dict(sd)
            elif name == "edit":
                model.synchronize()
                j = op[1] + (op[1] >= case.fail_at)   # the op[1]-th trainable layer
                p = next(p for p in model.module[j].parameters() if p.requires_grad)
                with torch.no_grad():
                    p.mul_(0.5)
                if ref is not None:
                    chk.edit(j)
            elif name == "save":
                model.save_checkpoint(os.path.join(tmp, op[1]), opt, sched)
                if ref is not None:
                    chk.save(op[1])
            elif name == "load":
                model.load_checkpoint(os.path.join(tmp, op[1]), opt, sched)
                if ref is not None:
                    chk.load(op[1])
            elif name == "fail":
                what = op[1]
                if ref is not None:
                    for r in chk.refs:
                        failed_call(r, training=what != "eval")
                if what == "loss":
                    with pytest.raises(RuntimeError, match="injected loss_fn failure"):
                        model.forward_backward(lx, labels=ly, loss_fn=failing_loss)
                else:
                    with pytest.raises(RuntimeError, match=f"injected failure {case.fail_key}"):
                        if what == "fb":
                            model.forward_backward(poisoned(lx), labels=ly, loss_fn=loss_fn)
                        else:
                            with torch.no_grad():
                                model(poisoned(lx))
            elif name == "plan":
                _, per_stage, ratio, fused = op
                n = len(layers)
                model.autoplan.request(rp.Plan.uniform(n, backward_per_stage=per_stage, forward_ratio=ratio,
                                                       fused_layers=fused))
            else:
                raise ValueError(f"unknown operation {op!r}")
        model.synchronize()
        final = [p.detach().float().clone() for p in model.parameters()]
        if split is not None and not split:   # the first such call's decision (every batch has b rows);
            # without one, asking now decides it: False, a call came first
            split["unsplit"] = default_count and model.autoplan.whole_batch(
                b, lambda: split_batch((torch.zeros(b, WIDTH),), {}, None, case.workers, 1), None)
    if ref is not None:
        chk.flush()
        chk.masters_value(f"{where}\n  final masters", {n: p for (n, _), p in zip(ref.cur.named_parameters(), final)})
    return dict(chk.seen, final=final)


def check_case(case: Case) -> None:
    """One case and its check (the module docstring): against plain PyTorch, or its canonical rerun, which
    recomputes a stage at a time, keeps no resident weights and has no cap, so keeps no graphs (the layer
    grain's results are the stage grain's, and resident weights and kept graphs change no number: bit for
    bit)."""
    split: dict = {}
    with tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
        got = run_case(case, tmp, split=split)
    if case.kind not in CANONICAL_KINDS:
        return
    kept = canonical(case.ops)
    rerun = dataclasses.replace(case, fail_key=next(_keys), options={**case.options, "recompute": "stage",
                                                                     "resident_layers": 0, "device_memory": None})
    with tempfile.TemporaryDirectory(prefix="rp-soak-") as tmp:
        want = run_case(rerun, tmp, kept={i for i, _ in kept}, split=split)
    for key, w in want.items():
        g = got[key]
        same = all(torch.equal(a, b) for a, b in zip(g, w)) if key == "final" else torch.equal(g, w)
        assert same, (f"{case.describe()}\n  {key} differs from the canonical run (recompute 'stage', no resident weights, no cap, "
                      f"{'unsplit' if split['unsplit'] else 'split'} default-count calls, kept ops "
                      f"{[i for i, _ in kept]})")


# ---- 2 data-parallel ranks (gloo on loopback): `python tests/soak.py CONFIG_JSON` is one rank

NOT_RUN = "not run"   # run_dp_cases' result for a case no launch ran


def run_dp_cases(seeds: list[int], folder: str, timeout: float = 600, fail: tuple = ()) -> dict[int, str]:
    """Runs the dp2 cases of `seeds` on 2 ranks, in one launch (one process start-up for all of them) until a
    case fails: the ranks stop there (the other rank may be stuck in a collective), and the cases after it run
    in a new launch.  Returns {seed: "ok", what failed over both ranks, or NOT_RUN + why (a launch that ran
    none of its cases)}.  fail: seeds both ranks fail on purpose (a test of this function)."""
    import pathlib

    from ranks import launch  # tests/ranks.py
    out: dict[int, str] = {}
    pending = list(seeds)
    while pending:
        where = pathlib.Path(folder) / f"launch-{pending[0]}"
        where.mkdir(parents=True, exist_ok=True)
        try:
            results = launch(__file__, {"seeds": pending, "dir": str(where), "fail": list(fail)}, 2, where, timeout)
        except AssertionError as e:   # a rank wrote nothing: it crashed or hung before saving
            results, why = [], str(e).splitlines()[0]
        ran = [s for s in pending if any(s in res for res in results)]
        for seed in ran:
            out[seed] = "; ".join(f"rank {r}: {res.get(seed, 'no result (the other rank failed first)')}"
                                  for r, res in enumerate(results) if res.get(seed) != "ok") or "ok"
        if not ran:
            for seed in pending:
                out[seed] = f"{NOT_RUN}: {why if not results else 'the launch ran none of its cases'}"
            break
        pending = [s for s in pending if s not in ran]
    return {seed: out[seed] for seed in seeds}


def _rank_main() -> None:
    import datetime
    import json

    import torch.distributed as dist
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    try:
        for seed in cfg["seeds"]:
            case = draw_case(seed, "dp2")
            folder = os.path.join(cfg["dir"], f"case-{seed}")
            try:
                if seed in cfg.get("fail", ()):
                    raise AssertionError(f"seed {seed}: failed on purpose")
                run_with_watchdog(lambda: run_case(case, folder, group=dist.group.WORLD, rank=rank, world=world))
                out[seed] = "ok"
            except BaseException as e:  # noqa: BLE001 - reported to the parent; the other rank cannot go on
                out[seed] = f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))[-3000:]}"
                break
    finally:
        torch.save(out, cfg["out"] + f".{rank}")
    if all(v == "ok" for v in out.values()):
        dist.destroy_process_group()
    os._exit(0)   # a case's hung threads must not keep the rank alive


if __name__ == "__main__":   # run as a script, its folder (tests/) is first on sys.path
    _rank_main()
