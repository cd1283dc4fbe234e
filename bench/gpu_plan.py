"""The GPU benchmark's run plan: which rows, in which order, in which of two device calls, and what each costs.

A lent GPU gives 15 minutes of device time, the machine's start (1-2 min) and idle time included, and 10
minutes a call.  The plan is two calls on one warm machine, each held to 5 minutes so a failed one can be
run again:

    call 1  prepare: /proc/meminfo, the builds in parallel (our _C, DeepSpeed's cpu_adam, the published
            RoundPipe's Adam), a tiny CUDA smoke of every provider and the cuda-marked engine tests;
            then the key rows: ours sync and async at 24 GiB, plain PyTorch at 24 GiB (does not fit
            the 1.7B model: a row saying so) and on the full card, with and without gradient
            checkpointing, the published RoundPipe at 24 GiB; last, the Flux LoRA peer row
    call 2  the builds that are missing (none on a warm machine), then FSDP2, DeepSpeed, ours' device
            step at 24 GiB, ours on the full card, the longest sequence and its prediction, LoRA, 8B,
            and a Flux-shaped diffusion transformer's LoRA with ours (its peer, diffusers with accelerate's
            per-module CPU offload, bench/gpu_providers.py `run_diffusers_offload`, ends call 1)

`expected_seconds` is what a case costs on the device (16 cores, one H100), from the process overhead a
dry run measured here (imports, the engine's set-up) plus a model of the GPU part (below); `--dry`
prints each call's sum and fails when one exceeds `CALL_LIMIT_S`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

from roundpipe.diffusers.shapes import FLUX_DEV, DiTShape
from roundpipe.shapes import LLAMA_3_1_8B, QWEN3_1_7B, DecoderShape

GiB = 1 << 30
CALL_LIMIT_S = 300.0   # one call's share of the 15 minutes: two calls, a rerun of one, the start and idle time
PROVIDERS = ("ours-sync", "ours-async", "ours-device", "torch", "torch-ckpt", "fsdp2-offload",
             "deepspeed-zero-offload", "roundpipe-0.1.1")
PEERS = ("fsdp2-offload", "deepspeed-zero-offload", "roundpipe-0.1.1")
TINY = dict(hidden=64, intermediate=128, layers=2, vocab=256, heads=4, kv_heads=2, head_dim=16)
# A Flux-shaped transformer small enough for call 2's budget: FLUX.1-dev's blocks at its width (24 heads of 128,
# T5 width 4096, guidance), 2 double-stream + 4 single-stream blocks of its 19 + 38 (1.26B parameters), trained
# with LoRA at 512 x 512 px (1,024 latent tokens + 512 text) over a frozen bf16 base.
FLUX_SMALL = DiTShape("Flux-shaped 2+4 blocks", "flux-small", FLUX_DEV.repo, FLUX_DEV.class_name,
                      dict(FLUX_DEV.config, num_layers=2, num_single_layers=4))
FLUX_TINY = DiTShape("tiny Flux", "tiny-flux", FLUX_DEV.repo, FLUX_DEV.class_name,
                     dict(FLUX_DEV.config, num_layers=1, num_single_layers=2, attention_head_dim=16,
                          num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12,
                          axes_dims_rope=[4, 6, 6], in_channels=8))
DIT_PROVIDERS = ("ours-async", "diffusers-offload")   # the Flux LoRA rows
# Their parameter counts, as diffusers 0.42.1 builds them (tests/bench/test_gpu_run_plan.py checks): the plan
# never imports diffusers, which the GPU image lacks (static_skip gives those rows that reason)
DIT_PARAMETERS = {"flux-small": 1_310_154_816, "tiny-flux": 92_872}


def parameters(shape: DecoderShape | DiTShape) -> int:
    """A workload's parameter count, without diffusers for the DiT shapes."""
    return DIT_PARAMETERS[shape.key] if isinstance(shape, DiTShape) else shape.parameters()


@dataclass(frozen=True)
class Workload:
    """A model and how it trains; `shape` gives the config and the parameter count."""

    name: str
    shape: DecoderShape | DiTShape
    batch: int
    seq: int                  # tokens per sample (a DiT: latent tokens, (H / 16) x (W / 16); text beside)
    lora: bool = False        # LoRA over a frozen 4-bit (NF4) base
    state: str = "fp32"       # ours' host state: "fp32" (AdamW, fp32 masters) or "8bit" (AdamW8bit, bf16 masters)


