"""The longest sequence ours trains under the cap, searched on the GPU beside the planner's prediction of it.

Two rows of the GPU benchmark (bench/gpu_bench.py): `ours-predicted`, rp.hf.max_seq_len on the meta device in a
process that sees no GPU (it runs beside the GPU rows from the start of its call), and `ours-maxseq`, a bisection
of real steps, each probe a fresh rp.hf.wrap and one full step at batch 1.  bench/gpu_providers.py runs both
(`run_prediction`, `run_maxseq`); the parent imports the pure helpers.  Nothing heavy at import.

The search's top follows the prediction: 1.25 x the prediction rounded up to the grain (it stopped at 65,536
while the prediction was 143,355, issue 53), and its first probe is the prediction itself (rounded down), the
most informative single point; then bisection.  A probe at ~143k tokens of Qwen3-1.7B is ~30 s of an H100
(attention's ~1e16 FLOPs with the recompute, estimated), so within its 20 s the search reaches a bracket, not
a length: a probe is not started when its estimated seconds (forward_backward's from the earlier probes, scaled
by at most the square of the length; the wrap and the step's as measured) would end past the limit.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BOUND_FACTOR = 1.25   # the search's top: this times the prediction


def search_bound(predicted: int | None, seq_min: int, grain: int, default: int) -> tuple[int, int | None, str]:
    """(the search's top, its first probe, where the top comes from): BOUND_FACTOR x `predicted` rounded up to
    `grain` and the prediction rounded down to it; `default` and no first probe without a prediction."""
    if not predicted or predicted < seq_min:
        return default, None, f"--seq-max {default} (no prediction of at least {seq_min})"
    top = max(seq_min + grain, -(-int(predicted * BOUND_FACTOR) // grain) * grain)
    first = max(seq_min, predicted // grain * grain)
    return top, first, f"{BOUND_FACTOR:g} x predicted {predicted}"


def next_probe(lo: int, hi: int, grain: int, fit: int | None, fail: int | None, first: int | None) -> int | None:
    """The next length to try in [lo, hi] (multiples of `grain`), given the longest that trained (`fit`) and the
    shortest that did not (`fail`) so far; None when the bracket is down to one grain, or hi trained."""
    if fit is None and fail is None:
        return first or lo
    if fail is None:
        return hi if fit < hi else None
    floor = fit if fit is not None else lo - grain   # nothing trained yet: lo itself is still to try
    if fail - floor <= grain:
        return None
    mid = max(lo, (floor + fail) // 2 // grain * grain)
    return mid if floor < mid < fail else None


def probe_seconds(runs: list[tuple[int, float]], fixed_s: float, t: int) -> float | None:
    """Estimated seconds of a probe at `t` tokens: `fixed_s` (the wrap, the optimizer step) plus forward_backward's
    seconds, a t + b t^2 through the two longest probes that ran (`runs`: (tokens, seconds)), or the one probe's
    seconds times (t / its tokens)^2; None before any probe ran."""
    runs = sorted(dict(runs).items())
    if not runs:
        return None
    t1, s1 = runs[-1]
    if len(runs) == 1 or t <= t1:
        return fixed_s + s1 * max(1.0, (t / t1) ** 2)
    t0, s0 = runs[-2]
    # s = a t + b t^2 through both: b from the two, a >= 0; where they disagree (noise), the quadratic bound
    b = (s1 / t1 - s0 / t0) / (t1 - t0)
    a = s1 / t1 - b * t1
    if a < 0 or b < 0:
        return fixed_s + s1 * (t / t1) ** 2
    return fixed_s + a * t + b * t * t


def probes_in(stdout: str) -> list[dict]:
    """The probe records a search printed (its PROBE lines; a line cut by a kill is left out)."""
    probes = []
    for line in stdout.splitlines():
        if line.startswith("PROBE "):
            try:
                probes.append(json.loads(line[len("PROBE "):]))
            except json.JSONDecodeError:
                continue
    return probes


def bracket(probes: list[dict]) -> tuple[int | None, int | None]:
    """(longest length that trained, shortest that did not) of probe records {"t", "ok", ...}."""
    fits = [p["t"] for p in probes if p["ok"]]
    fails = [p["t"] for p in probes if not p["ok"]]
    return (max(fits) if fits else None), (min(fails) if fails else None)


def bisect(probe, lo: int, hi: int, grain: int, first: int | None, left) -> tuple[list[dict], str]:
    """Probes lengths in next_probe's order until the bracket is one grain wide or hi trained, or until the next
    probe's estimated seconds (probe_seconds) pass left(), the seconds still allowed; returns the probe records and
    why it stopped early ("" where it did not).  probe(t) returns {"t", "ok", "s": its seconds, "fb_s":
    forward_backward's seconds where it trained}.  The first probe has no estimate: it runs whenever time is left."""
    probes: list[dict] = []
    runs: list[tuple[int, float]] = []   # (tokens, forward_backward seconds) of the probes that trained
    fixed = 0.0                          # the most seconds a probe spent beside forward_backward (wrap, step)
    while (t := next_probe(lo, hi, grain, *bracket(probes), first)) is not None:
        estimate, remaining = probe_seconds(runs, fixed, t), left()
        if remaining <= 0 or (estimate is not None and estimate > remaining):
            return probes, f"time limit: {t} not tried" + (f" (~{estimate:.0f} s, {remaining:.0f} s left)"
                                                           if remaining > 0 else "")
        record = probe(t)
        probes.append(record)
        if record["ok"]:
            runs.append((t, record["fb_s"]))
            fixed = max(fixed, record["s"] - record["fb_s"])
    return probes, ""


def describe(probes: list[dict], lo: int, hi: int, stopped: str, top_from: str) -> tuple[int, str]:
    """(the longest length that trained, 0 if none; the row's words for the bracket reached)."""
    fit, fail = bracket(probes)
    if fit is None and fail is not None and fail <= lo:
        words = f"even {lo} does not train: {next(p.get('why') for p in probes if p['t'] == fail)}"
    elif fit is None:
        words = "nothing trained"
    elif fail is None:
        words = f">= {fit} (the search's top)" if fit >= hi else f"fits {fit}"
    else:
        words = f"fits {fit}, not {fail}"
    return fit or 0, words + "".join(f"; {x}" for x in (stopped, f"top {hi}: {top_from}") if x)


# ---- the two rows (in the provider's process)

def run_maxseq(spec: dict, build_model) -> dict:
    """The longest sequence (batch 1, multiples of `grain`) at which ours trains one full step under the cap:
    `bisect` over [seq_min, seq_max] (the parent sets seq_max to 1.25 x the planner's prediction and seq_first to
    the prediction: search_bound), within `search_s` seconds; the bracket reached is the row.  Each probe wraps
    the model afresh (the engine plans at its first call and keeps that plan for later, longer calls) and prints
    a PROBE line as it ends, so a process killed at its limit still leaves its bracket in the log.
    build_model(spec, dtype): bench/gpu_providers.py's, the weights every provider starts from."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    import roundpipe as rp

    cuda = spec["device"] == "cuda"
    hf = build_model(spec, torch.float32)
    options = {"devices": ["cuda:0"] if cuda else ["cpu"], "device_memory": spec["cap"]}
    if cuda:
        options["compute_dtype"] = torch.bfloat16
    vocab = spec["hf_config"]["vocab_size"]
    lo, hi = spec["seq_min"], spec["seq_max"]
    deadline = time.perf_counter() + min(spec["budget_s"], spec.get("search_s") or spec["budget_s"])

    def probe(t: int) -> dict:
        ids = torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(t))
        t0 = time.perf_counter()
        record: dict = {"t": t, "ok": False}
        model = rp.hf.wrap(hf, **options)
        try:
            t1 = time.perf_counter()
            model.forward_backward(input_ids=ids, labels=ids)
            record["fb_s"] = time.perf_counter() - t1
            model.step(rp.optim.AdamW(model.parameters(), lr=spec["lr"]), asynchronous=False)
            record["ok"] = True
        except (ValueError, torch.OutOfMemoryError) as exc:   # the planner's refusal, or the allocator's
            record["why"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        finally:
            model.close()
            if cuda:
                torch.cuda.empty_cache()
        record["s"] = time.perf_counter() - t0
        print("PROBE " + json.dumps(record), flush=True)
        return record

    probes, stopped = bisect(probe, lo, hi, spec["grain"], spec.get("seq_first"),
                             lambda: deadline - time.perf_counter())
    fit, words = describe(probes, lo, hi, stopped, spec.get("bound_from") or "--seq-max")
    return {"seq_len": fit, "search": words, "probes": probes, "seq_bound": hi}


def run_prediction(spec: dict) -> dict:
    """The planner's longest sequence under the cap (rp.hf.max_seq_len: meta device).  Its process sees no GPU
    (the parent sets CUDA_VISIBLE_DEVICES=""): it runs beside the GPU rows and must not open a CUDA context."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from transformers import AutoConfig

    import roundpipe as rp

    torch.set_num_threads(1)
    cfg = AutoConfig.for_model(**spec["hf_config"])
    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    fit = rp.hf.max_seq_len(cfg, device_memory=spec["cap"], dtype=dtype)
    return {"seq_len": fit.seq_len, "search": f"predicted; binding: {fit.binding.name}",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda_context": torch.cuda.is_initialized()}
