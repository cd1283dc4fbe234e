"""End to end: a wrapped Hugging Face model (rp.hf.wrap) against plain HF training on the same machine.

Qwen3-shaped random models (tied embeddings, built with from_config; nothing is downloaded):

    model        hidden  layers  heads/kv  ffn    vocab    params   where
    cpu-tiny     128     4       4/2       384    4096     ~1.3M    CPU (default without a GPU)
    cpu-small    256     8       8/4       768    16384    ~10M     CPU
    qwen3-0.6b   1024    28      16/8      3072   151936   ~0.6B    CUDA (default with a GPU)
    qwen3-1.7b   2048    28      16/8      6144   151936   ~1.7B    CUDA
    qwen3-4b     2560    36      32/8      9728   151936   ~4.0B    CUDA

Providers, each in a fresh subprocess (so its peak RSS is its own), same batches:

    hf                plain transformers training: model(**batch, labels).loss.backward(), torch AdamW
                      (fused on CUDA), one device; fp32 on CPU, fp32 weights + bf16 autocast on CUDA
    roundpipe sync    rp.hf.wrap on the workers (every GPU, else one CPU worker), rp.optim.AdamW,
                      synchronous step (trains exactly like hf); compute dtype bf16 on CUDA, fp32 on CPU
    roundpipe async   the same with the one-step-stale asynchronous step
    roundpipe device  roundpipe sync with device_step=True on one worker: every layer's fp32 masters,
                      Adam state and gradients on it, updated there (roundpipe/engine/step/device_step.py);
                      with a GPU as many layers as its free memory leaves room for
    deepspeed         ZeRO-2 with the optimizer offloaded to the CPU (ZeRO-Offload), bf16, one GPU;
                      only with a GPU and a deepspeed importable from --peer-path /
                      $ROUNDPIPE_PEER_PATH, a separate folder as in bench/cpu_optim.py (never a
                      roundpipe dependency); skipped with the reason otherwise

Columns: tokens/s of the median timed step (after warm-up steps; an asynchronous run's wait for its
last update is spread over the steps); peak host RSS of the process and its growth over the process before the model was
built, per parameter; peak device bytes (CUDA: torch.cuda.max_memory_allocated summed over the
GPUs; CPU workers: the engine's ledger, which is host memory inside the RSS).  A provider that
runs out of memory gets a row saying so.

    python bench/e2e.py [--quick] [--models cpu-tiny,cpu-small] [--out bench/results] [--no-save]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.bench.runner import Report, add_common_args  # noqa: E402

MODELS = {   # name: (hidden, layers, heads, kv heads, head_dim, ffn, vocab, batch, seq)
    "cpu-tiny": (128, 4, 4, 2, 32, 384, 4096, 8, 128),
    "cpu-small": (256, 8, 8, 4, 32, 768, 16384, 8, 256),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, 8, 2048),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, 8, 2048),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, 8, 2048),
}
PROVIDERS = ("hf", "roundpipe sync", "roundpipe async", "roundpipe device", "deepspeed")


def build(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    hidden, layers, heads, kv, head_dim, ffn, vocab, _, _ = MODELS[name]
    cfg = AutoConfig.for_model("qwen3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=kv, head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab,
                               tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def child(spec: dict) -> dict:
    """One provider's run (in its own process); returns its measurements."""
    import resource
    import time

    import torch

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    cuda = torch.cuda.is_available()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    name, provider, warmup, steps = spec["model"], spec["provider"], spec["warmup"], spec["steps"]
    batch, seq = spec["batch"], spec["seq"]
    gen = torch.Generator().manual_seed(0)
    vocab = MODELS[name][6]
    data = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(warmup + steps)]
    # libraries loaded before the baseline, so that the growth is the training's (imports are ~250 MB)
    import transformers.masking_utils  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
    if provider.startswith("roundpipe"):
        import roundpipe.hf.model  # noqa: F401
        import roundpipe.optim  # noqa: F401
    base = rss()
    hf = build(name)
    params = sum(p.numel() for p in hf.parameters())
    out: dict = {"params": params}
    try:
        if provider == "hf":
            dev = torch.device("cuda:0" if cuda else "cpu")
            hf.to(dev).train()
            opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=cuda)
            amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

            def step(ids):
                ids = ids.to(dev)
                with amp:
                    hf(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            def finish():
                if cuda:
                    torch.cuda.synchronize()
        elif provider.startswith("roundpipe"):
            import roundpipe as rp
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
            options = {}
            if provider.endswith("device"):   # one worker; CPU workers have no cap to size the prefix: all layers
                devices = devices[:1]
                options = {"device_step": True, "resident_layers": None if cuda else MODELS[name][1] + 2}
            model = rp.hf.wrap(hf, devices=devices, **options)
            opt = rp.optim.AdamW(model.parameters(), lr=1e-5)
            asynchronous = provider.endswith("async")

            def step(ids):
                model.forward_backward(input_ids=ids, labels=ids)
                model.step(opt, asynchronous=asynchronous)

            def finish():
                model.synchronize()
        else:
            import deepspeed  # type: ignore[import-not-found]   (from the peer folder, see load_peer)
            config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                      "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}
            engine, _, _, _ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(), config=config)

            def step(ids):
                ids = ids.to(engine.device)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()

            def finish():
                torch.cuda.synchronize()
        for ids in data[:warmup]:
            step(ids)
        finish()
        if cuda:
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
        # the median step: on a shared machine one slow step (another process's burst) must not decide
        times = []
        t0 = time.perf_counter()
        for ids in data[warmup:]:
            step(ids)
            times.append(time.perf_counter() - t0)
            t0 += times[-1]
        t_fin = time.perf_counter()
        finish()   # an asynchronous run's last update: spread over the steps
        times = [t + (time.perf_counter() - t_fin) / len(times) for t in times]
        out["tokens_per_s"] = batch * seq / sorted(times)[len(times) // 2]
        if cuda:
            out["device_peak"] = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
        elif provider.startswith("roundpipe"):
            out["device_peak"] = max(w["peak_total"] for w in model.memory_stats()["workers"].values())
        if provider.startswith("roundpipe"):
            model.close()
    except torch.OutOfMemoryError as exc:
        out["error"] = f"out of memory: {str(exc).splitlines()[0][:120]}"
    out["peak_rss"] = rss()
    out["rss_growth"] = rss() - base
    return out


def load_peer(peer_path: str | None) -> tuple[str | None, str | None]:
    """(folder to put first on the child's sys.path, None) when deepspeed imports from it, else (None, reason)."""
    if not peer_path:
        return None, "deepspeed skipped: no --peer-path / ROUNDPIPE_PEER_PATH given (not installed here)"
    peer = Path(peer_path).resolve()
    if not (peer / "deepspeed").is_dir():
        return None, f"deepspeed skipped: {peer} has no deepspeed package"
    if any(peer.glob("roundpipe*")):
        return None, f"deepspeed skipped: {peer} holds a roundpipe package; use a folder with deepspeed only"
    return str(peer), None


def run_child(spec: dict, peer: str | None, timeout: float) -> dict:
    env = dict(os.environ)
    if peer is not None:
        env["PYTHONPATH"] = os.pathsep.join([peer, env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else ''}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/e2e.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(MODELS)} "
                        "(default: cpu-tiny,cpu-small without a GPU, qwen3-0.6b with one)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per provider (default 8; 3 with --quick)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--peer-path", default=os.environ.get("ROUNDPIPE_PEER_PATH"),
                        help="folder holding the deepspeed package, for the deepspeed provider (GPU only)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds, median reported (default 3; 1 "
                        "with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every run (default torch's; on a "
                        "loaded 2-core VM 1 thread is steadier: 2 threads spin-waiting on each other under load read "
                        "20x slower steps)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per provider run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    import torch
    cuda = torch.cuda.is_available()
    names = (args.models or ("qwen3-0.6b" if cuda else ("cpu-tiny" if args.quick else "cpu-tiny,cpu-small"))).split(",")
    for n in names:
        if n not in MODELS:
            parser.error(f"--models: {n!r} is not one of {', '.join(MODELS)}")
    steps = args.steps or (3 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 3)
    peer, reason = load_peer(args.peer_path) if cuda else (None, "deepspeed skipped: ZeRO-Offload needs a GPU")
    providers = [p for p in PROVIDERS if p != "deepspeed" or peer is not None]
    report = Report("e2e", columns=["model", "provider", "params", "batch x seq", "tokens/s", "vs hf", "peak RSS GB",
                                    "RSS growth B/param", "device peak GB", "error"],
                    device="cuda:0" if cuda else "cpu")
    for name in names:
        batch, seq = args.batch or MODELS[name][7], args.seq or MODELS[name][8]
        # Interleaved rounds, a fresh process each: on a shared machine the load changes over
        # seconds, so every provider is sampled in every round and the median round is reported.
        runs: dict[str, list[dict]] = {p: [] for p in providers}
        for _ in range(rounds):
            for provider in providers:
                spec = {"model": name, "provider": provider, "warmup": 2, "steps": steps, "batch": batch, "seq": seq,
                        "threads": args.threads}
                runs[provider].append(run_child(spec, peer if provider == "deepspeed" else None, args.timeout))
                print(f"{name} {provider}: {runs[provider][-1]}", file=sys.stderr, flush=True)
        rows = {}
        for provider, rs in runs.items():
            ok = sorted((r for r in rs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
            rows[provider] = ok[len(ok) // 2] if ok else rs[0]
        ref = rows["hf"].get("tokens_per_s")
        for provider, r in rows.items():
            tps = r.get("tokens_per_s")
            report.add(model=name, provider=provider, params=r.get("params"), **{
                "batch x seq": f"{batch}x{seq}", "tokens/s": tps, "vs hf": tps / ref if tps and ref else None,
                "peak RSS GB": r["peak_rss"] / 1e9 if "peak_rss" in r else None,
                "RSS growth B/param": r["rss_growth"] / r["params"] if "rss_growth" in r and r.get("params") else None,
                "device peak GB": r["device_peak"] / 1e9 if r.get("device_peak") else None,
                "error": r.get("error", "")})
    if reason:
        report.note(reason)
    report.note(f"tokens/s of the median of {steps} timed steps after 2 warm-up steps, each run in a fresh process, "
                f"the median of {rounds} interleaved rounds (its RSS and device peak beside it); "
                f"torch threads {args.threads or torch.get_num_threads()}; " + ("bf16 compute on CUDA" if cuda else
                "fp32 on CPU, roundpipe on one CPU worker (the engine's CPU device model, sharing the cores)"))
    report.finish(args.out, save=not args.no_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
