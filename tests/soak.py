"""Random orderings of the whole API over every model kind: cases, a runner, its references (the feature soak).

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
        element in Adam's eps region: GRAD_NOISE).  Synchronous steps are plain PyTorch;
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

import copy
import dataclasses
import itertools
import os
import random
import sys
import tempfile
import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
from rp_models import max_rel_err
from stale_reference import StaleReference
from torch import nn

import roundpipe as rp
from roundpipe.engine.calls.microbatch import split as split_batch
from roundpipe.quant import QuantLinear

WIDTH, BATCH, LR = 8, 6, 2e-2
# fp32: microbatch sums in another order than the whole-batch reference, amplified by AdamW's normalisation
# over up to ~15 steps (test_call_sequences.py saw 2.3e-5 in 2,800 cases); reading the wrong weights
# version is off by about one update, lr = 2e-2 relative, 200x this.
TOL = 1e-4
# Adam's eps region (seed 921491; tests/engine/test_soak_adam_eps_region.py).  A gradient element that cancels
# to near zero (there: -3.46e-8 in fp64, the tensor's largest 2.8e-2) is fixed by fp32 only to about 1e-7 of the
# tensor's largest gradient: plain PyTorch itself gives -3.59e-8 whole-batch and -4.20e-8 with 1-row microbatches.
# Adam's update m/(sqrt(v) + eps) normalises that noise by sqrt(v) ~ |g| ~ 3 eps: the first step moved the
# element by 0.76 lr (engine) or 0.75 lr (reference), and 0.a.weight differed by 5.6e-4 relative (plain
# PyTorch, 1-row microbatches against whole-batch: 1.7e-3).  So each reference step of a torch-AdamW reference
# adds to every element's allowance the most a gradient off by delta = GRAD_NOISE * (its tensor's largest |g|)
# can move it, to first order:
#     lr * delta * (1 + |u|) / (sqrt(v_hat) + eps),   u = m_hat / (sqrt(v_hat) + eps)  (after the step)
# (d m_hat <= delta, d sqrt(v_hat) <= delta).  GRAD_NOISE is 4x the largest fp32 spread seen (2.6e-7).  Seeds 0-5
# (fp32, lora4): the median element's allowance is 0.3-5% of TOL * max|w|, a few per case get 0.1-5x, 921491's 700x
# (its first update is undetermined within ~lr); reading the wrong weights version is off by ~lr on every element
# and still fails.  Only the masters compare so; losses, outputs and gradients keep TOL.
GRAD_NOISE = 1e-6
CASE_TIMEOUT_S = 150   # the watchdog; calls take ~10-50 ms here, a case's first call in a process up to ~10 s
STALL_S = 90           # the engine's stall_timeout: names the stalled stage before the watchdog fires

REFERENCE_KINDS = ("fp32", "adamw8bit", "nvme", "lora4")
CANONICAL_KINDS = ("bf16", "fp16", "bf16master")
KINDS = REFERENCE_KINDS + CANONICAL_KINDS   # single-process kinds; "dp2" runs through run_dp_cases
# Each operation's weight in a random draw; training calls and steps dominate, as in a training loop.
OPS = {"fb": 10, "composed": 2, "eval": 3, "step": 6, "late_bwd": 1, "sync": 1, "state_dict": 1, "load_sd": 1,
       "edit": 1, "save": 1, "load": 1, "fail": 2, "plan": 1}
# A failed training call counts as a call of the stale window (failed_call); False: as if it never happened.
FAILED_CALL_USES_WINDOW = True
DP_OPS = {k: v for k, v in OPS.items() if k not in ("fail", "edit")}   # a failing rank ends the job (docs)
# How often a case's backward stages recompute a layer at a time instead of a stage (RoundPipe(recompute=),
# docs/semantics.md "Layer-grain recompute"): the plan operations' fixed plans with multi-layer backward
# stages give it something to split.  CI's seeds 0-4 draw it for 0, 1 and 4 (0 and 1 change plans).
LAYER_GRAIN = 0.5
# How often a case keeps the weights of its first 1..layers layers on every worker (RoundPipe(resident_layers=),
# roundpipe/engine/calls/resident.py): edits, loads, failed calls and asynchronous windows must all see the
# weights the host holds.  The canonical rerun keeps none, so the two are checked bit for bit.
RESIDENT = 0.5
# How often a case that can (fp32 or lora4, one worker, roundpipe.optim's AdamW) steps its resident layers on the
# worker (RoundPipe(device_step=True), roundpipe/engine/step/device_step.py); its steps are then synchronous.
# Checked against plain PyTorch like any fp32 case: the device update is the optimizer's formula in torch ops.
DEVICE_STEP = 0.5
# How often a case runs under a roomy device_memory cap (1 GiB, never reached): its backward stages on their forward
# stage's worker then keep the forward's graph instead of recomputing (docs/planner.md, "Kept graphs").  The
# canonical rerun has no cap, so it recomputes every one: bit for bit the same.
KEPT_GRAPHS = 0.5


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


# ---- models

_keys = itertools.count()


class Fail(nn.Module):
    """The identity, or a RuntimeError on an input holding a NaN (the failing calls' batches, `poisoned`).

    The input marks the failing call, not a switch the caller turns on around it: the call before
    may still be running its last backward stages, whose recompute of this layer must not fail."""

    def __init__(self, key: int):
        super().__init__()
        self.key = key

    def forward(self, x):
        if torch.isnan(x).any():
            raise RuntimeError(f"injected failure {self.key}")
        return x


def poisoned(x: torch.Tensor) -> torch.Tensor:
    """A failing call's batch: all NaN, which stays NaN through the layers up to Fail."""
    return torch.full_like(x, float("nan"))


class LoraLayer(nn.Module):
    """tanh(base(x) + B(A(x))): a frozen NF4 QuantLinear base and a trainable rank-2 adapter."""

    def __init__(self, width: int = WIDTH, rank: int = 2):
        super().__init__()
        self.base = QuantLinear.from_linear(nn.Linear(width, width).requires_grad_(False), "nf4")
        self.a, self.b = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


def make_layers(case: "Case") -> list[nn.Module]:
    torch.manual_seed(case.seed)
    if case.kind == "lora4":
        layers = [LoraLayer() for _ in range(case.layers)]
    else:
        layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(case.layers)]
    layers.insert(case.fail_at, Fail(case.fail_key))
    return layers


