"""RNG handling that makes recomputation exact, runs reproducible and workers independent.

Backward stages recompute their forward, so a dropout mask drawn in the forward
must be drawn again, bit for bit, in the recompute.  Every layer therefore runs
from a generator seeded with `layer_seed(base, layer, microbatch)`, where `base`
is drawn once per call from the caller's generator: forward and recompute seed
identically, and the masks depend on the seed, the call, the microbatch and the
layer only, never on the plan (where stages start), the worker or the device.
Two runs with the same `torch.manual_seed` give bitwise-equal results even when
the auto-planner changes the plan between calls.

Each worker owns its generator (`WorkerRng`), so workers draw side by side with
no lock.  PyTorch's random functions draw from the device's default generator
unless given one; while a worker runs layers (`WorkerRng.stream()`, a
thread-local torch function mode) every random function that takes a
`generator=` gets the worker's, and dropout (`F.dropout`, `dropout1d/2d/3d`) is
drawn from it as a Bernoulli mask.  The few random functions without a
`generator=` argument (alpha dropout, rrelu, attention with dropout_p > 0,
gumbel softmax, ...) borrow the device's default generator under a lock, with
the worker's state swapped in and the default's put back: exact and
reproducible, serialised only while such a function runs.  The caller's own
random stream advances by exactly the one draw of `base` per call.  Randomness
from a generator a layer owns itself is not rewound by recompute; the engine's
`_check_recompute` debugging switch finds it.

Different GPU models.  A seed fixes CUDA's random numbers only for one grid:
the random kernels (`bernoulli_`, `uniform_`, ...) size it from the device's SM
count, so a mask drawn in a forward on an H100 and redrawn in its recompute on
an A100 differs.  Masks computed independently of the device would cost a
hand-written counter-based kernel or a mask made on the host and uploaded (an
activation's worth of PCIe per dropout); a pool mixing GPU models is refused
instead: `make_workers` gives its workers' generators the reason
(`mixed_models`), and the first random draw of a layer on such a worker raises
it as a ValueError naming the devices.  At the draw, not at construction: the
engine cannot see a functional `F.dropout` (or any random op) in a layer's code
before it runs, while the draw catches every kind, and a model with dropout in
eval mode (nothing drawn) still runs on the mixed pool.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MASK = (1 << 63) - 1
_U64 = (1 << 64) - 1


def layer_seed(base: int, layer: int, microbatch: int) -> int:
    """A seed unique to (call, layer, microbatch) (splitmix64-style mixing)."""
    x = (base + 0x9E3779B97F4A7C15 * (layer + 1) + 0xBF58476D1CE4E5B9 * (microbatch + 1)) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return (x ^ (x >> 31)) & _MASK


# Random functions that take `generator=`: the worker's is passed when the caller gave none.
_TAKES_GENERATOR = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.normal, torch.bernoulli, torch.multinomial, torch.poisson,
    torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.normal_, torch.Tensor.uniform_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_, torch.Tensor.multinomial,
}

# Random functions without `generator=`: run on the default generator with the worker's state swapped in.
_BORROWS_DEFAULT = {
    F.alpha_dropout, F.feature_alpha_dropout, F.rrelu, F.rrelu_, F.gumbel_softmax,
    F.fractional_max_pool2d, F.fractional_max_pool3d, torch.dropout, torch.feature_dropout,
    torch.alpha_dropout, torch.feature_alpha_dropout, torch.native_dropout, torch.rrelu, torch.rrelu_,
}

_default_locks: dict[str, threading.Lock] = {}
_default_locks_lock = threading.Lock()


def _default_lock(device: torch.device) -> threading.Lock:
    key = str(device) if device.type == "cuda" else "cpu"
    with _default_locks_lock:
        return _default_locks.setdefault(key, threading.Lock())


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def device_model(device: torch.device) -> tuple:
    """What CUDA's random kernels size their grid from: the model's name, SM count and threads per SM."""
    p = torch.cuda.get_device_properties(device)
    return p.name, p.multi_processor_count, getattr(p, "max_threads_per_multi_processor", None)


def mixed_models(devices: list[torch.device]) -> str | None:
    """Why random draws cannot be recomputed exactly on this pool (None: one GPU model, or CPUs only)."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=lambda d: d.index)
    models = {d: device_model(d) for d in cuda}
    if len(set(models.values())) <= 1:
        return None
    names = "; ".join(f"{d}: {name}, {sms} SMs" for d, (name, sms, _) in models.items())
    return (f"devices={[str(d) for d in devices]} mix GPU models ({names}), and a layer draws random numbers "
            "(dropout): CUDA's random kernels size their grid from the SM count, so a mask drawn in a forward "
            "on one model and redrawn in its recompute on another would differ and the gradients would be "
            "wrong without an error.  Use GPUs of one model (e.g. devices=[...] of the same kind), or no "
            "randomness in training (dropout p=0 or the layer in eval mode)")


