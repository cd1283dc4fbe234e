"""One provider's training run for bench/gpu_bench.py, in a process of its own.

    python bench/gpu_providers.py SPEC_JSON        # prints one line: RESULT {...}

The parent (bench/gpu_bench.py) starts one of these per (workload, provider, cap) with a time limit,
so a hang, a crash or an out-of-memory kill becomes a row with the reason and the run goes on.  This
file imports neither our roundpipe nor any peer at module level: the published RoundPipe 0.1.1 is
also called `roundpipe`, and its subprocess sees only its own --target folder (checked: the module's
file must lie under it), never ours.  The process dies with its parent (PR_SET_PDEATHSIG): a device
call killed at its limit leaves no provider holding the GPU.

Every provider trains the same thing, as the published benchmark does (its benchmark/train.py):
random weights built from the config (on the meta device, then each parameter drawn on the GPU
from a generator seeded with the seed and its index: the same weights in every process), one random batch of token ids [batch, seq] reused every step, labels =
the ids (HF's shifted causal-LM loss, mean over tokens), bf16 compute with fp32 masters and fp32
Adam state on CUDA (fp32 throughout on CPU), `warmup` steps, then `steps` timed ones.  tokens/s is
batch * seq * steps over the timed steps' wall time (an asynchronous run's last update included);
the loss printed is the last step's (the first is kept beside it).  Our rows also measure the step's
exposed seconds per iteration (spec "exposed"; the parent asks it of ours-sync/async on 1.7B): the timed
steps' per-iteration seconds against as many iterations of forward_backward alone, at least 5 each way
(bench/gpu_measure.py: the estimator, its spread and "within noise"), and say which of our kernels ran
(Triton, or the PyTorch reference path and why), read after the steps.

Providers (the spec's "provider"):

    ours-sync / ours-async   rp.hf.wrap on the worker (cuda:0, or ["cpu"] dry), rp.optim.AdamW,
                             model.step(asynchronous=False / True); device_memory= the cap
    ours-device              ours-sync with device_step=True: the resident layers (as many as the cap
                             leaves room for; every layer in the dry run) updated on the worker
    torch                    the HF model on the device, autocast bf16, torch AdamW (fused on CUDA)
    torch-ckpt               the same with HF gradient checkpointing (one recompute per layer, as ours)
    fsdp2-offload            torch.distributed.fsdp.fully_shard per decoder layer and the root, one rank
                             (gloo + nccl on localhost), CPUOffloadPolicy, MixedPrecisionPolicy(bf16)
    deepspeed-zero-offload   deepspeed.initialize, ZeRO stage 2, offload_optimizer to the CPU (its CPU
                             Adam, JIT-built), bf16
    roundpipe-0.1.1          the published RoundPipe: wrap_model_to_roundpipe(use_sequential_preset=True),
                             its roundpipe.optim.Adam, its default asynchronous step, its own recompute
                             only (no HF checkpointing), its planner held to the cap (`run_published`)
    ours-maxseq              the longest sequence (batch 1) ours trains under the cap: bisection up to
                             1.25 x the planner's prediction, one full step per probe, within a time budget
    ours-predicted           the planner's prediction (meta device; its process sees no GPU)

    Flux-shaped LoRA rows (the spec's hf_config is a diffusers config.json, `_class_name` included):
    ours-async               rp.diffusers.wrap(transformer with a LoRA adapter), rp.optim.AdamW on the
                             adapters, asynchronous step; device_memory= the cap
    diffusers-offload        the same transformer and adapter in plain diffusers + PEFT, the frozen base
                             offloaded per module with accelerate's cpu_offload, diffusers' gradient
                             checkpointing, torch AdamW on the adapters on the GPU (`run_diffusers_offload`)

    build-cpu_adam           DeepSpeed's cpu_adam JIT-built (the prepare phase: out of the timed rows)
    build-published-adam     the published RoundPipe's Adam JIT-built, likewise (needs a GPU to import)

FSDP2 and DeepSpeed use HF gradient checkpointing, as ours recomputes the forward; the published RoundPipe
recomputes on its own (`run_published`).  Every optimizer is AdamW-alike with weight decay 0 (the published
Adam's default), lr from the spec.  The result carries the process's phases: import_s, init_s (the random weights), ready_s (start to the first step),
process_s: what the run plan's time estimate takes as the row's overhead.
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder is sys.path[0]; bench/ holds kernels.py, which transformers' hub_kernels
# imports as the HF `kernels` package (and which imports roundpipe: the peer's, in the peer's process).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
START = time.perf_counter()
PHASES: dict[str, float] = {}   # init_s (the model's initialisation), ready_s (process start to the first step)


def _load_sibling(name: str):
    """bench/<name>.py by its path (bench/ is off sys.path, above), once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


