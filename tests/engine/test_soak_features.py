"""Random orderings of every feature over every model kind (the feature soak; cases and checks: tests/soak.py).

Vocabulary: forward_backward (return_outputs, per-call num_microbatches), composed model(x) calls with their
backward, model(x) under no_grad and in eval(), asynchronous and synchronous steps with an lr scheduler and
max_grad_norm, a backward after a step (refused), synchronize, state_dict, load_state_dict, edited masters,
save_checkpoint / load_checkpoint, a failing layer or loss_fn, a plan change; backward stages recompute a
stage or a layer at a time (RoundPipe(recompute=)).  Kinds: fp32, AdamW8bit, the
NVMe tier and a 4-bit (NF4) LoRA base against plain PyTorch with the documented asynchronous window
(tests/stale_reference.py, TOL 1e-4); bf16 and fp16 compute and bf16 masters against the engine's own
canonical rerun of the case at stage grain (bitwise); 2 data-parallel ranks against one process on the whole batch.
Every case runs under a watchdog (a hang fails it with every thread's stack).  ROUNDPIPE_SOAK=N runs N
more seeds per kind; tools/soak.py runs long soaks.
"""
import os

import pytest
import soak

import roundpipe as rp

CI_SEEDS = 5   # per kind: ~36 single-process cases and 2 data-parallel ones, about 90 s on a quiet 2-core VM
SOAK = int(os.environ.get("ROUNDPIPE_SOAK", "0"))


@pytest.mark.parametrize("seed", range(CI_SEEDS + SOAK))
@pytest.mark.parametrize("kind", soak.KINDS)
def test_random_feature_sequence(kind, seed):
    """A random ordering of the whole API neither hangs nor departs from the kind's reference."""
    case = soak.draw_case(seed, kind)
    soak.run_with_watchdog(lambda: soak.check_case(case))


def test_ci_seeds_recompute_at_both_grains_and_split_multi_layer_stages():
    """Every kind's CI seeds run recompute="stage" and "layer", and some layer-grain case switches to a plan
    with a backward stage of several layers below the fused tail (the only stages the layer grain splits:
    the default plans of these models have one-layer backward stages)."""
    for kind in soak.KINDS:
        cases = [soak.draw_case(seed, kind) for seed in range(CI_SEEDS)]
        assert {c.options["recompute"] for c in cases} == {"stage", "layer"}, kind
        split = [c.seed for c in cases if c.options["recompute"] == "layer" and any(
            len(r) >= 2 for op in c.ops if op[0] == "plan"
            for r in rp.Plan.uniform(c.layers + 1, backward_per_stage=op[1], forward_ratio=op[2],
                                     fused_layers=op[3]).backward[1:])]
        assert split, kind


def test_random_feature_sequences_on_two_ranks(tmp_path):
    """The same on 2 data-parallel ranks (no failing calls or edits: a failing rank ends the job)."""
    results = soak.run_dp_cases(list(range(2 + SOAK)), str(tmp_path))
    assert all(r == "ok" for r in results.values()), results


def test_the_reference_tells_a_window_off_by_one_call():
    """The check can fail: a reference that lets a failed call inside an asynchronous step's window use up
    no call of it expects the next call to read the old weights; the engine reads the new ones."""
    ops = [("fb", None, False), ("step", True, None), ("fail", "fb"), ("fb", None, False)]
    case = soak.Case(0, "fp32", 2, 2, 1, None, "torch", {}, ops)
    soak.run_with_watchdog(lambda: soak.check_case(case))
    soak.FAILED_CALL_USES_WINDOW = False
    try:
        with pytest.raises(AssertionError, match="at op 3"):
            soak.run_with_watchdog(lambda: soak.check_case(case))
    finally:
        soak.FAILED_CALL_USES_WINDOW = True


def test_canonical_form_drops_plans_and_saves_and_rewinds_loads():
    ops = [("fb",), ("save", "c0"), ("fb",), ("plan", 1, 1, 1), ("save", "c1"), ("step",), ("load", "c0"),
           ("fail", "fb"), ("load", "c1"), ("sync",)]
    assert soak.canonical(ops) == [(0, ("fb",)), (2, ("fb",)), (9, ("sync",))]
