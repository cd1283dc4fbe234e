"""The feature soak's cases (tests/soak.py): what a case is, how its seed draws it, and the models, batches and
optimizers both the engine and the reference run it with.

A case is drawn from its seed alone (`draw_case(seed)`): a model kind, 1-3 workers, a default microbatch count,
an optimizer, RoundPipe options and a list of operations (`OPS`, tests/soak.py's docstring), printed whole on
failure (`Case.describe`).  Every draw keeps the order of the draws before it, so that the seeds of earlier
soaks replay the cases they ran.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import torch
from torch import nn

import roundpipe as rp
from roundpipe.quant import QuantLinear

WIDTH, BATCH, LR = 8, 6, 2e-2
REFERENCE_KINDS = ("fp32", "adamw8bit", "nvme", "lora4")
CANONICAL_KINDS = ("bf16", "fp16", "bf16master")
KINDS = REFERENCE_KINDS + CANONICAL_KINDS   # single-process kinds; "dp2" runs through run_dp_cases
# Each operation's weight in a random draw; training calls and steps dominate, as in a training loop.
OPS = {"fb": 10, "composed": 2, "eval": 3, "step": 6, "late_bwd": 1, "sync": 1, "state_dict": 1, "load_sd": 1,
       "edit": 1, "save": 1, "load": 1, "fail": 2, "plan": 1}
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


def make_layers(case: Case) -> list[nn.Module]:
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


# ---- batches and optimizers

def data(case: Case, i: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Operation i's batch (inputs, labels), from the case's seed and i alone."""
    g = torch.Generator().manual_seed(case.seed * 1000 + i)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)


def make_optimizer(name: str, params):
    """The case's optimizer (Case.optimizer) over the trained parameters; the reference steps "torch" for "rp"
    (roundpipe.optim's AdamW is torch's bit for bit)."""
    params = [p for p in params if p.requires_grad]
    if name == "rp":
        return rp.optim.AdamW(params, lr=LR, weight_decay=0.05)
    if name == "8bit":   # 8-bit states from 16 elements: the 8x8 weights take the 8-bit path, the biases fp32
        return rp.optim.AdamW8bit(params, lr=LR, weight_decay=0.05, min_8bit_size=16)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.05)


def make_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
