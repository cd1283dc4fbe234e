"""Adam8bit and AdamW8bit: Adam with 8-bit blockwise moments on the native fused step.

    opt = roundpipe.optim.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()

m and v take 1 byte per element plus an fp32 absmax per 256 elements instead of
4 + 4 bytes: host state of 10 bytes per trainable parameter with the fp32 master
and a bf16 upload copy and gradient, against 16 with AdamW.  The format is
bitsandbytes 0.50's (roundpipe/optim/blockwise.py), and so is the state dict:
per parameter 'step', 'state1' / 'state2' (uint8 codes of m / v), 'absmax1' /
'absmax2' and the maps 'qmap1' / 'qmap2'.  Parameters with fewer than
`min_8bit_size` (4096) elements keep fp32 'state1' / 'state2', as bitsandbytes does.

CPU fp32 contiguous parameters go through roundpipe._C.adam8bit_step (one pass
per 256-element block: decode, update, re-code, write the upload copy; GIL
released, threads over whole blocks), whose arithmetic is bitsandbytes' CPU
AdamW8bit's operation by operation: with fp32 gradients the codes equal its, and
the weights agree within about an ulp per step (torch's CPU sqrt, MKL's, is not
always correctly rounded).  Other parameters (CUDA, bf16, non-contiguous) are updated by
`_step_8bit_torch`, the same formulas in torch ops.  The small fp32-state
parameters use the fp32 fused Adam (roundpipe/optim/fused.py).

Adam8bit adds weight decay to the gradient (L2), as torch.optim.Adam does;
bitsandbytes' Adam8bit decays the weight instead, which is AdamW8bit here.
AMSGrad is not supported (nor is it by bitsandbytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterable

import torch

from roundpipe import _native
from roundpipe.core.checks import is_int
from roundpipe.optim import blockwise
from roundpipe.optim.base import Buffers, FusedOptimizer, native_buffers, native_ok, torch_grad
from roundpipe.optim.fused import AdamConfig, adam_step, adam_step_torch

CODED = ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")
_BNB_WRAPPER = "__bnb_optimizer_quant_state__"   # bitsandbytes' state_dict nests CODED under this key


def _unwrapped(state_dict: dict[str, Any]) -> dict[str, Any]:
    """state_dict with bitsandbytes' FSDP wrapper (if any) flattened into each parameter's state."""
    states = state_dict.get("state", {})
    if not any(isinstance(s, dict) and _BNB_WRAPPER in s for s in states.values()):
        return state_dict
    flat = {i: ({**{k: v for k, v in s.items() if k != _BNB_WRAPPER}, **s.get(_BNB_WRAPPER, {})}
                if isinstance(s, dict) else s) for i, s in states.items()}
    return {**state_dict, "state": flat}


@dataclass(frozen=True)
class Adam8bitConfig(AdamConfig):
    """AdamConfig (amsgrad False) and min_8bit_size: parameters with fewer elements keep fp32 states (>= 0)."""

    min_8bit_size: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.amsgrad:
            raise ValueError("amsgrad=True: 8-bit Adam does not support AMSGrad (nor does bitsandbytes); use "
                             "roundpipe.optim.AdamW(amsgrad=True)")
        size = self.min_8bit_size
        if not is_int(size) or size < 0:
            raise ValueError(f"min_8bit_size={size!r} must be an int >= 0 (parameters with fewer elements keep "
                             "fp32 states)")


class Adam8bit(FusedOptimizer):
    """Adam with 8-bit blockwise moments: torch.optim.Adam's interface, bitsandbytes' state format."""

    _counts_steps = True
    _state_keys = frozenset({"step", *CODED})
    _state_format = "8-bit blockwise states (state1, state2, absmax1, absmax2, qmap1, qmap2)"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, min_8bit_size: int = 4096):
        lr = float(lr) if isinstance(lr, torch.Tensor) else lr
        Adam8bitConfig(lr, tuple(betas), eps, weight_decay, bool(decoupled_weight_decay), amsgrad, bool(maximize),
                       min_8bit_size)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                                      min_8bit_size=min_8bit_size))

    def _config(self, group: dict[str, Any]) -> Adam8bitConfig:
        beta1, beta2 = group["betas"]
        return Adam8bitConfig(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                              weight_decay=float(group["weight_decay"]),
                              decoupled=bool(group.get("decoupled_weight_decay", False)),
                              maximize=bool(group.get("maximize", False)),
                              min_8bit_size=group.get("min_8bit_size", 4096))

    def _states(self, params: list[torch.Tensor], config: Adam8bitConfig,
                masters: list[bool] | None = None) -> list[tuple[dict[str, Any], Buffers]]:
        out = []
        for p in params:
            state = self.state[p]
            if "step" in state and not isinstance(state["step"], torch.Tensor):  # bitsandbytes stores an int
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            if "state1" in state:
                bufs = {k: state[k] for k in CODED if k in state}
            elif p.numel() < config.min_8bit_size:
                bufs = {k: torch.zeros_like(p, dtype=torch.float32) for k in ("state1", "state2")}
            else:
                t, n = blockwise.tables(), blockwise.blocks(p.numel())
                bufs = {"state1": torch.zeros_like(p, dtype=torch.uint8), "state2": torch.zeros_like(p, dtype=torch.uint8),
                        "absmax1": p.new_zeros(n, dtype=torch.float32), "absmax2": p.new_zeros(n, dtype=torch.float32),
                        "qmap1": t.code1.to(p.device), "qmap2": t.code2.to(p.device)}
            out.append((state, bufs))
        return out

    def _native_ok(self, p: torch.Tensor, grad: torch.Tensor, bufs: Buffers, master: bool = False) -> bool:
        if bufs["state1"].dtype == torch.float32:
            return native_ok(p, grad, [bufs["state1"], bufs["state2"]], master)
        return native_ok(p, grad, [], master) and all(
            bufs[k].device.type == "cpu" and bufs[k].is_contiguous() for k in ("state1", "state2", "absmax1", "absmax2"))

    def _native_step(self, config: AdamConfig, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[tuple[dict[str, Any], Buffers]], shadows: list | None, grad_mul: float,
                     predict: float = 0.0, rounding: str | None = None, keys: list[int] | None = None) -> None:
        shadows = [None] * len(params) if shadows is None else shadows
        keys = [0] * len(params) if keys is None else keys
        for coded in (False, True):
            idx = [i for i, (_, b) in enumerate(states) if (b["state1"].dtype == torch.uint8) == coded]
            if not idx:
                continue
            ps, gs, bs = [params[i] for i in idx], [grads[i] for i in idx], [states[i][1] for i in idx]
            steps = [self._step_of(states[i][0]) for i in idx]
            if not coded:
                adam_step(ps, gs, [b["state1"] for b in bs], [b["state2"] for b in bs], steps, config,
                          shadows=[shadows[i] for i in idx], grad_mul=grad_mul, predict=predict,
                          rounding=rounding or "nearest", round_keys=[keys[i] for i in idx])
                continue
            t = blockwise.tables()
            beta1, beta2 = config.betas
            _native.lib.adam8bit_step(
                **native_buffers(ps, gs, [shadows[i] for i in idx], predict, rounding, [keys[i] for i in idx]),
                **{f"{k}s": [b[k].data_ptr() for b in bs] for k in ("state1", "state2", "absmax1", "absmax2")},
                steps=steps, tables=[t.code1.data_ptr(), t.lut1.data_ptr(), t.code2.data_ptr(), t.lut2.data_ptr()],
                lr=config.lr, beta1=beta1, beta2=beta2, eps=config.eps, weight_decay=config.weight_decay,
                decoupled=config.decoupled, maximize=config.maximize, grad_mul=float(grad_mul))

    def _torch_step(self, config: AdamConfig, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                    bufs: Buffers, grad_mul: float) -> None:
        if bufs["state1"].dtype == torch.uint8:
            _step_8bit_torch(p, grad, bufs, self._step_of(state), config, grad_mul)
        else:
            adam_step_torch(p, grad, bufs["state1"], bufs["state2"], None, self._step_of(state), config, grad_mul)

    # ---- state dicts ----------------------------------------------------------------------------
    def _check_param_state(self, i: int, p: torch.Tensor, state: dict[str, Any]) -> None:
        """The state of an 8-bit parameter: codes shaped like p, one absmax per block, the standard maps;
        of an fp32 one: fp32 state1 / state2 shaped like p."""
        if "state1" not in state:
            return
        coded = state["state1"].dtype == torch.uint8
        need = CODED if coded else ("state1", "state2")
        missing = [k for k in need if not isinstance(state.get(k), torch.Tensor)]
        if missing:
            raise ValueError(f"the state of parameter {i} lacks {missing} (an {'8-bit' if coded else 'fp32'} state "
                             f"needs {list(need)})")
        for k in ("state1", "state2"):
            want = torch.uint8 if coded else torch.float32
            if state[k].shape != p.shape or state[k].dtype != want:
                raise ValueError(f"state {k!r} of parameter {i} is {state[k].dtype} {list(state[k].shape)}; expected "
                                 f"{want} {list(p.shape)}")
        if not coded:
            return
        n, t = blockwise.blocks(p.numel()), blockwise.tables()
        for k in ("absmax1", "absmax2"):
            if state[k].shape != (n,):
                raise ValueError(f"state {k!r} of parameter {i} has shape {list(state[k].shape)}; a parameter of "
                                 f"{p.numel()} elements has {n} blocks of {blockwise.BLOCK}")
        for k, code in (("qmap1", t.code1), ("qmap2", t.code2)):
            if not torch.equal(state[k].detach().float().cpu(), code):
                raise ValueError(f"state {k!r} of parameter {i} is not bitsandbytes' {'signed' if k == 'qmap1' else 'unsigned'} "
                                 "dynamic map, the only one this optimizer codes with")

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().check_state_dict(_unwrapped(state_dict))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, except that the coded tensors keep their dtypes (torch casts every state
        tensor to its parameter's dtype: uint8 codes would become floats, a bf16 parameter's absmax bf16)."""
        state_dict = _unwrapped(state_dict)
        self.check_state_dict(state_dict)
        saved = state_dict.get("state", {})
        plain = {i: {k: v for k, v in s.items() if k not in CODED} if isinstance(s, dict) else s
                 for i, s in saved.items()}
        super().load_state_dict({**state_dict, "state": plain})
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for i, p in zip(ids, chain.from_iterable(g["params"] for g in self.param_groups)):
            if isinstance(saved.get(i), dict):
                for k in CODED:
                    if k in saved[i]:
                        self.state[p][k] = saved[i][k].detach().to(p.device, copy=True)