@dataclass(frozen=True)
class Case:
    workload: Workload
    provider: str             # one of PROVIDERS, or ours-maxseq / ours-predicted
    cap: int | None           # device bytes the provider is held to; None: the full card
    timeout: float            # seconds for its process
    call: int = 1             # the device call it runs in (1 or 2)


def workloads(dry: bool) -> tuple[Workload, Workload, Workload]:
    """(the 1.7B full fine-tuning, the 8B LoRA, the 8B full fine-tuning), tiny in a dry run."""
    if dry:
        llama = DecoderShape("tiny-llama", **TINY)
        return (Workload("tiny-qwen3", DecoderShape("tiny-qwen3", tied=True, model_type="qwen3", **TINY), 4, 32),
                Workload("tiny-llama-lora", llama, 4, 32, lora=True),
                Workload("tiny-llama-8bit", llama, 4, 32, state="8bit"))
    return (Workload("qwen3-1.7b", QWEN3_1_7B, 4, 2048), Workload("llama-3.1-8b-lora", LLAMA_3_1_8B, 4, 2048, lora=True),
            Workload("llama-3.1-8b", LLAMA_3_1_8B, 4, 2048, state="8bit"))


def dit_workload(dry: bool) -> Workload:
    """The Flux LoRA workload: 1 x 512 x 512 px (1,024 latent tokens), tiny in a dry run (4 x 4 latent tokens)."""
    if dry:
        return Workload("tiny-flux-lora", FLUX_TINY, 1, 16, lora=True)
    return Workload("flux-small-lora", FLUX_SMALL, 1, 1024, lora=True)


def is_dit(case: Case) -> bool:
    return isinstance(case.workload.shape, DiTShape)


def plan(dry: bool, cap: int, timeout: float) -> list[Case]:
    """Every case in the order it runs; the same list dry and on the GPU (only the sizes differ)."""
    qwen, lora, big = workloads(dry)
    search = replace(qwen, batch=1)
    first = [Case(qwen, "ours-sync", cap, timeout), Case(qwen, "ours-async", cap, timeout),
             Case(qwen, "torch", cap, timeout), Case(qwen, "torch", None, timeout),
             Case(qwen, "torch-ckpt", None, timeout), Case(qwen, "roundpipe-0.1.1", cap, timeout)]
    second = [Case(qwen, "ours-device", cap, timeout), Case(qwen, "fsdp2-offload", cap, timeout),
              Case(qwen, "deepspeed-zero-offload", cap, timeout)]
    second += [Case(search, "ours-maxseq", cap, timeout), Case(search, "ours-predicted", cap, timeout)]
    second += [Case(lora, p, cap, timeout) for p in ("ours-async", "torch", *PEERS)]
    second += [Case(big, p, cap, timeout * 1.5) for p in ("ours-async", *PEERS)]
    # The Flux LoRA pair, one row a call: both rows in call 2 took it to 301 s in the dry estimate (each row is
    # a process importing diffusers and PEFT, ~8.5 CPU-s here, 2026-12-07), so the peer ends call 1 (259 -> ~271 s)
    # and ours runs in call 2 (~273 -> ~285 s), before the full-card row a spent budget may cut.
    first += [Case(dit_workload(dry), "diffusers-offload", cap, timeout)]
    second += [Case(dit_workload(dry), "ours-async", cap, timeout)]
    second += [Case(qwen, "ours-async", None, timeout)]   # last: the one a spent budget may cut
    return first + [replace(c, call=2) for c in second]


# ---- what a case costs on the device (16 cores, one H100), besides the process overhead measured dry
#
# tokens/s per provider for the 1.7B model at 4 x 2048 tokens, estimated (none measured on this engine
# yet; the first GPU run replaces these with its own numbers in the table): the published system's
# 8,881 tokens/s on one RTX 4090 (the design card, section 4) and, for ours, a host step of ~28 B/param of memory
# traffic at ~40 GB/s (1.2 s for 1.7B, hidden by the asynchronous step) plus ~0.6 s of compute and PCIe.
TOKENS_PER_S = {"ours-sync": 4000, "ours-async": 7000, "ours-device": 5000, "torch": 20000, "torch-ckpt": 15000,
                "fsdp2-offload": 1500, "deepspeed-zero-offload": 3500, "roundpipe-0.1.1": 6000,
                "diffusers-offload": 2000}   # per-module pageable uploads, twice (forward, recompute)