# ---- cases

@dataclasses.dataclass
class Case:
    seed: int
    kind: str
    workers: int
    layers: int            # trainable layers; the Fail layer comes on top
    fail_at: int
    num_mb: int | None
    optimizer: str         # "rp" (rp AdamW), "torch" (torch AdamW), "8bit" (rp AdamW8bit)
    options: dict          # more RoundPipe keywords of the kind (kept printable)
    ops: list
    fail_key: int = dataclasses.field(default_factory=lambda: next(_keys))

    def describe(self) -> str:
        return (f"seed {self.seed}: kind {self.kind}, {self.workers} workers, {self.layers} layers (Fail at "
                f"{self.fail_at}), num_microbatches {self.num_mb}, optimizer {self.optimizer}, options "
                f"{self.options}, ops {self.ops}")


def random_plan(rng: random.Random, n: int) -> tuple:
    """("plan", backward_per_stage b, forward_ratio, fused_layers) for n layers.  The fused tail leaves a
    backward stage of min(b, n - 1) layers below it, one to split at recompute="layer" whenever b >= 2; the
    draws are those of the plans before that rule, the tail's size folded into its range."""
    b, ratio, fused = rng.randint(1, n), rng.randint(1, 3), rng.randint(1, n)
    return ("plan", b, ratio, 1 + (fused - 1) % max(1, n - b))