measure = _load_sibling("gpu_measure")   # pure Python: the exposed step's estimator, the kernels that ran
search = _load_sibling("gpu_search")     # the longest-sequence search and its prediction


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cap_device(spec: dict) -> None:
    """Holds this process to the spec's cap (bytes) of cuda:0 with torch's allocator fraction."""
    import torch

    if spec["device"] == "cuda" and spec.get("cap"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap"] / total), 0)


def build_model(spec: dict, dtype):
    """The workload's model with random weights from one seed, on the host; HF's sdpa attention.

    Each parameter is drawn from a generator seeded with (seed, its index) on the GPU where there is one
    (single-threaded host initialisation took ~20 s for 1.7B in fp32 and ~235 s for 8B in bf16) and
    copied into the host tensor: the same weights in every provider's process, whatever it does next."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = AutoConfig.for_model(**spec["hf_config"])
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):   # no initialisation pass; filled below
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device="cpu")
    where = "cuda" if spec["device"] == "cuda" else "cpu"
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.dim() >= 2:
                gen = torch.Generator(where).manual_seed(spec["seed"] * 100003 + i)
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=where).normal_(0.0, cfg.initializer_range,
                                                                                   generator=gen))
            else:
                p.fill_(1.0)   # the RMSNorm weights (these families have no biases)
    # non-persistent buffers (the rotary tables) were left empty: rebuild those modules from the config
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq"):
                setattr(parent, child_name, type(child)(config=child.config).to(dtype=child.inv_freq.dtype))
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        # the published benchmark/train_lora.py's adapter: r 32, alpha 16, every Linear but the head
        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=16, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    if where == "cuda":   # the initialisation's scratch is not the provider's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
    PHASES["init_s"] = PHASES.get("init_s", 0.0) + time.perf_counter() - t0
    return model


def batch(spec: dict):
    import torch

    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    return torch.randint(0, spec["hf_config"]["vocab_size"], (spec["batch"], spec["seq"]), generator=gen)


def iterations(fn, n: int, finish) -> tuple[list, list[float]]:
    """n calls fn(0..n-1) back to back, then finish(): their results and per-call seconds, each from the previous
    call's return to its own, the last one's to finish's (so they add up to the block's wall time; no sync in
    between, so an asynchronous step overlaps the next call as in training)."""
    marks, results = [time.perf_counter()], []
    for i in range(n):
        results.append(fn(i))
        marks.append(time.perf_counter())
    finish()
    marks[-1] = time.perf_counter()
    return results, [b - a for a, b in zip(marks, marks[1:])]


def timed(spec: dict, step, finish) -> dict:
    """Warm-up steps, then timed ones; step(i) returns the loss (a tensor or float)."""
    PHASES.setdefault("ready_s", time.perf_counter() - START)
    PHASES.setdefault("ready_cpu_s", time.process_time())   # the same in CPU seconds: what load does not stretch
    losses = [step(i) for i in range(spec["warmup"])]
    finish()
    more, seconds = iterations(step, spec["steps"], finish)
    elapsed = sum(seconds)
    values = [float(v) for v in losses + more]
    return {"tokens_per_s": spec["batch"] * spec["seq"] * spec["steps"] / elapsed, "first_loss": values[0],
            "final_loss": values[-1], "step_s": elapsed / spec["steps"], "iteration_s": seconds}


def run_ours(spec: dict) -> dict:
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    import roundpipe as rp

    cuda = spec["device"] == "cuda"
    hf = build_model(spec, torch.bfloat16 if spec.get("lora") else torch.float32)
    options = {"devices": ["cuda:0"] if cuda else ["cpu"], "device_memory": spec.get("cap")}
    if cuda:
        options["compute_dtype"] = torch.bfloat16
    if spec.get("lora"):
        options["quantize"] = "nf4"
    if spec.get("state") == "8bit":
        options["master_dtype"] = torch.bfloat16
    if spec["provider"] == "ours-device":   # the device step (roundpipe/engine/step/device_step.py)
        options["device_step"] = True
        if not cuda:   # CPU workers have no cap to size the resident prefix from: every layer
            options["resident_layers"] = hf.config.num_hidden_layers + 2
    model = rp.hf.wrap(hf, **options)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (rp.optim.AdamW8bit if spec.get("state") == "8bit" else rp.optim.AdamW)(params, lr=spec["lr"], weight_decay=0.0)
    asynchronous = spec["provider"] == "ours-async"
    ids = batch(spec)

    def step(_):
        loss = model.forward_backward(input_ids=ids, labels=ids)
        model.step(opt, asynchronous=asynchronous)
        return loss

    def alone(_):   # no step: the gradients accumulate, which does not change the timing
        return model.forward_backward(input_ids=ids, labels=ids)

    try:
        out = timed(spec, step, model.synchronize)
        if spec.get("exposed", True):
            out["exposed_step"] = exposed_step(out["iteration_s"], step, alone, model.synchronize)
        worker = next(iter(model.memory_stats()["workers"].values()))   # resident weights (docs/planner.md)
        out["kept_layers"] = worker.get("device_step_layers", worker["resident_layers"])
        out["kept_graphs"] = sum(b - a + 1 for a, b in model.memory_stats()["kept_graphs"])   # layers not recomputed
        out["kernels_patched"] = getattr(model, "kernels_patched", None)
        return out
    finally:
        model.close()


def exposed_step(with_step: list[float], step, alone, finish) -> dict:
    """The optimizer step's exposed seconds per iteration (bench/gpu_measure.py exposed_estimate): the timed steps'
    per-iteration seconds (a fresh block of EXPOSED_SAMPLES where the row timed fewer) against as many iterations
    of forward_backward alone, each block after one untimed call."""
    n = max(measure.EXPOSED_SAMPLES, len(with_step))

    def block(fn) -> list[float]:
        fn(0)
        finish()
        return iterations(fn, n, finish)[1]

    if len(with_step) < n:
        with_step = block(step)
    return measure.exposed_estimate(with_step, block(alone))


def run_torch(spec: dict) -> dict:
    import torch

    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda:0" if cuda else "cpu")
    hf = build_model(spec, torch.float32).to(dev).train()
    if spec["provider"] == "torch-ckpt":   # HF's gradient checkpointing: one recompute per layer, as ours
        hf.gradient_checkpointing_enable()
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=spec["lr"], weight_decay=0.0,
                            fused=cuda)
    ids = batch(spec).to(dev)

    def step(_):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return timed(spec, step, torch.cuda.synchronize if cuda else lambda: None)


def _one_rank_env() -> None:
    import socket

    with socket.socket() as s:   # a free port on the loopback address for the one-rank group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def run_fsdp2(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _one_rank_env()
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    hf = build_model(spec, torch.float32)
    hf.gradient_checkpointing_enable()
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=True),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for layer in hf.model.layers:
        fully_shard(layer, **kw)
    fully_shard(hf, **kw)
    opt = torch.optim.AdamW(hf.parameters(), lr=spec["lr"], weight_decay=0.0)   # CPU-resident state: the step runs on the host
    ids = batch(spec).cuda()

    def step(_):
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        return timed(spec, step, torch.cuda.synchronize)
    finally:
        dist.destroy_process_group()


def run_deepspeed(spec: dict) -> dict:
    import torch

    _one_rank_env()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/roundpipe-peers/torch-extensions")
    import deepspeed

    hf = build_model(spec, torch.float32)
    hf.gradient_checkpointing_enable()
    config = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(model=hf, model_parameters=[p for p in hf.parameters() if p.requires_grad],
                                           config=config)
    ids = batch(spec).to(engine.device)

    def step(_):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return timed(spec, step, torch.cuda.synchronize)


def run_published(spec: dict) -> dict:
    """The published RoundPipe 0.1.1 as its benchmark/train.py runs it (preset, its Adam, fp32 optimizer state), with
    two settings made alike to the other providers, both read from its source (roundpipe/run.py, scheduler.py):

    Recompute: its own only, no HF gradient checkpointing.  Its forward runs every layer under torch.no_grad and
    keeps only each stage's input (run_forward); each backward stage reruns its layers' forward with autograd and
    then backpropagates (run_backward): checkpointing at the grain of a stage, as ours ("stage", the default of
    both).  HF checkpointing on top wraps each layer of that rerun in torch.utils.checkpoint, whose backward runs
    the layer's forward a third time; its benchmark/train.py does not enable it either.
    Plan: `plan_against_cap` (the cap, not the card's free memory)."""
    published_isolated(spec["peer_path"])
    import torch

    import roundpipe as published  # the peer (checked above), never ours

    hf = build_model(spec, torch.bfloat16)
    m = spec.get("microbatches") or 2
    config = published.RoundPipeRunConfig(num_microbatch=m, recompute_grain="stage")
    model = published.wrap_model_to_roundpipe(hf, optim_dtype=torch.float32, use_sequential_preset=True,
                                              model_run_config=config)
    planned = plan_against_cap(published.ModelExecutePlan, spec.get("cap"))
    opt = published.optim.Adam(model.optim_parameters(), lr=spec["lr"], weight_decay=0.0)
    ids = batch(spec)
    mask = torch.ones_like(ids)

    def step(_):
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids,
                                                    "return_logits": False},
                                      loss_fn=lambda outputs, _labels: outputs.loss / m)
        model.step(lambda: (opt.step(), opt.zero_grad(), None)[-1])
        return loss.detach().float().cpu()

    def finish():
        model.synchronize()
        if spec["device"] == "cuda":   # (a CPU run: tests/bench/test_gpu_providers.py, a stand-in of the peer)
            torch.cuda.synchronize()

    return {**timed(spec, step, finish), "planned_gib": planned}