# seconds a provider spends before its first step beyond the imports: the CUDA context, the model's random
# initialisation on the GPU and its copy to the host (~7 GB at ~10 GB/s for 1.7B in fp32), DeepSpeed's and
# FSDP2's engine set-up, the published system's torch.compile of its fused functions (its Adam prebuilt)
SETUP_S = {"ours-sync": 5, "ours-async": 5, "ours-device": 6, "torch": 3, "torch-ckpt": 3, "fsdp2-offload": 10,
           "deepspeed-zero-offload": 15, "roundpipe-0.1.1": 35, "diffusers-offload": 5}
# the prepare phase's parts on 16 cores: our _C (~60 s, the 530-565 s one-shot count less its
# budget), DeepSpeed's cpu_adam (162 s on 2 cores, ~35-50 expected on 16) and the published Adam (37 s
# on 2 cores) build in parallel; then the smokes (one process each, in parallel) and the cuda tests
PREPARE_S = {"build-_C": 60.0, "build-cpu_adam": 50.0, "build-published-adam": 15.0, "smoke": 25.0,
             "cuda-tests": 45.0, "check-builds": 10.0}
CUDA_TESTS_LIMIT_S = 60.0   # the cuda-marked engine tests in call 1; what they leave undone says so in the log
DIT_SETUP_S = 3.0   # the Flux rows' set-up (gpu_seconds)
MAXSEQ_S = 20.0   # the longest-sequence search's own budget (the bracket found by then is its row; a probe whose
                  # estimated seconds would pass it is not started, bench/gpu_measure.py)
SHELL_S = {1: 15.0, 2: 5.0}   # scripts/gpu-bench.sh's prerequisites and the peers' installs (done in call 1)
EXPOSED_STEPS = 7   # ours-sync/async on 1.7B: 1 untimed + 6 forward_backward alone against the 6 timed steps


def steps_of(case: Case, warmup: int, steps: int) -> tuple[int, int, bool]:
    """(warm-up steps, timed steps, measure the exposed step) of a case: the 8B rows take fewer steps (each
    is seconds of host work), and only the 1.7B rows of ours-sync and ours-async measure the exposed step."""
    big = parameters(case.workload.shape) > 4 * QWEN3_1_7B.parameters()
    if is_dit(case):   # the Flux rows: call 2's last seconds
        return min(warmup, 1), min(steps, 3), False
    if big:
        warmup, steps = min(warmup, 2), min(steps, 3)
    elif case.provider in ("fsdp2-offload", "deepspeed-zero-offload"):   # seconds of host Adam a step
        warmup, steps = min(warmup, 2), min(steps, 4)
    return warmup, steps, case.provider in ("ours-sync", "ours-async") and not case.workload.lora and not big


def gpu_seconds(case: Case, warmup: int = 2, steps: int = 6) -> float:
    """The GPU part of a full-size case: set-up and its steps at the estimated rate."""
    w, p = case.workload, case.provider
    scale = parameters(w.shape) / QWEN3_1_7B.parameters()
    if p == "ours-maxseq":   # bisection up to 1.25 x the prediction: a fresh wrap and one long step a probe
        return MAXSEQ_S
    base = p if p in TOKENS_PER_S else "ours-async"
    rate = TOKENS_PER_S[base] / scale * (1.5 if w.lora else 1.0)   # LoRA: no weight gradients, no big step
    warm, timed, exposed = steps_of(case, warmup, steps)
    n = warm + timed + (EXPOSED_STEPS if exposed else 0)
    if is_dit(case):   # bf16 base, no NF4: the CUDA context and a 2.6 GB copy (SETUP_S' 5 s copies 7 GB)
        init = DIT_SETUP_S
    else:
        init = (2.0 if w.lora else 1.0) * SETUP_S[base] * max(1.0, scale / 2)   # LoRA: NF4 quantisation too
    return init + n * w.batch * w.seq / rate


def prepare_seconds(call: int) -> float:
    """The prepare phase's wall time: the builds in parallel, then smokes and tests beside each other."""
    if call != 1:
        return PREPARE_S["check-builds"]   # a warm machine keeps the builds: loading them is all
    builds = max(PREPARE_S["build-_C"], PREPARE_S["build-cpu_adam"], PREPARE_S["build-published-adam"])
    return max(builds + PREPARE_S["smoke"], PREPARE_S["build-_C"] + PREPARE_S["cuda-tests"])