class AdamW8bit(Adam8bit):
    """AdamW with 8-bit blockwise moments: decoupled weight decay, default 0.01 (bitsandbytes' AdamW8bit)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 min_8bit_size: int = 4096):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, min_8bit_size=min_8bit_size)


def _step_8bit_torch(p: torch.Tensor, grad: torch.Tensor, bufs: Buffers, step: float, config: AdamConfig,
                     grad_mul: float) -> None:
    """One 8-bit parameter's update with torch ops (any device, any float parameter dtype, computed in fp32),
    in the kernel's order: bitsandbytes' CPU 8-bit Adam with roundpipe's gradient multiplier and L2 option."""
    beta1, beta2 = config.betas
    t = blockwise.tables()
    cast = p.dtype != torch.float32
    w = p.detach().float() if cast else p.detach()
    g = torch_grad(w, grad, grad_mul, config.maximize, 0.0 if config.decoupled else config.weight_decay)
    m = blockwise.dequantize_ref(bufs["state1"], bufs["absmax1"], bufs["qmap1"])
    v = blockwise.dequantize_ref(bufs["state2"], bufs["absmax2"], bufs["qmap2"])
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(config.eps)
    if config.decoupled and config.weight_decay != 0:
        w.mul_(1 - config.lr * config.weight_decay)
    w.addcdiv_(m, denom, value=-config.lr / (1 - beta1**step))
    if cast:
        p.detach().copy_(w)
    for x, k, lut in ((m, "1", t.lut1), (v, "2", t.lut2)):
        codes, absmax = blockwise.quantize_ref(x, bufs["qmap" + k], lut)
        bufs["state" + k].copy_(codes)
        bufs["absmax" + k].copy_(absmax)
