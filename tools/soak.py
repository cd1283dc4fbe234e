"""The feature soak for long runs: random orderings of the whole API over every model kind (tests/soak.py).

    python tools/soak.py --cases 500 --seed 10000                 # 500 cases, kinds in turn
    python tools/soak.py --minutes 10 --seed 10000                # as many cases as fit
    python tools/soak.py --seed 10042 --cases 1 --kinds bf16      # replays one case
    python tools/soak.py --cases 20 --kinds dp2                   # 2 data-parallel ranks (one launch per 10)

Case seed s runs kind kinds[s % len(kinds)], its CPU workers under the strict device model seeded with s
(roundpipe/workers/strict.py; `--device-model fast` for the fast one); a failure prints the case (seed, kind,
every operation), the error and the command that replays it.  A hang fails its case after the watchdog with every thread's
stack; its threads are left behind and the run goes on.  Exit status 1 if any case failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")]

import pytest  # noqa: E402 - after the tests/ folder is importable
import soak  # noqa: E402

from roundpipe.workers import strict  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=None, help="how many cases (default: unbounded with --minutes)")
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed")
    ap.add_argument("--minutes", type=float, default=None, help="stop starting cases after this long")
    ap.add_argument("--kinds", default=",".join(soak.KINDS + ("dp2",)),
                    help=f"comma-separated model kinds among {soak.KINDS + ('dp2',)}")
    ap.add_argument("--timeout", type=float, default=soak.CASE_TIMEOUT_S, help="the watchdog, seconds per case")
    ap.add_argument("--device-model", choices=strict.MODES, default="strict",
                    help="how CPU workers model a device (default: strict, seeded with each case's seed)")
    args = ap.parse_args()
    os.environ[strict.ENV] = args.device_model   # the dp2 ranks, started as processes, follow it too
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in soak.KINDS + ("dp2",):
            ap.error(f"--kinds: unknown kind {k!r}; expected some of {soak.KINDS + ('dp2',)}")
    if args.cases is None and args.minutes is None:
        ap.error("give --cases, --minutes or both")
    start, seed, counts, failures, dp_pending = time.monotonic(), args.seed, {}, [], []
    not_run: list[int] = []   # dp2 cases no launch ran (run_dp_cases)
    layer_grain = {}   # kind -> its cases at recompute="layer"

    def report(s, kind, error):
        case = soak.draw_case(s, kind)
        failures.append((s, kind, error))
        print(f"FAIL {case.describe()}\n{error}\n  replay: python tools/soak.py --seed {s} --cases 1 --kinds {kind} "
              f"--device-model {args.device_model}\n",
              flush=True)

    def run_dp():
        with tempfile.TemporaryDirectory(prefix="rp-soak-dp-") as folder:
            for s, result in soak.run_dp_cases(dp_pending, folder).items():
                if result.startswith(soak.NOT_RUN):   # counted apart: no verdict either way
                    not_run.append(s)
                    print(f"NOT RUN seed {s} (dp2): {result}", flush=True)
                    continue
                counts["dp2"] = counts.get("dp2", 0) + 1
                if result != "ok":
                    report(s, "dp2", result)
        dp_pending.clear()

    while (args.cases is None or seed < args.seed + args.cases) and \
            (args.minutes is None or time.monotonic() - start < 60 * args.minutes):
        kind = kinds[seed % len(kinds)]
        if soak.draw_case(seed, kind).options["recompute"] == "layer":
            layer_grain[kind] = layer_grain.get(kind, 0) + 1
        if kind == "dp2":
            dp_pending.append(seed)
            if len(dp_pending) == 10:
                run_dp()
        else:
            counts[kind] = counts.get(kind, 0) + 1
            case = soak.draw_case(seed, kind)
            try:
                with strict.model(strict.DeviceModel(args.device_model, seed=seed)):
                    soak.run_with_watchdog(lambda: soak.check_case(case), args.timeout)
            except (Exception, pytest.fail.Exception):  # noqa: BLE001 - reported, the soak goes on
                report(seed, kind, traceback.format_exc()[-6000:])
        seed += 1
    if dp_pending:
        run_dp()
    total = sum(counts.values())
    print(f"{total} cases in {time.monotonic() - start:.0f} s (seeds {args.seed}..{seed - 1}): {counts}, of them "
          f"at recompute='layer' {layer_grain}; {len(failures)} failed: {[(s, k) for s, k, _ in failures]}"
          + (f"; {len(not_run)} not run: {not_run}" if not_run else ""),
          flush=True)
    return 1 if failures or not_run else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)   # a hung case's threads must not keep the process alive