PLAN_SHARE = 0.6   # the published planner's share of a card's memory for its stages' weights (scheduler.py)


def plan_against_cap(plan_class, cap: int | None) -> float | None:
    """Makes the published planner plan against `cap` bytes; returns the GiB it now plans its stages in (None: the
    card's own, for a full-card row).

    Its ModelExecutePlan.auto takes `model_memory_limit` (GiB for the stages' weights and gradients, each stage at
    most half of it), defaulting to 0.6 x get_min_gpu_memory(), the card's free memory plus torch's reserved
    bytes, read once when its scheduler module is imported (a default argument); its forward and forward_backward
    call auto() without it, every call (re-planning from the layers' measured times), and no environment variable
    or module constant reaches it.  The one setting that does, a fixed RoundPipeRunConfig(execute_plan=...),
    would freeze the stage cut at the first call's size-based estimate.  set_per_process_memory_fraction does not
    change what torch.cuda.mem_get_info reports, so at 24 GiB on an 80 GB card it would plan stages for ~47 GiB.
    So auto() is wrapped to pass 0.6 x the cap where no limit is given: the share its default takes of a card,
    taken of the cap (its recursive call for several models goes through the wrapper too)."""
    if not cap:
        return None
    limit = PLAN_SHARE * cap / (1 << 30)
    auto = plan_class.auto   # bound to the class: the published classmethod

    def capped(run_type, *models, **options):
        options.setdefault("model_memory_limit", limit)
        return auto(run_type, *models, **options)

    plan_class.auto = staticmethod(capped)
    return limit


