"""What every fused optimizer shares: torch.optim plumbing, the engine's entries, the native/torch split.

`FusedOptimizer` is a torch.optim.Optimizer (param groups, lr schedulers, hooks,
`zero_grad`, state dicts) whose update of one param group is split between the
native kernel, for the parameters it can take (CPU, fp32, contiguous, with an
fp32/bf16/fp16 contiguous CPU gradient), and a torch-ops fallback in the same
formula for the rest (CUDA, bf16 parameters, non-contiguous views).  A subclass
(Adam/AdamW, SGD, Adagrad, Lion) supplies the math:

    _config(group)            the group's validated hyper-parameters
    _buffer_names(config)     the state's fp32 buffers the update reads and writes
                              (created, not yet stored, on a first step; _initial_value)
    _native_step(...)         one native call over the parameters the kernel takes
    _torch_step(...)          one parameter's update with torch ops
    _commit(state, bufs)      stores new buffers and advances the step count, after success

so that a call rejected by validation leaves weights and state as they were.
The engine's entries are `step_layer` (RoundPipe.step, once per layer) and
`fused_step` (explicit gradients, loss scale, inf check).

bf16 masters (roundpipe/optim/rounding.py).  With a master rounding set
(`master_rounding`, or step_layer's `rounding=`, as RoundPipe(master_dtype=torch.bfloat16)
passes it), a bf16 parameter is a master: the update is computed in fp32 (fp32 state) and
the new weight rounded back to bf16, to nearest or stochastically with counter-based bits
keyed by (`rounding_seed`, the parameter's step count, its index in param_groups), in the
native pass; the torch path computes on an fp32 copy and rounds with `round_bf16_`, the
same bits.  Optimizers that keep no step count (SGD, Lion) then count steps for such a
parameter ('step' in its state), so that a resumed run draws the same bits.  Without a
rounding (None, the default of an optimizer used on its own) a bf16 parameter is updated
as torch.optim updates it, in its own dtype.

A subclass that names its state format (`_state_keys`, `_state_format`) refuses,
in `check_state_dict` / `load_state_dict`, a state dict written in another format
(AdamW's fp32 moments loaded into AdamW8bit, or the reverse) before anything is loaded.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from roundpipe import _native
from roundpipe.core.checks import check_number, is_number
from roundpipe.hostops import NATIVE_DTYPES, check_host_tensor
from roundpipe.optim.gradients import grad_sumsq
from roundpipe.optim.rounding import check_rounding, round_bf16_, round_key

Buffers = dict[str, torch.Tensor]


def check_nonneg(name: str, value: object) -> None:
    """ValueError naming `name` unless value is a finite real number >= 0."""
    check_number(name, value, finite=True)


def check_betas(betas: object) -> None:
    """ValueError unless betas is a pair of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if not is_number(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]={beta!r} must be a number in [0, 1)")


def check_flags(config: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name}={getattr(config, name)!r} must be a bool")


def reject_unsupported(name: str, capturable: bool = False, differentiable: bool = False) -> None:
    if capturable or differentiable:
        raise ValueError(f"capturable={capturable} and differentiable={differentiable}: roundpipe's {name} "
                         f"supports neither; use torch.optim.{name} for them")


