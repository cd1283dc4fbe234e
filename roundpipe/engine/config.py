"""`EngineConfig`: every option of the engine, in one typed object, checked once.

    cfg = rp.EngineConfig(devices=["cuda:0", "cuda:1"], master_dtype=torch.bfloat16, offload_dir="/nvme/state")
    model = rp.RoundPipe(layers, config=cfg)                 # or the same options as keywords, as ever
    model = rp.RoundPipe(layers, devices=["cuda:0", "cuda:1"], master_dtype=torch.bfloat16, offload_dir="/nvme/state")

This dataclass is the one list of what `RoundPipe` takes besides its layers.  Every entry
point that builds an engine derives its options from it rather than listing them again:
`RoundPipe.__init__` (its keywords are these fields, checked by tests/engine/test_config.py),
`rp.hf.wrap` and `rp.hf.Trainer` (`ENGINE_OPTIONS` plus the hf-only ones, roundpipe/hf/model.py),
`rp.diffusers.wrap` (both wrappers check what they are passed with `check_wrap_options`)
and `roundpipe train` (roundpipe/commands/train_loops.py builds an EngineConfig from its flags).

What is checked here: everything that can be checked without the layers, the process group's
members, the file system or a device's free memory: types, ranges, choices, the device list, the
precision policy, an explicit device_memory, and the combinations of options (shard_optimizer needs
process_group, host_memory needs offload_dir, ...).  What needs those is checked where it is used:
an explicit plan against the number of layers (Plan.check), process_group's membership
(engine/data_parallel.py), offload_dir's directory and host_memory against the state that stays in
RAM (offload/state_tier.py), device_memory=None's caps from the devices' free memory at
construction (engine/device_memory.py).

The fields keep what the user gave (None: pick for the machine), so `dataclasses.replace` re-derives
the rest; the derived values (`worker_devices`, `resolved_precision`, `round_size`, ...) are computed
once in `__post_init__`.  The config is frozen: a checked config cannot be changed unchecked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Sequence

import torch

from roundpipe.core.checks import is_int
from roundpipe.engine.autoplan import PlanningConfig
from roundpipe.engine.calls import batchnorm as batchnorm_stats
from roundpipe.engine.calls.precision import Precision
from roundpipe.engine.calls.precision import resolve as resolve_precision
from roundpipe.engine.device_memory import resolve_caps
from roundpipe.engine.step.staleness import StalenessCompensation
from roundpipe.optim.rounding import Rounding, check_master_dtype, check_rounding
from roundpipe.planner.plan import Plan
from roundpipe.workers import default_compute_dtype, parse_devices

LossReduction = Literal["mean", "sum"]
BatchNormMode = Literal["per-microbatch", "whole-batch"]   # engine/calls/batchnorm.py MODES
Recompute = Literal["stage", "layer"]
RECOMPUTE_MODES = ("stage", "layer")


def _derived(default: Any = None) -> Any:
    """A value __post_init__ derives from the options: not an argument, not compared, not printed."""
    return dataclasses.field(default=default, init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every option of a RoundPipe besides its layers (the keywords of `RoundPipe(layers, ...)`)."""

    devices: Sequence[str | torch.device] | None = None
    """Workers: a list like ["cuda:0", "cuda:1"] or ["cpu", "cpu"] (a device listed twice: two workers on it);
    None: every visible GPU, else one CPU worker."""
    num_microbatches: int | None = None
    """Microbatches a batch is split into; None: microbatches_per_round, or one per worker, each run in one fused
    stage, when that fits a worker (engine/autoplan.py, whole_batch)."""
    compute_dtype: torch.dtype | None = None
    """Dtype of the upload copies and of the compute (autocast); None: bf16 on CUDA workers, fp32 on CPU ones."""
    plan: Plan | None = None
    """A fixed plan (stages of layers), never revised; None: the partitioner's, revised from timings (`planning`)."""
    microbatches_per_round: int | None = None
    """Microbatches dispatched per round; None: the number of workers + 1."""
    split_fn: Callable | None = None
    """split_fn(args, kwargs, labels, n) -> microbatches, for inputs the default splitter (dim 0) cannot split."""
    planning: PlanningConfig | None = None
    """How the plan is chosen and revised when `plan` is None; None: PlanningConfig()."""
    device_memory: int | dict | None = None
    """Bytes a worker may hold: an int for every worker, or a dict of device or worker name -> bytes;
    None: a CUDA worker's free memory at construction less a reserve, no cap on CPU workers."""
    loss_reduction: LossReduction = "mean"
    """"mean": microbatch losses weighted by their share of the samples (loss_fn a mean: the batch's mean);
    "sum": added as loss_fn returns them."""
    batchnorm: BatchNormMode = "per-microbatch"
    """BatchNorm running statistics: updated by every microbatch ("per-microbatch", as PyTorch per forward) or
    once per call from all the call's inputs ("whole-batch")."""
    recompute: Recompute = "stage"
    """How a backward stage recomputes its layers' forward: "stage" (the whole stage with autograd, then its
    backward: a stage holds all its layers' saved activations) or "layer" (one layer at a time, top down, each
    from its input saved by the forward: a stage holds one layer's, so stages may have more layers under a
    cap; the forward downloads every layer's input).  The fused tail stage never recomputes."""
    resident_layers: int | None = None
    """How many first layers keep their uploaded weights on each worker between stage runs
    (roundpipe/engine/calls/resident.py): a frozen weight is then uploaded once per run, a trained one once per
    step instead of once per stage on that worker.  None: the most whose weights keep every worker's predicted
    peak under its device_memory cap (none where a worker has no cap: CPU workers by default); 0: none; k: the
    first k (counted in the predicted peak, with a warning where that exceeds a cap)."""
    device_step: bool = False
    """Update the resident layers on their worker (roundpipe/engine/step/device_step.py): their fp32 masters,
    optimizer state and gradients stay there, so no gradient goes down and no weight goes up between steps.
    One worker, synchronous steps with a roundpipe.optim optimizer, fp32 masters, no fp16 loss scaling; the
    masters come home at sync points (synchronize, state_dict, save_checkpoint, close)."""
    precision: Precision | None = None
    """The precision policy (autocast, input casting, fp16 loss scaling); None: Precision(compute_dtype)."""
    process_group: Any = None
    """A torch.distributed group whose ranks train data-parallel (gradients all-reduced); None: this process alone."""
    shard_optimizer: bool = False
    """Split the optimizer state over the ranks of process_group (ZeRO-1 style)."""
    compensation: StalenessCompensation | None = None
    """Staleness compensation of the asynchronous step (predicted upload weights, PipeMare's rescheduling)."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the trainable masters: torch.float32, or torch.bfloat16 (updated in fp32 by roundpipe.optim and
    rounded as master_rounding says)."""
    master_rounding: Rounding = "stochastic"
    """How a bf16 master's fp32 update is rounded: "stochastic" (unbiased) or "nearest"."""
    offload_dir: Any = None
    """A directory (str or os.PathLike) for the optimizer state that does not fit host_memory; None: all in RAM."""
    host_memory: int | None = None
    """Bytes of training state kept in RAM with offload_dir (the rest goes to disk); None: every layer's optimizer
    state on disk."""
    stall_timeout: float | None = None
    """Seconds with no progress of any busy worker (a stage or microbatch ending) after which a waiting call raises
    RoundPipeStalled naming the stuck worker, its stage and microbatch, with every engine thread's stack; the
    model then takes no more calls.  None (default): off, wait as long as it takes.  Give more than the longest
    stage-microbatch compute and the longest optimizer step (docs/semantics.md, "Stalled workers"); on a GPU
    progress is compute the device has done, per compute span."""

    # derived in __post_init__
    worker_devices: list[torch.device] = _derived()
    resolved_precision: Precision = _derived()
    _caps: dict[str, int | None] | None = _derived()

    def __post_init__(self):
        devices = parse_devices(self.devices)   # errors name the entry
        for name in ("num_microbatches", "microbatches_per_round"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name}={v!r} must be None or an int >= 1")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={self.loss_reduction!r} must be 'mean' (microbatch losses weighted by "
                             "their share of the samples) or 'sum' (added as loss_fn returns them)")
        if self.batchnorm not in batchnorm_stats.MODES:
            raise ValueError(f"batchnorm={self.batchnorm!r} must be 'per-microbatch' (running statistics updated by "
                             "every microbatch, as PyTorch does per forward) or 'whole-batch' (updated once per call "
                             "from the statistics of all the inputs each BatchNorm saw in the call)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r} must be 'stage' (a backward stage recomputes all its "
                             "layers, then backpropagates) or 'layer' (one layer at a time, from each layer's "
                             "input saved by the forward)")
        if self.resident_layers is not None and (not is_int(self.resident_layers) or self.resident_layers < 0):
            raise ValueError(f"resident_layers={self.resident_layers!r} must be None (as many as the device_memory "
                             "caps leave room for) or an int >= 0 (that many first layers)")
        if not isinstance(self.device_step, bool):
            raise TypeError(f"device_step must be True or False, got {self.device_step!r}")
        if self.split_fn is not None and not callable(self.split_fn):
            raise TypeError(f"split_fn must be callable, got {type(self.split_fn).__name__}")
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise TypeError(f"plan must be a roundpipe.Plan or None, got {type(self.plan).__name__}")
        if self.planning is not None and not isinstance(self.planning, PlanningConfig):
            raise TypeError(f"planning must be a roundpipe.engine.autoplan.PlanningConfig or None, "
                            f"got {type(self.planning).__name__}")
        precision = resolve_precision(self.precision, self.compute_dtype, default_compute_dtype(devices))
        # an explicit cap is checked against the workers now; None is read from the devices at construction
        caps = resolve_caps(self.device_memory, devices) if self.device_memory is not None else None
        # masters in master_dtype (fp32, or bf16 updated by roundpipe.optim in fp32 and rounded as
        # master_rounding says: roundpipe/optim/rounding.py); checked before anything is converted
        check_master_dtype(self.master_dtype)
        check_rounding(self.master_rounding)
        if not isinstance(self.shard_optimizer, bool):
            raise TypeError(f"shard_optimizer must be True or False, got {self.shard_optimizer!r}")
        if self.shard_optimizer and self.process_group is None:
            raise ValueError("shard_optimizer=True needs process_group= (the ranks the optimizer state is split over)")
        if self.offload_dir is None and self.host_memory is not None:
            raise ValueError(f"host_memory={self.host_memory!r} needs offload_dir= (where the optimizer state that "
                             "does not fit goes); give both, or neither")
        if self.offload_dir is not None and self.shard_optimizer:
            raise ValueError("offload_dir= and shard_optimizer=True are not supported together")
        check_stall_timeout(self.stall_timeout)
        if self.compensation is not None and not isinstance(self.compensation, StalenessCompensation):
            raise TypeError(f"compensation must be a roundpipe.StalenessCompensation or None, got "
                            f"{type(self.compensation).__name__}")
        if self.device_step:
            check_device_step(self, devices, precision)
        object.__setattr__(self, "worker_devices", devices)
        object.__setattr__(self, "resolved_precision", precision)
        object.__setattr__(self, "_caps", caps)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The options, in declaration order: the keywords RoundPipe takes besides `layers`."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def options(self) -> dict[str, Any]:
        """Option name -> value as given (no copies): `RoundPipe(layers, **cfg.options())` builds the same engine."""
        return {name: getattr(self, name) for name in self.field_names()}

    @property
    def round_size(self) -> int:
        """Microbatches per round: microbatches_per_round, or the number of workers + 1."""
        return self.microbatches_per_round or len(self.worker_devices) + 1

    def device_caps(self) -> dict[str, int | None]:
        """Worker name -> the bytes it may hold (None: no cap); device_memory=None reads the GPUs' free memory now."""
        return dict(self._caps) if self._caps is not None else resolve_caps(None, self.worker_devices)