HOST_BYTES = {"ours": 18.0, "ours-8bit": 7.0, "torch": 4.0, "torch-ckpt": 4.0, "fsdp2-offload": 16.0,
              "deepspeed-zero-offload": 18.0, "roundpipe-0.1.1": 18.0, "diffusers-offload": 16.0}
# Host bytes per trainable parameter (docs/architecture.md, host-resident state): fp32 master 4 + Adam m, v 8 +
# upload copy and gradient landing; 8-bit state with bf16 masters ~7; FSDP2's offload keeps fp32 params, grads
# and Adam state on the host (16); DeepSpeed's fp32 partitions and 0.1.1's fp32 optimizer copies likewise.
HOST_OVERHEAD = 4 * GiB      # interpreter, torch, transformers, CUDA context's host side
DEVICE_HOST_BYTES = 128 * GiB   # the lent machine's memory, for the plan's time estimate


def static_skip(case: Case, dry: bool, host_available: int) -> str | None:
    """Why `case` cannot run whatever is installed (support, host or device bytes), or None."""
    w, p = case.workload, case.provider
    n = parameters(w.shape)
    if is_dit(case) and not dry and importlib.util.find_spec("diffusers") is None:
        return ("not installed here: diffusers is absent from the GPU image (carry its py3-none-any wheel, "
                "its other requirements are there)")
    if w.lora and p in PEERS:
        return "not supported here: LoRA over a 4-bit (NF4) base needs bitsandbytes, absent from the GPU image"
    if w.lora and p.startswith("torch"):
        return "not supported: plain PyTorch has no NF4 Linear (bitsandbytes absent from the GPU image)"
    name = "ours-8bit" if p.startswith("ours") and w.state == "8bit" else "ours" if p.startswith("ours") else p
    trainable = n // 100 if w.lora else n    # LoRA: the adapters (~1%), the base frozen
    base = n * 2.6 if w.lora else 0          # bf16 build, then NF4 (0.52 B/param) kept
    need = trainable * HOST_BYTES[name] + base + HOST_OVERHEAD
    if host_available and need > 0.9 * host_available and p != "ours-predicted":
        return (f"host state does not fit: ~{need / GiB:.0f} GiB ({HOST_BYTES[name]:g} B/param for {n / 1e9:.2f}B "
                f"params) > 90% of {host_available / GiB:.0f} GiB available")
    if p == "torch" and not dry and not w.lora and case.cap and n * 16 > case.cap:
        return (f"does not fit the cap: fp32 weights, grads and Adam state alone are {n * 16 / GiB:.1f} GiB "
                f"> {case.cap / GiB:.0f} GiB")
    return None


def expected_seconds(cases: list[Case], overhead: dict[tuple, float], warmup: int = 2,
                     steps: int = 6) -> dict[int, dict]:
    """Per call: {"shell", "prepare", "rows", "total"} seconds on the device, for the full-size counterparts
    of `cases` (a dry plan or the full one).  `overhead[key]` is the process overhead (imports and set-up
    before the first step) a dry run measured for that case; others get the median of those measured, or
    8 s.  A case skipped on the device (static_skip with its 128 GiB) costs nothing."""
    measured = sorted(overhead.values())
    default = measured[len(measured) // 2] if measured else 8.0
    out: dict[int, dict] = {}
    for call in (1, 2):
        rows = 0.0
        for c in (c for c in cases if c.call == call):
            big = full_size(c)
            if static_skip(big, False, DEVICE_HOST_BYTES) or c.provider == "ours-predicted":
                continue   # no process, or one beside the others from the call's start
            rows += overhead.get(key(c), default) + min(gpu_seconds(big, warmup, steps), big.timeout)
        prepare = prepare_seconds(call)
        out[call] = {"shell": SHELL_S[call], "prepare": prepare, "rows": rows, "total": SHELL_S[call] + prepare + rows}
    return out


def full_size(case: Case) -> Case:
    """The full-size case a dry case stands for (the dry plan mirrors the full one, position for position)."""
    dry_list, full_list = plan(True, 24 * GiB, 100.0), plan(False, 24 * GiB, 100.0)
    for d, f in zip(dry_list, full_list):
        if (d.workload.name, d.provider, d.cap is None, d.call) == (case.workload.name, case.provider,
                                                                    case.cap is None, case.call):
            return f
    return case


def key(case: Case) -> tuple:
    return (case.workload.name, case.provider, cap_label(case.cap))


def cap_label(cap: int | None) -> str:
    return "full" if cap is None else f"{cap / GiB:g}GiB" if cap >= GiB else f"{cap / (1 << 20):g}MiB"