def torch_grad(p: torch.Tensor, grad: torch.Tensor, grad_mul: float, maximize: bool, l2: float = 0.0,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch fallback's gradient, as the kernels read it: `grad` (p's element count, any float
    dtype) in `dtype` (default p's) times grad_mul, negated to maximize, plus the L2 term l2 * p."""
    g = grad.view_as(p).to(dtype or p.dtype)
    if grad_mul != 1.0:
        g = g * grad_mul
    if maximize:
        g = -g
    return g.add(p, alpha=l2) if l2 != 0 else g


def master_args(params: Sequence[torch.Tensor], rounding: str | None, keys: Sequence[int] | None) -> dict[str, Any]:
    """The native step's master arguments: each parameter's dtype (fp32 or a bf16 master), the rounding
    and one key per parameter (rounding.py)."""
    return dict(param_dtypes=[NATIVE_DTYPES[p.dtype] for p in params], rounding=rounding or "nearest",
                round_keys=list(keys) if keys is not None and rounding == "stochastic" else [])


def native_buffers(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   shadows: Sequence[torch.Tensor | None] | None, predict: float = 0.0,
                   rounding: str | None = None, keys: Sequence[int] | None = None) -> dict[str, Any]:
    """The address lists every native optimizer step takes (params, grads, shadows, numels), and
    `predict` (the shadows then receive the predicted next weights, see step_layer), and the
    masters' dtypes, rounding and keys (`master_args`).

    Parameters and gradients were vetted by `native_ok`; a shadow is the caller's and is
    checked here (a ValueError naming it before anything runs)."""
    shadows = [None] * len(params) if shadows is None else list(shadows)
    for i, t in enumerate(shadows):
        if t is not None:
            check_host_tensor(f"shadows[{i}]", t)
    return dict(params=[p.data_ptr() for p in params], grads=[g.data_ptr() for g in grads],
                grad_dtypes=[NATIVE_DTYPES[g.dtype] for g in grads],
                shadows=[t.data_ptr() if t is not None else 0 for t in shadows],
                shadow_dtypes=[NATIVE_DTYPES[t.dtype] if t is not None else "bfloat16" for t in shadows],
                numels=[p.numel() for p in params], predict=float(predict), **master_args(params, rounding, keys))


def describe_state(keys: set[str]) -> str:
    """What optimizer state format a parameter's state keys are, for error messages."""
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return "fp32 Adam moments, as Adam/AdamW (roundpipe's or torch's) write them"
    if {"state1", "absmax1"} & keys:
        return "8-bit blockwise states, as Adam8bit/AdamW8bit (roundpipe's or bitsandbytes') write them"
    return "another optimizer's state"


def native_ok(p: torch.Tensor, grad: torch.Tensor, buffers: Sequence[torch.Tensor], master: bool = False) -> bool:
    """Whether the native kernel can take this parameter (else the torch path runs): fp32, or a bf16
    master (`master`), with fp32 buffers."""
    return (_native.available() and grad.dtype in NATIVE_DTYPES and grad.device.type == "cpu"
            and grad.is_contiguous() and p.device.type == "cpu" and p.is_contiguous()
            and (p.dtype == torch.float32 or (master and p.dtype == torch.bfloat16))
            and all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in buffers))


def is_bf16_master(p: torch.Tensor, rounding: str | None) -> bool:
    """Whether p is updated as a bf16 master (fp32 math, rounded): bf16 with a master rounding set."""
    return rounding is not None and p.dtype == torch.bfloat16