ENGINE_OPTIONS: tuple[str, ...] = EngineConfig.field_names()


def check_wrap_options(caller: str, arg_name: str, what: str, module: Any, options: dict[str, Any],
                       fixed: dict[str, str], extra_options: Sequence[str] = ()) -> None:
    """The checks every wrapper of a whole model (rp.hf.wrap, rp.diffusers.wrap) makes of its arguments before
    it cuts anything: `module` (argument `arg_name`) an nn.Module, `what` (e.g. "a diffusers transformer"), with
    every parameter on the CPU (ValueError); `options` (the engine options passed through) none of the `fixed`
    ones (option -> why the wrapper sets it: TypeError) and none that is no EngineConfig field (TypeError
    listing what `caller` takes: the engine's options but the fixed ones, then `extra_options`, its own)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{arg_name} must be {what} (an nn.Module), got {type(module).__name__}")
    given = [name for name in fixed if name in options]
    if given:
        one = len(given) == 1
        raise TypeError(f"{', '.join(given)} {'is' if one else 'are'} fixed by {caller} "
                        f"({'; '.join(fixed[name] for name in given)}); do not pass {'it' if one else 'them'}")
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        takes = ", ".join(o for o in ENGINE_OPTIONS if o not in fixed)
        own = f" and {', '.join(extra_options)}" if extra_options else ""
        raise TypeError(f"{caller} got unexpected keyword argument(s) {unknown}; it takes RoundPipe's options "
                        f"({takes}){own}")
    if any(p.device.type != "cpu" for p in module.parameters()):
        raise ValueError(f"{arg_name} must be on the CPU (roundpipe keeps every weight in host memory); build or "
                         "load it without device_map / .to('cuda')")


def check_device_step(cfg: EngineConfig, devices: list[torch.device], precision: Precision) -> None:
    """ValueError unless the options allow device_step=True (roundpipe/engine/step/device_step.py)."""
    why = []
    if len(devices) != 1:
        why.append(f"one worker (devices={cfg.devices!r} gives {len(devices)}: a layer's state would have to "
                   "follow the rotating dispatch)")
    if cfg.master_dtype != torch.float32:
        why.append(f"fp32 masters (master_dtype={cfg.master_dtype})")
    if precision.compute_dtype == torch.float16:
        why.append("no fp16 loss scaling (compute_dtype=torch.float16): use bfloat16 or float32")
    for name in ("process_group", "compensation", "offload_dir"):
        if getattr(cfg, name) is not None:
            why.append(f"no {name}= (given {getattr(cfg, name)!r})")
    if why:
        raise ValueError("device_step=True needs " + "; ".join(why))


def check_stall_timeout(value: Any) -> None:
    """TypeError/ValueError unless `value` is None or a finite number of seconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"stall_timeout={value!r} must be None (off) or a number of seconds, "
                        f"got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"stall_timeout={value!r} must be a finite number of seconds > 0 (None switches the "
                         "stall watchdog off)")


def engine_config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """The config of `RoundPipe(layers, **options)` or of `RoundPipe(layers, config=config)`; ValueError for both.

    `options` holds every field (RoundPipe's keywords): those left at their defaults do not count as given."""
    if config is None:
        return EngineConfig(**options)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a roundpipe.EngineConfig or None, got {type(config).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}
    given = sorted(name for name, v in options.items()
                   if not (v is defaults[name] or (type(v) is type(defaults[name]) and v == defaults[name])))
    if given:
        raise ValueError(f"config= and the option(s) {', '.join(given)} were both given; give the options in one "
                         f"place: dataclasses.replace(config, {given[0]}=...), or keywords without config=")
    return config