def draw_ops(rng: random.Random, n_layers: int, weights: dict, count: int) -> list:
    names, w = list(weights), list(weights.values())
    ops, saved = [], []
    mb = lambda: rng.choice([None, None, 1, 2, 3, 5])
    for _ in range(count):
        op = rng.choices(names, w)[0]
        if op == "fb":
            ops.append(("fb", mb(), rng.random() < 0.4))
        elif op in ("composed", "late_bwd"):
            ops.append((op, mb()) if op == "composed" else (op, rng.random() < 0.5))
        elif op == "eval":
            ops.append(("eval", mb(), rng.choice(["no_grad", "eval_mode"])))
        elif op == "step":
            ops.append(("step", rng.random() < 0.7, rng.choice([None, 0.5])))
        elif op == "edit":
            ops.append(("edit", rng.randrange(n_layers)))
        elif op == "save":
            saved.append(f"c{len(saved)}")
            ops.append(("save", saved[-1]))
        elif op == "load":
            if saved:
                ops.append(("load", rng.choice(saved)))
        elif op == "fail":
            ops.append(("fail", rng.choice(["fb", "fb", "eval", "loss"])))
        elif op == "plan":
            ops.append(random_plan(rng, n_layers + 1))
        else:
            ops.append((op,))
    return ops + [("step", True, None), ("fb", None, False)]


def draw_case(seed: int, kind: str | None = None, n_ops: tuple[int, int] = (10, 24)) -> Case:
    rng = random.Random(seed)
    kind = kind or rng.choice(KINDS)
    workers = rng.choice([1, 2, 3])
    layers = rng.choice([2, 3, 4])
    optimizer = {"adamw8bit": "8bit", "nvme": rng.choice(["rp", "8bit"]),
                 "bf16master": rng.choice(["rp", "8bit", "torch"])}.get(kind, rng.choice(["rp", "torch"]))
    options = {"bf16": {"compute_dtype": "bfloat16"}, "fp16": {"compute_dtype": "float16"},
               "bf16master": {"compute_dtype": rng.choice(["bfloat16", "float32"]), "master_dtype": "bfloat16"}}.get(kind, {})
    weights = DP_OPS if kind == "dp2" else OPS
    ops = draw_ops(rng, layers, weights, rng.randint(*n_ops))
    fail_at, num_mb = rng.randint(0, layers), rng.choice([None, workers + 2])
    # drawn last, so that the draws above are those of the seeds before recompute="layer" existed
    options["recompute"] = "layer" if rng.random() < LAYER_GRAIN else "stage"
    options["resident_layers"] = rng.randint(1, layers) if rng.random() < RESIDENT else 0   # drawn after it, too
    if kind in ("fp32", "lora4") and workers == 1 and optimizer == "rp" and rng.random() < DEVICE_STEP:
        options["device_step"] = True
        options["resident_layers"] = rng.randint(1, layers + 1)   # the head too, at times
        ops = [(op[0], False, *op[2:]) if op[0] in ("step", "late_bwd") else op for op in ops]   # synchronous only
    options["device_memory"] = (1 << 30) if rng.random() < KEPT_GRAPHS else None   # drawn last
    return Case(seed, kind, workers, layers, fail_at, num_mb, optimizer, options, ops)


def canonical(ops: list) -> list[tuple[int, tuple]]:
    """The operations whose effects the final state holds, with their indices: no plan changes or saves,
    each load replaced by what led to its save.  Failed calls stay: they count in the step windows
    (failed_call)."""
    kept, snapshots = [], {}
    for i, op in enumerate(ops):
        if op[0] == "save":
            snapshots[op[1]] = list(kept)
        elif op[0] == "load":
            kept = list(snapshots[op[1]])
        elif op[0] != "plan":
            kept.append((i, op))
    return kept


# ---- running a case

def data(case: Case, i: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 1000 + i)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)


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


def make_optimizer(name: str, params):
    params = [p for p in params if p.requires_grad]
    if name == "rp":
        return rp.optim.AdamW(params, lr=LR, weight_decay=0.05)
    if name == "8bit":   # 8-bit states from 16 elements: the 8x8 weights take the 8-bit path, the biases fp32
        return rp.optim.AdamW8bit(params, lr=LR, weight_decay=0.05, min_8bit_size=16)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.05)