# ---- the Flux LoRA rows: one diffusion transformer, one adapter, one batch for both providers

# rank 16 on every attention projection (roundpipe/diffusers/context.py LORA_TARGETS, repeated here so that the
# peer's process reads nothing of ours): diffusers' DreamBooth LoRA scripts for Flux target these
DIT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
DIT_TEXT = {"cuda": 512, "cpu": 8}   # text tokens: Flux's T5 length; a few in the dry run


def build_transformer(spec: dict, dtype):
    """The spec's diffusers transformer with random weights from one seed (drawn as build_model draws them) in
    `dtype` on the host, and a LoRA adapter (fp32, the base frozen): what both providers train."""
    import diffusers
    import torch
    from peft import LoraConfig

    t0 = time.perf_counter()
    cfg = dict(spec["hf_config"])
    cls = getattr(diffusers, cfg.pop("_class_name"))
    with torch.device("meta"):
        model = cls.from_config(cfg)
    model.to_empty(device="cpu")
    model.to(dtype)
    where = "cuda" if spec["device"] == "cuda" else "cpu"
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            gen = torch.Generator(where).manual_seed(spec["seed"] * 100003 + i)
            p.copy_(torch.empty(p.shape, dtype=p.dtype, device=where).normal_(0.0, 0.02, generator=gen))
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=DIT_LORA_TARGETS))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()   # diffusers' cast_training_params: fp32 adapters over a low-precision base
    if where == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
    PHASES["init_s"] = PHASES.get("init_s", 0.0) + time.perf_counter() - t0
    return model