class FusedOptimizer(torch.optim.Optimizer):
    """Base of roundpipe's fused CPU optimizers (see the module docstring)."""

    def __init__(self, params: Any, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        self._fused_call: tuple | None = None
        # bf16 masters (module docstring): None treats bf16 parameters as torch.optim does
        self.master_rounding: str | None = None
        self.rounding_seed = 0
        self._index_of: dict[int, int] = {}

    # torch.optim.Optimizer pickles (and deep-copies) only defaults, state and param_groups: the
    # rounding settings travel too, and the per-step caches start empty in the copy
    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "master_rounding": self.master_rounding,
                "rounding_seed": self.rounding_seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._fused_call, self._index_of = None, {}
        self.__dict__.setdefault("master_rounding", None)
        self.__dict__.setdefault("rounding_seed", 0)

    def state_layout(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state buffers a step would give `param` (under its group's settings), as meta tensors:
        name -> tensor with the dtype and shape it would have.  Nothing is allocated or stored; the
        optimizer-state tier on disk sizes its files from it (roundpipe/offload/state_tier.py)."""
        group = next((g for g in self.param_groups if any(q is param for q in g["params"])), None)
        if group is None:
            raise ValueError("state_layout: param is not in this optimizer's param_groups")
        meta = torch.empty_like(param, device="meta")
        try:
            (_, bufs), = self._states([meta], self._config(group))
        finally:
            self.state.pop(meta, None)
        return dict(bufs)

    # ---- the subclass's part ------------------------------------------------------------------
    def _config(self, group: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _buffer_names(self, config: Any) -> list[str]:
        """The state's fp32 buffers (one per parameter element) that the update reads and writes."""
        raise NotImplementedError

    def _initial_value(self, config: Any) -> float:
        return 0.0

    def _states(self, params: list[torch.Tensor], config: Any,
                masters: Sequence[bool] | None = None) -> list[tuple[dict[str, Any], Buffers]]:
        """Per parameter, (its state, its buffers): those in the state, or new ones not stored yet
        (fp32 for a bf16 master, masters[i])."""
        names, fill = self._buffer_names(config), self._initial_value(config)
        out = []
        for i, p in enumerate(params):
            state = self.state[p]
            if "step" in state and not isinstance(state["step"], torch.Tensor):  # old checkpoints stored a number
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            master = masters is not None and masters[i]
            bufs = {}
            for k in names:
                t = state.get(k)
                if t is None:
                    t = torch.full_like(p, fill, dtype=torch.float32 if master else None,
                                        memory_format=torch.preserve_format)
                elif master and t.dtype != torch.float32:   # made before p was a master (Adagrad's up-front sum)
                    t = t.float()
                bufs[k] = t
            out.append((state, bufs))
        return out

    def _native_step(self, config: Any, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        """One native call; rounding and keys (one per parameter) for the bf16 masters among params."""
        raise NotImplementedError

    def _torch_step(self, config: Any, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], bufs: Buffers,
                    grad_mul: float) -> None:
        raise NotImplementedError

    _counts_steps = False   # whether the state keeps torch's 'step' (a float32 0-dim tensor)

    def _commit(self, state: dict[str, Any], bufs: Buffers, counts: bool = False) -> None:
        """Stores the buffers and advances the step count (of every parameter when the optimizer counts
        steps, else where `counts`: a bf16 master's rounding keys need it)."""
        state.update(bufs)
        if not (self._counts_steps or counts):
            return
        if "step" in state:
            state["step"] += 1
        else:
            state["step"] = torch.tensor(1.0, dtype=torch.float32)

    def _native_ok(self, p: torch.Tensor, grad: torch.Tensor, bufs: Buffers, master: bool = False) -> bool:
        """Whether the native kernel can take this parameter with these buffers (else the torch path runs)."""
        return native_ok(p, grad, list(bufs.values()), master)

    def _param_index(self, p: torch.Tensor) -> int:
        """p's position in param_groups, flattened: the `index` of its rounding keys (the map is rebuilt when
        p is not in it or the groups changed size)."""
        size = sum(len(g["params"]) for g in self.param_groups)
        if id(p) not in self._index_of or len(self._index_of) != size:
            self._index_of = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
        return self._index_of[id(p)]

    _state_keys: frozenset[str] | None = None   # the per-parameter state keys written (None: not checked)
    _state_format = ""                          # what they are, for error messages

    def _check_param_state(self, i: int, p: torch.Tensor, state: dict[str, Any]) -> None:
        """ValueError unless parameter i's saved state fits p: every tensor but 'step' has p's shape."""
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                raise ValueError(f"state {k!r} of parameter {i} has shape {list(v.shape)} but the parameter is "
                                 f"{list(p.shape)}")

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """ValueError, before anything is loaded, unless `state_dict`'s per-parameter states are in this
        optimizer's format and fit its parameters."""
        params = [p for g in self.param_groups for p in g["params"]]
        name = type(self).__name__
        for i, state in state_dict.get("state", {}).items():
            if not isinstance(state, dict):
                continue
            if self._state_keys is not None and set(state) - self._state_keys:
                raise ValueError(f"{name} cannot load this state: parameter {i}'s state holds {sorted(state)}, "
                                 f"{describe_state(set(state))}; {name} keeps {self._state_format}. Load it into "
                                 "the optimizer that wrote it")
            if "step" in state:
                _check_step(i, state["step"])
            if isinstance(i, int) and 0 <= i < len(params):
                self._check_param_state(i, params[i], state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, after check_state_dict; a group key the writer lacks (a peer's state dict: bitsandbytes'
        has no decoupled_weight_decay) takes this optimizer's default instead of falling back to none."""
        self.check_state_dict(state_dict)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        # torch casts every floating state tensor to its parameter's dtype: a bf16 master's fp32 state stays fp32
        saved = state_dict.get("state", {})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, [p for g in self.param_groups for p in g["params"]]):
            for k, v in (saved.get(i) or {}).items() if isinstance(saved.get(i), dict) else ():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != p.dtype:
                    self.state[p][k] = v.detach().to(p.device, copy=True)

    @staticmethod
    def _step_of(state: dict[str, Any]) -> float:
        """The number of this update (1 for the first) for an optimizer that counts steps."""
        return float(state["step"]) + 1 if "step" in state else 1.0

    # ---- torch.optim ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (torch.optim semantics)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fused_call is not None:  # fused_step routed through here for hooks and lr schedulers
            params, grads, shadows, grad_mul = self._fused_call
            for gi, idx in self._by_group(params).items():
                self._update(self.param_groups[gi], [params[i] for i in idx], [grads[i] for i in idx],
                             [shadows[i] for i in idx], grad_mul, rounding=self._rounding(None))
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            self._update(group, params, [p.grad for p in params], None, 1.0, rounding=self._rounding(None))
        return loss

    # ---- the engine's entries -------------------------------------------------------------------
    @torch.no_grad()
    def fused_step(self, grads: Sequence[torch.Tensor], *, params: Sequence[torch.Tensor] | None = None,
                   shadows: Sequence[torch.Tensor | None] | None = None, grad_scale: float = 1.0,
                   clip_coef: float = 1.0, found_inf: bool | None = None) -> bool:
        """The engine's step: explicit gradients, optional upload copies, loss scale and clipping.

        grads[i] is the gradient of params[i] (default: all parameters, group
        by group) as fp32, bf16 or fp16 with the same number of elements; it is
        read as grads[i] * clip_coef / grad_scale.  shadows[i] (or None)
        receives the updated params[i] in its dtype.  found_inf: True skips the
        step, False runs it, None checks the gradients first (one extra read)
        when grad_scale != 1, as a loss scaler needs.  A skipped step changes
        nothing, step counts included, and returns False; otherwise True.
        """
        params = [p for g in self.param_groups for p in g["params"]] if params is None else list(params)
        grads = list(grads)
        if len(grads) != len(params):
            raise ValueError(f"grads has {len(grads)} tensors but params has {len(params)}; they must match")
        shadows = [None] * len(params) if shadows is None else list(shadows)
        if len(shadows) != len(params):
            raise ValueError(f"shadows has {len(shadows)} entries but params has {len(params)}; they must match")
        for i, (p, g, sh) in enumerate(zip(params, grads, shadows)):
            if not isinstance(g, torch.Tensor) or g.numel() != p.numel():
                raise ValueError(f"grads[{i}] must be a tensor with {p.numel()} elements like params[{i}], got "
                                 f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
            if sh is not None and (not isinstance(sh, torch.Tensor) or sh.numel() != p.numel()):
                raise ValueError(f"shadows[{i}] must be None or a tensor with {p.numel()} elements like params[{i}]")
        if not (grad_scale > 0 and math.isfinite(grad_scale)):
            raise ValueError(f"grad_scale={grad_scale!r} must be a finite number > 0")
        _check_clip_coef(clip_coef)
        if found_inf is None and grad_scale != 1.0:
            found_inf = not math.isfinite(grad_sumsq(grads))
        self._by_group(params)  # rejects foreign parameters before anything runs
        if found_inf:
            return False
        # Through step(), so that step hooks run and lr schedulers see an optimizer step.
        self._fused_call = (params, grads, shadows, clip_coef / grad_scale)
        try:
            self.step()
        finally:
            self._fused_call = None
        return True

    def _rounding(self, rounding: str | None) -> str | None:
        """The bf16 masters' rounding of one update: `rounding` if given, else master_rounding's."""
        chosen = self.master_rounding if rounding is None else rounding
        return None if chosen is None else check_rounding(chosen)

    @torch.no_grad()
    def step_layer(self, params: Sequence[torch.Tensor], upload: Sequence[torch.Tensor | None] | None = None,
                   clip_coef: float = 1.0, grads: Sequence[torch.Tensor | None] | None = None,
                   predict: float = 0.0, rounding: str | None = None) -> None:
        """The engine's per-layer step: updates those of `params` that have a `.grad` and writes
        each updated weight into upload[i] (the copy workers upload, any float dtype) in the same pass.
        The gradients are read as grad * clip_coef (global-norm clipping folded into the pass);
        `grads` gives them explicitly (one per parameter, None: no update; fp32, bf16 or fp16,
        read as they are), else each parameter's `.grad`.

        predict > 0: upload[i] receives the predicted next weights w + predict * (w - w_before)
        instead of w, computed in the same pass (staleness compensation, roundpipe/engine/step/staleness.py).

        rounding: how bf16 masters round ('stochastic' or 'nearest'; None: `master_rounding`).  A bf16
        master that is its own upload copy takes upload[i] None.

        RoundPipe.step calls this once per layer as the layer's P-copy gate opens, so
        the update of shallow layers overlaps the next iteration's use of deep ones.
        Unlike step(), no step hooks run (they would fire once per layer).
        """
        params = list(params)
        upload = [None] * len(params) if upload is None else list(upload)
        if len(upload) != len(params):
            raise ValueError(f"upload has {len(upload)} entries but params has {len(params)}; they must match")
        _check_clip_coef(clip_coef)
        rounding = self._rounding(rounding)
        if not is_number(predict) or not (0 <= predict < math.inf):
            raise ValueError(f"predict={predict!r} must be a finite number >= 0")
        grads = [p.grad for p in params] if grads is None else list(grads)
        if len(grads) != len(params):
            raise ValueError(f"grads has {len(grads)} entries but params has {len(params)}; they must match")
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape or not g.is_floating_point()):
                what = f"a {g.dtype} tensor of shape {tuple(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"grads[{i}] is {what}; expected None or a floating tensor of shape {tuple(p.shape)}")
        live = [i for i, g in enumerate(grads) if g is not None]
        for gi, idx in self._by_group([params[i] for i in live]).items():
            chosen = [live[i] for i in idx]
            self._update(self.param_groups[gi], [params[i] for i in chosen], [grads[i] for i in chosen],
                         [upload[i] for i in chosen], clip_coef, predict, rounding)

    # ---- a step of copies held elsewhere (the engine's device step) ------------------------------
    def state_copies(self, param: torch.Tensor, device: torch.device) -> Buffers:
        """Copies on `device` of `param`'s state buffers (new ones, as its first update would make them,
        while it has none), for `step_copies`: roundpipe/engine/step/device_step.py keeps them on a
        worker while a copy of the master lives there."""
        (_, bufs), = self._states([param], self._config(self.param_groups[self._group_index(param)]))
        return {k: v.to(device, copy=True) for k, v in bufs.items()}

    @torch.no_grad()
    def step_copies(self, params: Sequence[torch.Tensor], copies: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor], buffers: Sequence[Buffers], clip_coef: float = 1.0) -> None:
        """Updates copies[i], an fp32 copy of params[i] held on another device, from grads[i] (fp32, on the
        same device, read as grads[i] * clip_coef) and its state buffers[i] (`state_copies`), with torch ops
        in this optimizer's formula; params[i] itself is left as it is, and its step count advances as
        step_layer's would.  `store_state` writes the buffers back into the state (until then a buffer
        the state had none of is the copy itself)."""
        _check_clip_coef(clip_coef)
        for gi, idx in self._by_group(params).items():
            config = self._config(self.param_groups[gi])
            for i in idx:
                c, g = copies[i], grads[i]
                if c.dtype != torch.float32 or g.dtype != torch.float32 or c.shape != params[i].shape \
                        or g.shape != c.shape or g.device != c.device:
                    raise ValueError(f"step_copies: copies[{i}] and grads[{i}] must be fp32 tensors of shape "
                                     f"{tuple(params[i].shape)} on one device, got {c.dtype} {tuple(c.shape)} on "
                                     f"{c.device} and {g.dtype} {tuple(g.shape)} on {g.device}")
                state = self.state[params[i]]
                self._torch_step(config, c, g, state, buffers[i], clip_coef)
                # a buffer the state lacked is stored (the copy itself, until store_state): some formulas tell
                # their first update by its absence (SGD's momentum takes the first gradient as it is)
                self._commit(state, {k: v for k, v in buffers[i].items() if k not in state})

    def store_state(self, param: torch.Tensor, buffers: Buffers) -> None:
        """Writes state buffers held elsewhere (`state_copies`, after `step_copies`) into param's state,
        on param's device (into the state's own tensors where they exist)."""
        state = self.state[param]
        for k, v in buffers.items():
            t = state.get(k)
            if isinstance(t, torch.Tensor) and t is not v and t.device == param.device and t.shape == v.shape \
                    and t.dtype == v.dtype:
                t.copy_(v)
            else:   # none yet, or the copy itself (step_copies stored a buffer the state lacked)
                state[k] = v.to(param.device, copy=True)

    def _group_index(self, param: torch.Tensor) -> int:
        """The index of param's group; ValueError for a parameter not in this optimizer."""
        gi = self._by_group([param])
        return next(iter(gi))

    # ---- shared machinery -----------------------------------------------------------------------
    def _by_group(self, params: Sequence[torch.Tensor]) -> dict[int, list[int]]:
        """Indices into `params` per param-group index; ValueError for a parameter not in this optimizer."""
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        members: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if id(p) not in group_of:
                raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of this optimizer")
            members.setdefault(group_of[id(p)], []).append(i)
        return members

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                shadows: list[torch.Tensor | None] | None, grad_mul: float, predict: float = 0.0,
                rounding: str | None = None) -> None:
        if not params:
            return
        config = self._config(group)
        masters = [is_bf16_master(p, rounding) for p in params]
        states = self._states(params, config, masters)
        keys = [round_key(self.rounding_seed, self._step_of(s), self._param_index(p)) if m and rounding == "stochastic"
                else 0 for p, m, (s, _) in zip(params, masters, states)]
        native = [i for i, p in enumerate(params) if self._native_ok(p, grads[i], states[i][1], masters[i])]
        if native:
            pick = lambda seq: [seq[i] for i in native]
            self._native_step(config, pick(params), pick(grads), pick(states),
                              pick(shadows) if shadows is not None else None, grad_mul, predict,
                              rounding if any(pick(masters)) else None, pick(keys))
        for i in sorted(set(range(len(params))) - set(native)):
            shadow = shadows[i] if shadows is not None else None
            if masters[i]:   # computed on an fp32 copy, rounded as the native pass rounds
                w = params[i].detach().float()
                update = lambda i=i, w=w: (self._torch_step(config, w, grads[i], *states[i], grad_mul),
                                           round_bf16_(params[i].detach(), w, rounding, keys[i]))
            else:
                update = lambda i=i: self._torch_step(config, params[i], grads[i], *states[i], grad_mul)
            with_shadow(params[i], shadow, predict, update)
        for (state, bufs), m in zip(states, masters):
            self._commit(state, bufs, m)


def with_shadow(p: torch.Tensor, shadow: torch.Tensor | None, predict: float, update: Callable[[], None]) -> None:
    """The torch-ops path's update of p, then its shadow written as the native pass writes it: the new
    weight, or with predict the predicted next one p + predict * (p - p_before) (in fp32)."""
    before = p.detach().to(torch.float32, copy=True) if predict and shadow is not None else None
    update()
    if shadow is not None:
        new = p.detach().float() if before is not None else p.detach()
        shadow.view(-1).copy_((new + predict * (new - before) if before is not None else new).view(-1))


def _check_clip_coef(clip_coef: float) -> None:
    if not (clip_coef > 0 and math.isfinite(clip_coef)):
        raise ValueError(f"clip_coef={clip_coef!r} must be a finite number > 0")


def _check_step(i: Any, step: Any) -> None:
    """ValueError unless a saved 'step' is a count of updates: a whole number >= 0 (a number or a one-element
    tensor).  A damaged one would otherwise fail the first step after the load, far from its cause."""
    one = isinstance(step, torch.Tensor) and step.numel() == 1
    value = float(step) if one or (is_number(step) and not isinstance(step, bool)) else None
    if value is None or not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"state 'step' of parameter {i} is {step!r}; expected a whole number >= 0 (the updates "
                         "made so far)")