def make_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def snapshot(ref: StaleReference) -> dict:
    """The reference's training state, through state dicts (a deep copy of an rp.optim optimizer cannot
    step: torch's Optimizer.__getstate__ keeps only defaults, state and param_groups)."""
    return copy.deepcopy({"cur": ref.cur.state_dict(), "grads": [p.grad for p in ref.cur.parameters()],
                          "opt": ref.opt.state_dict(), "sched": ref.sched.state_dict(), "prev": ref.prev,
                          "window": ref.window, "calls_since": ref.calls_since, "calls": ref.calls})


def restore(ref: StaleReference, snap: dict) -> None:
    snap = copy.deepcopy(snap)
    ref.cur.load_state_dict(snap["cur"])
    for p, g in zip(ref.cur.parameters(), snap["grads"]):
        p.grad = g
    ref.opt.load_state_dict(snap["opt"])
    ref.sched.load_state_dict(snap["sched"])
    ref.prev, ref.window, ref.calls_since, ref.calls = snap["prev"], snap["window"], snap["calls_since"], snap["calls"]


def failed_call(ref: StaleReference, training: bool) -> None:
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


class Checker:
    """Compares what the engine returned with the reference (fp32 kinds) or records it (the others)."""

    def __init__(self, case: Case, layers, rows: slice | None):
        self.case, self.rows, self.seen = case, rows, {}
        self.ref = None
        if case.kind in REFERENCE_KINDS + ("dp2",):
            opt = self.opt_name = "8bit" if case.optimizer == "8bit" else "torch"   # rp AdamW is torch's bit for bit
            self.ref = StaleReference(nn.Sequential(*copy.deepcopy(layers)), lambda ps: make_optimizer(opt, ps),
                                      make_scheduler)
        self.snapshots = {}
        # reference parameter name -> per element, how far fp32 noise may have moved its master (GRAD_NOISE)
        self.allow = {} if self.ref is None else {n: torch.zeros_like(p) for n, p in self.ref.cur.named_parameters()}

    def step(self, asynchronous: bool, max_grad_norm: float | None = None) -> None:
        """The reference's step; it adds to each master's allowance what GRAD_NOISE may move it by (`_shadow`)."""
        ref = self.ref
        params = dict(ref.cur.named_parameters())
        delta = {n: GRAD_NOISE * p.grad.abs().max() for n, p in params.items() if p.grad is not None}
        group = ref.opt.param_groups[0]
        lr = group["lr"]   # this step's: the scheduler steps after the update
        shadows = self._shadow(delta, max_grad_norm)
        ref.step(asynchronous, max_grad_norm=max_grad_norm)
        moved = self._shadows_moved(shadows)
        if not isinstance(ref.opt, torch.optim.AdamW):   # AdamW8bit: the shadows alone
            for n, m in moved.items():
                self.allow[n] += m
            return
        (b1, b2), eps = group["betas"], group["eps"]
        for n, d in delta.items():
            st = ref.opt.state[params[n]]
            t = float(st["step"])
            root = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt()
            u = st["exp_avg"] / (1 - b1 ** t) / (root + eps)
            first_order = lr * d * (1 + u.abs()) / (root + eps)
            self.allow[n] += torch.maximum(first_order, moved[n]) if n in moved else first_order

    def _ref_steps(self) -> list[float]:
        """The reference optimizer's step counts: the shadows' moments are the reference's while these match."""
        return [float(st["step"]) for st in self.ref.opt.state.values() if "step" in st]

    def _shadow(self, delta: dict, max_grad_norm: float | None) -> list:
        """Before a reference step: the same step by two shadow optimizers from the reference's
        weights, every gradient element moved by delta away from zero or towards it (the fp32 noise a
        microbatched sum may carry, GRAD_NOISE).  Their 8-bit moments persist across steps (made again from
        the reference's when those were replaced, e.g. by a loaded checkpoint): a moment code the noise
        flipped stays flipped and moves every later update, as it does in the engine (seed 731049: one
        second-moment code, 234 against the reference's 233, from gradients 3e-7 apart, then 5.7e-5 on a
        weight two steps later).  With torch's AdamW they bound, beside the first-order term, what its
        linearisation misses: a gradient element that cancels to within the noise of zero (Adam's eps region)
        over several steps (seed 730039: 6.2e-3 raw, 1.4e-4 past the first-order allowance)."""
        named = [(n, p) for n, p in self.ref.cur.named_parameters() if p.requires_grad]   # make_optimizer's order
        steps = self._ref_steps()
        shadows = getattr(self, "_shadows", None)
        if shadows is None or shadows[0][2] != steps:
            shadows = []
            for _ in range(2):
                params = [nn.Parameter(p.detach().clone()) for _, p in named]
                opt = make_optimizer(self.opt_name, params)
                opt.load_state_dict(copy.deepcopy(self.ref.opt.state_dict()))
                shadows.append([params, opt, steps])
        for (params, opt, _), sign in zip(shadows, (1.0, -1.0)):
            opt.param_groups[0]["lr"] = self.ref.opt.param_groups[0]["lr"]   # the scheduler's, this step
            with torch.no_grad():
                for q, (n, p) in zip(params, named):
                    q.copy_(p)
                    q.grad = None if p.grad is None else p.grad + sign * delta[n] * p.grad.sign()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([q for q in params if q.grad is not None], max_grad_norm)
            opt.step()
        self._shadows = shadows
        return [(n, [ps[i] for ps, _, _ in shadows]) for i, (n, p) in enumerate(named) if p.grad is not None]

    def _shadows_moved(self, shadows: list) -> dict:
        """After it: per parameter, how far the shadows' updates moved from the reference's, elementwise."""
        params = dict(self.ref.cur.named_parameters())
        moved = {n: torch.stack([(q.detach() - params[n].detach()).abs() for q in copies]).amax(0)
                 for n, copies in shadows}
        steps = self._ref_steps()
        for shadow in self._shadows:
            shadow[2] = steps
        return moved

    def follow(self, at, model, opt) -> None:
        """After a synchronous step: where an element's allowance passed 1% of TOL (its update was undetermined
        within fp32 noise: Adam's eps region, a flipped 8-bit code), the engine's choice, checked to be within
        the allowance, becomes the reference's (master and fp32 moments), and the allowance there is spent.  A
        first update that noise decides moves every later gradient, beyond what any per-element allowance
        bounds (seed 730039: a 1.0.weight element whose first step went the other way, 6.5e-3 of the tensor's
        largest weight; two steps later 2.0.weight was 1.4e-4 off).  8-bit or offloaded moments cannot be
        copied an element at a time, and a device step's live on the worker: there nothing is followed."""
        ref_params = dict(self.ref.cur.named_parameters())
        opened = {n: self.allow[n] > 0.01 * TOL * q.detach().abs().max() for n, q in ref_params.items() if n in self.allow}
        if not any(o.any() for o in opened.values()) or model.device_step is not None or model.offload is not None:
            return
        for (n, p), q in zip(model.named_parameters(), ref_params.values()):
            if n not in opened:
                continue
            open_ = opened[n]
            mine, theirs = opt.state.get(p, {}), self.ref.opt.state.get(q, {})
            keys = [k for k in ("exp_avg", "exp_avg_sq") if isinstance(mine.get(k), torch.Tensor)
                    and isinstance(theirs.get(k), torch.Tensor) and mine[k].shape == q.shape]
            if not open_.any() or len(keys) != 2:
                continue
            assert self.master_err(n, p.detach().float(), q.detach()) <= TOL, (at, n, "masters")
            with torch.no_grad():
                q[open_] = p.detach().float()[open_]
                for k in keys:
                    theirs[k][open_] = mine[k].float()[open_]
            self.allow[n][open_] = 0.0
            self._shadows = None   # made again from the reference's moments at the next step

    def master_err(self, name: str, got: torch.Tensor, want: torch.Tensor) -> float:
        """max_rel_err of a master, each element's allowance taken off its difference first."""
        excess = ((got - want).abs() - self.allow.get(name, 0.0)).clamp_min(0)
        return (excess.max() / want.abs().max().clamp_min(1e-12)).item()

    def forward_value(self, at, i, got, x, want, model) -> None:
        """The outputs of a forward that closed every step's window (a composed or forward-only call).  Where
        an 8-bit moment code may have flipped (some master's allowance past 1% of TOL), a weight may be off by
        its allowance and the outputs with it (seed 732450: 2.5e-4 with a 7.9 TOL allowance on one element):
        then the engine's masters must be within their allowance of the reference's, and its outputs the
        reference's function of those masters."""
        if self.ref is None or max_rel_err(got, self.local(want)) <= TOL or not any(
                (a / (TOL * p.detach().abs().max().clamp_min(1e-12))).max() > 0.01
                for a, p in zip(self.allow.values(), self.ref.cur.parameters())):
            self.value(at, i, "outputs", got, None if self.ref is None else self.local(want))
            return
        masters = model.state_dict()   # no sync point added: the call closed the window already
        for n, q in self.ref.cur.named_parameters():
            assert self.master_err(n, masters[n].float(), q.detach()) <= TOL, (at, n, "masters")
        at_masters = copy.deepcopy(self.ref.cur)
        at_masters.load_state_dict({k: v.float() for k, v in masters.items()})
        with torch.no_grad():
            self.value(at, i, "outputs at the engine's masters", got, self.local(at_masters(x)))

    def grad_value(self, at, name, got, want) -> None:
        """A gradient summed since the last step.  Where an 8-bit moment code may have flipped (a master's
        allowance past 1% of TOL), the weights the calls read may be off by their allowance and every gradient
        they reach with them (seed 1312282: 2.0.weight's allowance 3 TOL, 1.0.weight's gradient 1.3e-4 off):
        then each element's difference may exceed TOL by what moving one open weight by its allowance, either
        way, moves it, summed over the open weights and the calls (first order: a weight's own effect)."""
        err = max_rel_err(got, want)
        if err <= TOL:
            return
        bound = self._grad_moves().get(name)
        assert bound is not None, (at, name, err)
        excess = ((got.float() - want).abs() - bound).clamp_min(0)
        assert (excess.max() / want.abs().max().clamp_min(1e-12)).item() <= TOL, (at, name, err, "past the allowance")

    def _grad_moves(self, most: int = 256) -> dict:
        """Per trained parameter, the elementwise sum over open weights (allowance past 1% of TOL; at most
        `most`) and over the reference's calls since its last step of the largest change of its gradient when
        that weight moves by its allowance one way or the other."""
        ref = self.ref
        params = dict(ref.cur.named_parameters())
        opened = []   # (parameter, flat index, allowance)
        for n, allow in self.allow.items():
            flat = allow.flatten()
            for k in torch.nonzero(flat > 0.01 * TOL * params[n].detach().abs().max()).flatten().tolist():
                opened.append((n, k, flat[k].item()))
        assert len(opened) <= most, f"{len(opened)} open weights: past what the gradient check bounds"
        trained = [n for n, p in params.items() if p.requires_grad]
        probe = copy.deepcopy(ref.cur)
        moves = {n: torch.zeros_like(params[n]) for n in trained}

        def grads(x, y, weights) -> list:
            probe.load_state_dict(weights)
            loss = ref.loss_fn(probe(x), y)
            return torch.autograd.grad(loss, [dict(probe.named_parameters())[n] for n in trained], allow_unused=True)

        for x, y, weights in ref.calls:
            base = grads(x, y, weights)
            for n, i, a in opened:
                worst = None
                for sign in (1.0, -1.0):
                    moved = {k: v.clone() for k, v in weights.items()}
                    moved[n].view(-1)[i] += sign * a
                    diff = [None if g is None else (g - b).abs() for g, b in zip(grads(x, y, moved), base)]
                    worst = diff if worst is None else [d if w is None else torch.maximum(w, d)
                                                       for w, d in zip(worst, diff)]
                for k, d in zip(trained, worst):
                    if d is not None:
                        moves[k] += d
        return moves

    def local(self, t):
        return t if self.rows is None else t[self.rows]

    def value(self, at, i, name, got, want=None):
        assert torch.isfinite(got).all(), (at, name, got)
        if self.ref is None:
            self.seen[(i, name)] = got.detach().clone()
        else:
            assert max_rel_err(got, want) <= TOL, (at, name, max_rel_err(got, want))


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
                want = ref.forward_backward(x, y, return_outputs=True) if ref is not None else (None, None)
                if want[1] is not None and rows is not None:   # each rank's loss is over its own rows
                    want = (loss_fn(chk.local(want[1]), ly), want[1])
                chk.value(at, i, "loss", loss, want[0])
                if out is not None:
                    chk.value(at, i, "outputs", out, None if ref is None else chk.local(want[1]))
            elif name == "composed":
                out = model(lx, num_microbatches=op[1])
                assert out.requires_grad, at
                loss_fn(out, ly).backward()
                chk.forward_value(at, i, out.detach(), x, ref.composed(x, y)[1] if ref is not None else None, model)
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
                chk.forward_value(at, i, out, x, None if ref is None else ref(x), model)
            elif name == "step":
                _, asynchronous, clip = op
                model.step(opt, asynchronous=asynchronous, lr_scheduler=sched, max_grad_norm=clip)
                if ref is not None:
                    chk.step(asynchronous, max_grad_norm=clip)
                    if not asynchronous:
                        chk.follow(at, model, opt)
            elif name == "late_bwd":
                out = model(lx)
                model.step(opt, asynchronous=op[1], lr_scheduler=sched)
                with pytest.raises(RuntimeError, match="after a step"):
                    loss_fn(out, ly).backward()
                if ref is not None:
                    ref.flush()
                    chk.step(op[1])
            elif name == "sync":
                model.synchronize()
                if ref is not None:
                    ref.flush()
                    for (n, p), q in zip(model.named_parameters(), ref.cur.parameters()):
                        assert (p.grad is None) == (q.grad is None), (at, n)
                        if p.grad is not None:
                            chk.grad_value(at, n, p.grad, q.grad)
            elif name == "state_dict":
                sd = model.state_dict()
                if ref is not None:
                    ref.flush()
                    for k, v in ref.cur.state_dict().items():
                        if v.is_floating_point():
                            assert chk.master_err(k, sd[k].float(), v) <= TOL, (at, k, chk.master_err(k, sd[k].float(), v))
            elif name == "load_sd":
                trained = {n for n, p in model.named_parameters() if p.requires_grad}   # not a 4-bit base's buffers
                sd = {k: v * 0.9 if k in trained else v for k, v in model.state_dict().items()}
                model.load_state_dict(sd)
                if ref is not None:
                    ref.flush()
                    ref.cur.load_state_dict(sd)
            elif name == "edit":
                model.synchronize()
                j = op[1] + (op[1] >= case.fail_at)   # the op[1]-th trainable layer
                p = next(p for p in model.module[j].parameters() if p.requires_grad)
                with torch.no_grad():
                    p.mul_(0.5)
                if ref is not None:
                    ref.flush()
                    with torch.no_grad():
                        next(q for q in ref.cur[j].parameters() if q.requires_grad).mul_(0.5)
            elif name == "save":
                model.save_checkpoint(os.path.join(tmp, op[1]), opt, sched)
                if ref is not None:
                    chk.snapshots[op[1]] = dict(snapshot(ref), allow=copy.deepcopy(chk.allow))
            elif name == "load":
                model.load_checkpoint(os.path.join(tmp, op[1]), opt, sched)
                if ref is not None:
                    restore(ref, chk.snapshots[op[1]])
                    chk.allow = copy.deepcopy(chk.snapshots[op[1]]["allow"])
            elif name == "fail":
                what = op[1]
                if ref is not None:
                    failed_call(ref, training=what != "eval")
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
        ref.flush()
        for k, (p, (n, q)) in enumerate(zip(final, ref.cur.named_parameters())):
            err = chk.master_err(n, p, q.detach())
            assert err <= TOL, (f"{where}\n  final master {k} ({n})", err)
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