def dit_batch(spec: dict, model, dtype) -> tuple[dict, object]:
    """Flux's inputs for `batch` samples of seq latent tokens (a square image of 16 sqrt(seq) px) at noisy
    latents, and the flow-matching target (noise - x0), seeded: diffusers' train_dreambooth_lora_flux.py's."""
    import torch

    cfg, b, side = model.config, spec["batch"], int(round(spec["seq"] ** 0.5))
    if type(model).__name__ != "FluxTransformer2DModel" or side * side != spec["seq"]:
        raise ValueError(f"the DiT rows train a Flux transformer on a square latent, got {type(model).__name__}, "
                         f"seq={spec['seq']}")
    text = DIT_TEXT[spec["device"]]
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    rand = lambda *shape: torch.randn(*shape, generator=gen)   # noqa: E731
    x0, noise, sigma = rand(b, side * side, cfg.in_channels), rand(b, side * side, cfg.in_channels), torch.rand(b, generator=gen)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] += torch.arange(side)[:, None]
    ids[..., 2] += torch.arange(side)[None, :]
    s = sigma[:, None, None]
    inputs = {"hidden_states": ((1 - s) * x0 + s * noise).to(dtype), "encoder_hidden_states": rand(b, text, cfg.joint_attention_dim).to(dtype),
              "pooled_projections": rand(b, cfg.pooled_projection_dim).to(dtype), "timestep": sigma.to(dtype),
              "img_ids": ids.reshape(-1, 3).to(dtype), "txt_ids": torch.zeros(text, 3, dtype=dtype)}
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((b,), 3.5, dtype=dtype)
    return inputs, noise - x0


def run_ours_dit(spec: dict) -> dict:
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    import roundpipe as rp
    import roundpipe.diffusers as rpd

    cuda = spec["device"] == "cuda"
    transformer = build_transformer(spec, torch.bfloat16 if cuda else torch.float32)
    options = {"devices": ["cuda:0"] if cuda else ["cpu"], "device_memory": spec.get("cap")}
    if cuda:
        options["compute_dtype"] = torch.bfloat16
    model = rpd.wrap(transformer, **options)
    opt = rp.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"], weight_decay=0.0)
    inputs, target = dit_batch(spec, transformer, torch.float32)

    def step(_):
        loss = model.forward_backward(target=target, **inputs)
        model.step(opt, asynchronous=spec["provider"] == "ours-async")
        return loss

    try:
        return timed(spec, step, model.synchronize)
    finally:
        model.close()