def _dropout(rng: "WorkerRng", x: torch.Tensor, p: float, training: bool, inplace: bool,
             feature_dims: int = 0) -> torch.Tensor:
    """F.dropout (feature_dims=0) or channel dropout (dropoutNd: whole trailing `feature_dims` dims)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if rng.refuse is not None:
        raise ValueError(rng.refuse)
    gen = rng.generator
    if feature_dims and x.dim() > feature_dims:
        shape = tuple(x.shape[:x.dim() - feature_dims]) + (1,) * feature_dims
    else:
        shape = x.shape
    keep = torch.empty(shape, dtype=x.dtype, device=x.device)
    if p == 1.0:
        keep.zero_()
    else:
        keep.bernoulli_(1.0 - p, generator=gen).div_(1.0 - p)
    return x.mul_(keep) if inplace else x * keep


def _dropout_fn(feature_dims: int) -> Callable[..., torch.Tensor]:
    def run(rng: "WorkerRng", input: torch.Tensor, p: float = 0.5, training: bool = True,
            inplace: bool = False) -> torch.Tensor:
        return _dropout(rng, input, p, training, inplace, feature_dims)
    return run


# dropout2d/3d drop whole channels: the mask covers (N, C) with the spatial dims broadcast.
_DROPOUT = {F.dropout: _dropout_fn(0), F.dropout1d: _dropout_fn(1), F.dropout2d: _dropout_fn(2),
            F.dropout3d: _dropout_fn(3)}


# What the mode does with each function it routes (one lookup per call: every torch call in a layer's forward
# passes through the mode, and three set lookups there cost the default decoder's forward 0.7 ms of ~35).
# Later entries win, so the order gives the precedence: a generator argument, then dropout, then the default's.
_ROUTES: dict[Callable, str] = {F.scaled_dot_product_attention: "attention",
                                **dict.fromkeys(_BORROWS_DEFAULT, "default"), **dict.fromkeys(_DROPOUT, "dropout"),
                                **dict.fromkeys(_TAKES_GENERATOR, "generator")}


class _WorkerRandom(TorchFunctionMode):
    """Routes random functions called on this thread to one generator."""

    def __init__(self, rng: "WorkerRng"):
        super().__init__()
        self.rng = rng

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        if route is None:   # not random (nearly every call): as it is
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if route == "generator":
            if kwargs.get("generator") is None:
                if self.rng.refuse is not None:
                    raise ValueError(self.rng.refuse)
                kwargs = {**kwargs, "generator": self.rng.generator}
            return func(*args, **kwargs)
        if route == "dropout":
            return _DROPOUT[func](self.rng, *args, **kwargs)
        if route == "default" or kwargs.get("dropout_p") or (args[4] if len(args) > 4 else 0.0):
            return self.rng.on_default(func, args, kwargs)
        return func(*args, **kwargs)   # attention without dropout


class WorkerRng:
    """A worker's own generator, and the mode that makes the layers it runs draw from it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self._mode = _WorkerRandom(self)
        # why layers on this worker may not draw random numbers (a pool of mixed GPU models: mixed_models);
        # None: they may.  Every draw under stream() then raises ValueError(refuse).
        self.refuse: str | None = None

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Random functions called on this thread inside draw from this worker's generator."""
        with self._mode:
            yield

    def on_default(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """func(*args, **kwargs) on the device's default generator holding this worker's state."""
        if self.refuse is not None:
            raise ValueError(self.refuse)
        default = _default_generator(self.device)
        with _default_lock(self.device):
            saved = default.get_state()
            default.set_state(self.generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self.generator.set_state(default.get_state())
                default.set_state(saved)


def draw_base() -> int:
    """The call's base seed: one draw from the caller's generator."""
    return int(torch.randint(0, 2**62, (1,)).item())
