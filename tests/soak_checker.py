"""The feature soak's check of the reference kinds (tests/soak.py): plain PyTorch beside the engine
(`StaleReference`, tests/stale_reference.py) and what fp32 noise lets the two differ by.

Every loss, output, gradient and master must be within TOL of the reference's (relative to its tensor's
largest element, `max_rel_err`), except where Adam's eps region makes fp32 noise decide an update.  The
`Checker` tracks those places, from the reference's side alone:

    allowance   per master element, what noise may have moved it by (`step`, GRAD_NOISE): the masters
                compare less it (`master_err`)
    follow      after a synchronous step, the engine's choice where the allowance opened becomes the
                reference's, masters and moments (`follow`), where they can be read
    twins       where a step left an update undetermined past TOL and nothing followed it, a copy of the
                reference with that master moved runs every later operation: the engine's values may be
                off along the twins' differences from the reference (`Twin`, `_along_twins`)
    open weights  a call's gradients and outputs may be off by what moving an open weight within its
                allowance moves them (`grad_value`, `call_value`)

Every reference operation goes through the Checker, which applies it to the reference and its twins alike.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from rp_models import max_rel_err
from soak_case import REFERENCE_KINDS, Case, make_optimizer, make_scheduler
from stale_reference import StaleReference
from torch import nn

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
# and still fails.
GRAD_NOISE = 1e-6
# Twins (seed 1380402: nvme, asynchronous steps, so nothing followed).  One 3.0.weight element's first update was
# undetermined (gradient -5.2e-9, 3e-7 of its tensor's largest; allowance 868 TOL); the engine's went 4.4e-4 off the
# reference's, every later gradient through that weight moved with it, and two steps later 4.0.weight was 1.9 TOL off
# outside any allowance.  Allowances cannot carry that: moving the element by its whole allowance in every later
# gradient opened 288 weights at up to 300 TOL after one step.  A twin moved by TWIN_STEP of the element's allowance
# gives the direction instead: 4.0.weight fitted along it to 0.002 TOL, at 4.37e-4 (the engine's own), while masters
# or outputs 0.1% off stay ~10 TOL past.  Seeds 1420000-1420199 (the four reference kinds): 69 twins in 51 cases.
TWIN_AT = 1.0      # a step adding more than this many TOL (of the tensor's largest master) to an element's allowance
TWIN_STEP = 0.05   # a twin's master moved by this fraction of the element's allowance; its reach, 20 such, is all of it
MAX_TWINS = 8      # well below the 64-300 masters or gradients each fit runs over


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


@dataclasses.dataclass
class Twin:
    """A copy of the reference whose master name[index] a step left undetermined, moved by `moved` right after
    that step; it runs every later operation.  Its values less the reference's are what the engine's would be
    off by, to first order, per `moved` of the engine's deviation there, which its allowance bounds: a fit may
    take at most `reach` of them."""
    ref: StaleReference | None
    name: str
    index: int
    moved: float
    reach: float
    call: tuple | None = None   # its (loss, outputs) of the latest forward_backward


class Checker:
    """Compares what the engine returned with the reference (fp32 kinds) or records it (the others)."""

    def __init__(self, case: Case, layers, rows: slice | None):
        self.case, self.rows, self.seen = case, rows, {}
        self.ref = None
        if case.kind in REFERENCE_KINDS + ("dp2",):
            self.opt_name = "8bit" if case.optimizer == "8bit" else "torch"   # rp AdamW is torch's bit for bit
            self.ref = StaleReference(nn.Sequential(*copy.deepcopy(layers)), self._make_optimizer, make_scheduler)
        self.snapshots = {}
        # reference parameter name -> per element, how far fp32 noise may have moved its master (GRAD_NOISE)
        self.allow = {} if self.ref is None else {n: torch.zeros_like(p) for n, p in self.ref.cur.named_parameters()}
        self.twins: list[Twin] = []

    def _make_optimizer(self, params):
        return make_optimizer(self.opt_name, params)

    # ---- the reference's operations, applied to it and its twins alike

    @property
    def refs(self) -> list[StaleReference]:
        return [self.ref] + [t.ref for t in self.twins]

    def forward_backward(self, x, y) -> tuple | None:
        """A training call on the whole batch: the reference's (loss, outputs); None without a reference."""
        if self.ref is None:
            return None
        for t in self.twins:
            t.call = t.ref.forward_backward(x, y, return_outputs=True)
        return self.ref.forward_backward(x, y, return_outputs=True)

    def composed(self, x, y) -> tuple:
        for t in self.twins:
            t.ref.composed(x, y)
        return self.ref.composed(x, y)

    def forward(self, x) -> torch.Tensor:
        """A forward-only call (a sync point): the reference's outputs."""
        self.flush()
        return self.ref(x)

    def flush(self) -> None:
        for r in self.refs:
            r.flush()

    def load_state_dict(self, sd: dict) -> None:
        for r in self.refs:
            r.flush()
            r.cur.load_state_dict(sd)

    def edit(self, layer: int) -> None:
        """Halves the first trained parameter of `layer` (after a sync point, as the engine's edit)."""
        for r in self.refs:
            r.flush()
            with torch.no_grad():
                next(q for q in r.cur[layer].parameters() if q.requires_grad).mul_(0.5)

    def save(self, name: str) -> None:
        self.snapshots[name] = {"ref": snapshot(self.ref), "allow": copy.deepcopy(self.allow),
                                "twins": [(dataclasses.replace(t, ref=None, call=None), snapshot(t.ref)) for t in self.twins]}

    def load(self, name: str) -> None:
        saved = self.snapshots[name]
        restore(self.ref, saved["ref"])
        self.allow = copy.deepcopy(saved["allow"])
        self.twins = [dataclasses.replace(t, ref=self._copy(snap)) for t, snap in saved["twins"]]

    def _copy(self, snap: dict) -> StaleReference:
        ref = StaleReference(copy.deepcopy(self.ref.cur), self._make_optimizer, make_scheduler)
        restore(ref, snap)
        return ref

    # ---- steps and allowances

    def step(self, asynchronous: bool, max_grad_norm: float | None = None, follow: tuple | None = None) -> None:
        """The reference's step and its twins'; it adds to each master's allowance what GRAD_NOISE may move it by
        (`_allow_step`).  follow: (at, model, optimizer) of a synchronous step, whose undetermined updates the
        reference takes from the engine (`follow`).  Those left get twins (`_spawn_twins`)."""
        before = {n: a.clone() for n, a in self.allow.items()}
        for t in self.twins:
            t.ref.step(asynchronous, max_grad_norm=max_grad_norm)
        self._allow_step(asynchronous, max_grad_norm)
        if follow is not None:
            self.follow(*follow)
        self._spawn_twins(before)

    def _allow_step(self, asynchronous: bool, max_grad_norm: float | None) -> None:
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
                opt = self._make_optimizer(params)
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
        the allowance, becomes the reference's (master and fp32 moments; its twins' too), and the allowance there
        is spent.  A first update that noise decides moves every later gradient, beyond what any per-element
        allowance bounds (seed 730039: a 1.0.weight element whose first step went the other way, 6.5e-3 of the
        tensor's largest weight; two steps later 2.0.weight was 1.4e-4 off).  8-bit or offloaded moments cannot
        be copied an element at a time, and a device step's live on the worker: there nothing is followed (twins
        take those, `_spawn_twins`)."""
        ref_params = dict(self.ref.cur.named_parameters())
        opened = {n: self.allow[n] > 0.01 * TOL * q.detach().abs().max() for n, q in ref_params.items() if n in self.allow}
        if not any(o.any() for o in opened.values()) or model.device_step is not None or model.offload is not None:
            return
        engine = {n: p for n, p in model.named_parameters()}
        self.masters_value(at, {n: p.detach().float() for n, p in engine.items()})
        for n, q in ref_params.items():
            p, open_ = engine[n], opened.get(n)
            if open_ is None or not open_.any():
                continue
            mine, theirs = opt.state.get(p, {}), self.ref.opt.state.get(q, {})
            keys = [k for k in ("exp_avg", "exp_avg_sq") if isinstance(mine.get(k), torch.Tensor)
                    and isinstance(theirs.get(k), torch.Tensor) and mine[k].shape == q.shape]
            if len(keys) != 2:
                continue
            for r in self.refs:
                rq = dict(r.cur.named_parameters())[n]
                with torch.no_grad():
                    rq[open_] = p.detach().float()[open_]
                    for k in keys:
                        r.opt.state[rq][k][open_] = mine[k].float()[open_]
            self.allow[n][open_] = 0.0
            self._shadows = None   # made again from the reference's moments at the next step

    def _spawn_twins(self, before: dict) -> None:
        """A twin (`Twin`) for each element whose allowance this step grew past TWIN_AT TOL and kept (`follow`
        spent none of it), the largest first, up to MAX_TWINS in all; the rest keep their allowance alone."""
        params = dict(self.ref.cur.named_parameters())
        grown = []
        for n, a in self.allow.items():
            added = (a - before[n]).flatten()
            at = TWIN_AT * TOL * params[n].detach().abs().max()
            grown += [(added[k].item(), n, k) for k in torch.nonzero(added > at).flatten().tolist()]
        for _, n, k in sorted(grown, reverse=True)[:MAX_TWINS - len(self.twins)]:
            twin = self._copy(snapshot(self.ref))
            moved = TWIN_STEP * self.allow[n].view(-1)[k].item()
            with torch.no_grad():
                dict(twin.cur.named_parameters())[n].view(-1)[k] += moved
            self.twins.append(Twin(twin, n, k, moved, 1 / TWIN_STEP))

    def _along_twins(self, got: dict, main: dict, twins: list[dict]) -> dict:
        """The reference's values `main` moved along the twins' differences from them as far as fits `got` best
        (least squares over all the tensors together, each in units of its largest |main|; each twin at most its
        reach): what the reference would hold had it made the engine's choices at the twinned elements, to first
        order.  The tensors are many more than the twins, so a wrong value off that line still shows."""
        names = [n for n in main if main[n] is not None]
        if not twins or not names:
            return main
        scale = {n: main[n].abs().max().clamp_min(1e-12) for n in names}
        flat = lambda d: torch.cat([((d[n] - main[n]) / scale[n]).flatten() for n in names]).double()
        cols = torch.stack([flat(tw) for tw in twins], 1)
        coef = torch.linalg.lstsq(cols, flat(got).unsqueeze(1)).solution.squeeze(1).tolist()
        coef = [max(-t.reach, min(t.reach, c)) for t, c in zip(self.twins, coef)]
        return {n: main[n] if n not in names else main[n] + sum(c * (tw[n] - main[n]) for c, tw in zip(coef, twins))
                for n in main}

    # ---- checks

    def master_err(self, name: str, got: torch.Tensor, want: torch.Tensor) -> float:
        """max_rel_err of a master, each element's allowance taken off its difference first."""
        excess = ((got - want).abs() - self.allow.get(name, 0.0)).clamp_min(0)
        return (excess.max() / want.abs().max().clamp_min(1e-12)).item()

    def masters_value(self, at, got: dict, what: str = "masters") -> None:
        """The engine's masters (name -> fp32 tensor, for the reference's floating-point state-dict entries it
        names) within TOL of the reference's, along the twins (`_along_twins`), less each element's allowance."""
        pick = lambda r: {n: v.detach() for n, v in r.cur.state_dict().items() if n in got and v.is_floating_point()}
        want = self._along_twins(got, pick(self.ref), [pick(t.ref) for t in self.twins])
        for n, w in want.items():
            err = self.master_err(n, got[n], w)
            assert err <= TOL, (at, n, what, err)

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
        self.masters_value(at, {n: masters[n].float() for n, _ in self.ref.cur.named_parameters()})
        at_masters = copy.deepcopy(self.ref.cur)
        at_masters.load_state_dict({k: v.float() for k, v in masters.items()})
        with torch.no_grad():
            self.value(at, i, "outputs at the engine's masters", got, self.local(at_masters(x)))

    def grads_value(self, at, model) -> None:
        """After a synchronize: the engine's gradients summed since the last step against the reference's,
        along the twins (`_along_twins`), each by `grad_value`."""
        got = {n: p.grad for n, p in model.named_parameters()}
        main = {n: q.grad for n, q in self.ref.cur.named_parameters()}
        for n, g in got.items():
            assert (g is None) == (main[n] is None), (at, n)
        twins = [{n: q.grad for n, q in t.ref.cur.named_parameters()} for t in self.twins]
        want = self._along_twins(got, main, twins)
        for n, g in got.items():
            if g is not None:
                self.grad_value(at, n, g, want[n])

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

    def _open_weights(self, most: int = 256) -> list[tuple[str, int, float]]:
        """(parameter, flat index, allowance) of each weight whose allowance passed 1% of TOL (of its tensor's
        largest weight); at most `most`, past which the checks that move them one at a time bound nothing."""
        params = dict(self.ref.cur.named_parameters())
        opened = []
        for n, allow in self.allow.items():
            flat = allow.flatten()
            for k in torch.nonzero(flat > 0.01 * TOL * params[n].detach().abs().max()).flatten().tolist():
                opened.append((n, k, flat[k].item()))
        assert len(opened) <= most, f"{len(opened)} open weights: past what the checks at moved weights bound"
        return opened

    def _grad_moves(self) -> dict:
        """Per trained parameter, the elementwise sum over open weights (`_open_weights`) and over the
        reference's calls since its last step of the largest change of its gradient when that weight moves by
        its allowance one way or the other."""
        ref = self.ref
        params = dict(ref.cur.named_parameters())
        opened = self._open_weights()
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

    def call_value(self, at, i, x, y, loss, out, want) -> None:
        """A forward_backward's loss and outputs (out None: not returned; over this rank's rows, labels y)
        against want, the reference's (loss, outputs) on the whole batch x (`forward_backward`).  Where a
        master's allowance is open, the weights the call read may be off by it and the call's values with them,
        and inside an asynchronous window the engine's masters it read cannot be asked for (seed 1380402: one
        3.0.weight element 4.4e-4 off after a first update in Adam's eps region, within its 868 TOL allowance; a
        call of the next window read it, outputs 1.1e-4 off).  Then the values must be the reference's at the
        weights it read, moved within the allowances and along the twins (`_at_fitted_weights`)."""
        if self.ref is None:
            self.value(at, i, "loss", loss)
            if out is not None:
                self.value(at, i, "outputs", out)
            return
        want, calls = self._local_call(want, y), [self._local_call(t.call, y) for t in self.twins]
        for name, got in (("loss", loss), ("outputs", out)):
            assert got is None or torch.isfinite(got).all(), (at, name, got)
        errs = [max_rel_err(loss, want[0])] + ([] if out is None else [max_rel_err(out, want[1])])
        if max(errs) <= TOL:
            return
        excess = self._at_fitted_weights(x, y, loss, out, want, calls)
        assert excess <= TOL, (at, "loss and outputs", errs, excess, "past the allowance")

    def _local_call(self, call: tuple, y) -> tuple:
        """A reference call's (loss, outputs) over this rank's rows, labels y."""
        if self.rows is None:
            return call
        out = self.local(call[1])
        return self.ref.loss_fn(out, y), out

    def _at_fitted_weights(self, x, y, loss, out, want, calls, fitted: float = 0.1) -> float:
        """How far past TOL (relative, as max_rel_err) the call's loss and outputs (out None: the loss alone) are
        from the reference's at the weights it read (the last of ref.calls), each open weight (`_open_weights`)
        moved within its allowance (the latest one, which holds a stale read's too: allowances only grow between
        steps) and along each twin within its reach (`calls`: their (loss, outputs) of this call).

        Moving one weight by all of its allowance, or a twin by its reach, moves the values by at most its effect
        (elementwise, the worse of the two ways).  Those whose effect passes `fitted` TOL are fitted: least squares
        on the values' slopes in them, clamped, at most a quarter of the values (past that a fit would explain
        anything); the others' effects add up to a slack.  So an engine weight in Adam's eps region explains a
        rank-one pattern in the outputs and nothing else (seed 1380402: 74 TOL effect, fitted to 4.4e-4, its
        outputs then within 1e-7; outputs 0.03% off would be 3 TOL past).  A loss alone (one value) is bounded by
        the sum of the effects instead."""
        probe = copy.deepcopy(self.ref.cur)
        weights = copy.deepcopy(self.ref.calls[-1][2])
        scales = [want[0].abs().clamp_min(1e-12), want[1].abs().max().clamp_min(1e-12)]

        def vector(loss, out) -> torch.Tensor:   # in units of the reference's magnitudes
            return torch.cat([(loss.float() / scales[0]).reshape(1)] + ([] if out is None else [(out.float() / scales[1]).flatten()]))

        def values() -> torch.Tensor:   # the reference's at `weights`
            probe.load_state_dict(weights)
            with torch.no_grad():
                o = self.local(probe(x))
                return vector(self.ref.loss_fn(o, y), None if out is None else o)

        got, base = vector(loss, out), values()
        opened = self._open_weights()
        effects, slopes, reach = [], [], []   # per open weight, then per twin
        for n, k, a in opened:
            flat, w0 = weights[n].view(-1), weights[n].view(-1)[k].item()
            moved = []
            for sign in (1.0, -1.0):
                flat[k] = w0 + sign * a
                moved.append(values())
            flat[k] = w0
            effects.append(torch.maximum((moved[0] - base).abs(), (moved[1] - base).abs()))
            slopes.append((moved[0] - moved[1]) / (2 * a))
            reach.append(a)
        for t, call in zip(self.twins, calls):
            slopes.append(vector(call[0], None if out is None else call[1]) - vector(want[0], None if out is None else want[1]))
            effects.append(slopes[-1].abs() * t.reach)
            reach.append(t.reach)
        big = [j for j, e in enumerate(effects) if e.max() > fitted * TOL]
        if not big or len(big) > base.numel() // 4:
            bound = sum(effects, torch.zeros_like(base))
            return ((got - base).abs() - bound).clamp_min(0).max().item()
        slack = sum((e for j, e in enumerate(effects) if j not in big), torch.zeros_like(base))
        jac = torch.stack([slopes[j] for j in big], 1).double()
        coef = torch.linalg.lstsq(jac, (got - base).double().unsqueeze(1)).solution.squeeze(1).tolist()
        along = torch.zeros_like(base)
        for j, c in zip(big, coef):
            c = max(-reach[j], min(reach[j], c))
            if j < len(opened):
                n, k, _ = opened[j]
                weights[n].view(-1)[k] += c
            else:
                along += c * slopes[j]
        return ((got - values() - along).abs() - slack).clamp_min(0).max().item()

    def local(self, t):
        return t if self.rows is None else t[self.rows]

    def value(self, at, i, name, got, want=None):
        assert torch.isfinite(got).all(), (at, name, got)
        if self.ref is None:
            self.seen[(i, name)] = got.detach().clone()
        else:
            assert max_rel_err(got, want) <= TOL, (at, name, max_rel_err(got, want))