def run_diffusers_offload(spec: dict) -> dict:
    """Plain diffusers + PEFT with the frozen base in host memory, uploaded per module as it runs.

    Why this peer and not a pipeline's offload switch: `enable_model_cpu_offload` moves a whole model to the GPU
    for its forward, and FLUX.1-dev's 12B transformer is 24 GB in bf16, past the 24 GiB cap by itself;
    `enable_sequential_cpu_offload` is accelerate's `cpu_offload` on every module, whose hooks re-materialise a
    module's parameters from their host copy at each call, so the adapters' gradients would land on
    throw-away device copies and never train.  So: accelerate's `cpu_offload` on each module whose own
    parameters are all frozen (the base Linears under the LoRA wrappers, norms, embedders), the adapters
    resident on the GPU with torch AdamW, and diffusers' gradient checkpointing per block (without it
    autograd keeps every block's uploaded weights alive until backward: the whole base on the device)."""
    import torch
    from accelerate import cpu_offload

    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    transformer = build_transformer(spec, dtype).train()
    transformer.enable_gradient_checkpointing()
    adapters = []
    for module in transformer.modules():
        own = list(module.parameters(recurse=False))
        if own and any(p.requires_grad for p in own):
            module.to(dev)   # an adapter's lora_A / lora_B: resident
            adapters += [p for p in own if p.requires_grad]
        elif own and not list(module.children()):
            cpu_offload(module, execution_device=dev)
    opt = torch.optim.AdamW(adapters, lr=spec["lr"], weight_decay=0.0, fused=cuda)
    inputs, target = dit_batch(spec, transformer, dtype)
    inputs = {k: v.to(dev) for k, v in inputs.items()}
    target = target.to(dev)

    def step(_):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            pred = transformer(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return timed(spec, step, torch.cuda.synchronize if cuda else lambda: None)


DIT_RUNNERS = {"ours-async": run_ours_dit, "ours-sync": run_ours_dit, "diffusers-offload": run_diffusers_offload}


def published_isolated(peer: str) -> None:
    """Raises unless `import roundpipe` in this process would load the peer from its own folder."""
    import importlib.util

    found = importlib.util.find_spec("roundpipe")
    origin = found.origin if found else None
    if not origin or not Path(origin).resolve().is_relative_to(Path(peer).resolve()):
        raise RuntimeError(f"isolation: 'roundpipe' resolves to {origin}, not under the peer folder {peer}")


def build_published_adam(spec: dict) -> dict:
    """The published RoundPipe's CPU Adam, JIT-built here (-march=native, ninja) so its row does not pay it.
    Its package opens a CUDA context per GPU at import: a GPU is needed even to build it."""
    published_isolated(spec["peer_path"])
    from roundpipe.optim.optim_builder import load_optim_function  # the peer (checked above)

    load_optim_function("adam")
    return {"built": "roundpipe_optim_adam"}


def build_cpu_adam(spec: dict) -> dict:
    """DeepSpeed's cpu_adam, JIT-built into TORCH_EXTENSIONS_DIR so its row finds it built."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/roundpipe-peers/torch-extensions")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()
    return {"built": "cpu_adam"}


RUNNERS = {"build-published-adam": build_published_adam, "build-cpu_adam": build_cpu_adam, "torch-ckpt": run_torch, "ours-sync": run_ours, "ours-async": run_ours, "ours-device": run_ours, "torch": run_torch,
           "fsdp2-offload": run_fsdp2, "deepspeed-zero-offload": run_deepspeed, "roundpipe-0.1.1": run_published, "ours-maxseq": lambda spec: search.run_maxseq(spec, build_model),
           "ours-predicted": search.run_prediction}


def run(spec: dict) -> dict:
    import torch

    PHASES["import_s"] = time.perf_counter() - START
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    if spec["provider"] not in ("ours-predicted", "build-cpu_adam", "build-published-adam"):
        cap_device(spec)   # the prediction and the builds open no CUDA context (the children need the card)
    dit = "_class_name" in spec["hf_config"]   # a diffusers config.json: the Flux LoRA rows
    out = (DIT_RUNNERS if dit else RUNNERS)[spec["provider"]](spec)
    if spec["device"] == "cuda" and torch.cuda.is_initialized():
        out["device_peak"] = torch.cuda.max_memory_allocated(0)
    if spec["provider"].startswith("ours") and spec["provider"] != "ours-predicted":   # after the steps: what ran
        out.update(measure.kernels_ran())
        if out.get("kernels_patched") is not None:
            out["kernels_detail"] += f"; {out['kernels_patched']} HF modules patched"
    return {**out, **PHASES}


def die_with_parent(parent: int | None) -> None:
    """SIGKILL for this process when the benchmark that started it dies (Linux's PR_SET_PDEATHSIG).  The
    process runs in a session of its own (so a time limit kills it with what it started), which a device
    call's end does not kill: without this, a call killed at its limit would leave a provider on the GPU."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:   # the parent died before the call above
        os._exit(1)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    die_with_parent(spec.get("parent"))
    try:
        out = run(spec)
    except Exception as exc:   # noqa: BLE001 -- any failure of a provider is its row's reason, never the run's end
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        kind = "out of memory" if "OutOfMemory" in type(exc).__name__ else type(exc).__name__
        out = {"error": f"{kind}: {first}"}
    out["peak_rss"] = _peak_rss()
    out["process_s"] = time.perf_counter() - START
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
