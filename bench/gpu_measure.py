"""What a GPU benchmark row measures beside tokens/s: the optimizer step's exposed seconds, the kernels that ran.

Pure Python, no torch at import: bench/gpu_bench.py (the parent) imports it, and bench/gpu_providers.py loads it
by its path in ours' provider processes (that script keeps bench/ off its sys.path; see its header).

The exposed step.  Seconds per iteration the optimizer step adds: per-iteration times of n iterations with the
step (the row's timed steps, back to back) against n with forward_backward alone (the gradients accumulate), n
>= EXPOSED_SAMPLES.  An iteration's time runs from the previous call's return to its own (the last one's to the
sync after it), so an asynchronous step overlaps the next call as it does in training.  The estimate is the
Hodges-Lehmann shift, the median of all n x n differences (with - without), and the spread their interquartile
range.  Where the lower quartile is <= 0 the step's cost is not told apart from the iterations' jitter: the row
says "within noise" (never a negative time: the difference of 2 iterations each way this replaces came out
negative in a dry run, issue 53).

The kernels.  Which of roundpipe.kernels ran in the process, read after the row's steps from
`roundpipe.kernels.report()`: the Triton kernels launched and why any call took the PyTorch reference path.
"""
from __future__ import annotations

import statistics

EXPOSED_SAMPLES = 5   # iterations each way, at least (the row's timed steps give 6 on the device)


# ---- the exposed step

def exposed_estimate(with_step: list[float], without: list[float]) -> dict:
    """{"seconds", "spread_s", "within_noise", "samples", "with_step_s", "without_s"} from per-iteration seconds
    with and without the step (module docstring); seconds is >= 0, 0 where within noise."""
    if min(len(with_step), len(without)) < 2:
        raise ValueError(f"the exposed step needs at least 2 iterations each way, got {len(with_step)} and "
                         f"{len(without)}")
    diffs = sorted(s - a for s in with_step for a in without)
    low, _, high = statistics.quantiles(diffs, n=4, method="inclusive")
    within = low <= 0.0
    return {"seconds": 0.0 if within else statistics.median(diffs), "spread_s": high - low, "within_noise": within,
            "samples": min(len(with_step), len(without)), "with_step_s": list(with_step), "without_s": list(without)}


def exposed_label(estimate: dict | None) -> str | None:
    """The table's cell: "0.412 ±0.020" (the interquartile half-range), or "within noise ±0.020"."""
    if not estimate:
        return None
    half = estimate["spread_s"] / 2
    return f"within noise ±{half:.3f}" if estimate["within_noise"] else f"{estimate['seconds']:.3f} ±{half:.3f}"


# ---- the kernels that ran

def kernels_ran() -> dict:
    """{"kernels": "triton" | "torch" | "triton + torch fallback", "kernels_detail": which and why}, from
    roundpipe.kernels.report() in this process after the row's steps."""
    from roundpipe.kernels import report

    done = report()
    launched, why = done["launched"], "; ".join(done["fell_back"]) or done["unavailable"]
    fell_back = bool(done["fell_back"]) or (not launched and why is not None)
    kind = ("triton + torch fallback" if launched and fell_back else "triton" if launched
            else "torch")
    detail = []
    if launched:
        detail.append(f"launched {', '.join(launched)}")
    if fell_back or not launched:
        detail.append(f"reference path: {why or 'no kernel was reached (no CUDA tensor met a kernel)'}")
    return {"kernels": kind, "kernels_detail": "; ".join(detail)}
