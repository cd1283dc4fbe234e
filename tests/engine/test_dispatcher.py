"""Round-robin schedule: slot placement, rounds, consumers, and random plans end to end."""
import random

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from rp_models import max_rel_err, mlp, reference

import roundpipe as rp
from roundpipe.engine.calls.dispatcher import Schedule, default_plan, saved_points


class FakeWorker:
    def __init__(self, i):
        self.name, self.device = f"w{i}", torch.device("cpu")


PLAN = rp.Plan(forward=[range(0, 2), range(2, 4)], backward=[range(4, 6), range(3, 4), range(1, 3), range(0, 1)])


def test_slots_rotate_over_workers_and_rounds():
    """Slot i of the call goes to worker (g0 + i) mod N; rounds continue the numbering."""
    workers = [FakeWorker(i) for i in range(3)]
    sched = Schedule(PLAN, True, num_mb=5, round_size=3, workers=workers, g0=1)
    placed = sorted((t.slot, w, t.kind, t.layers, tuple(t.mbs)) for w, ts in sched.tasks.items() for t in ts)
    assert [p[1] for p in placed] == [f"w{(1 + i) % 3}" for i in range(12)]
    assert [p[2] for p in placed[:6]] == ["F", "F", "fused", "B", "B", "B"]
    assert placed[0][4] == (0, 1, 2) and placed[6][4] == (3, 4)
    assert sched.next_g0 == 13
    assert sched.uploads == [4, 4, 4, 4, 2, 2]   # 2 rounds x (forward + backward), fused once per round


def test_consumers_include_interior_backward_inputs():
    """A forward stage publishes at every saved boundary inside it, with the right readers."""
    workers = [FakeWorker(i) for i in range(2)]
    sched = Schedule(PLAN, True, num_mb=2, round_size=3, workers=workers, g0=0)
    f1 = next(t for t in sched.tasks["w0"] if t.kind == "F" and t.layers == range(0, 2))
    assert sorted(f1.consumers) == [1, 2]
    # slots: F[0-1] w0, F[2-3] w1, fused[4-5] w0, B[3] w1, B[1-2] w0, B[0] w1
    assert [(c.worker.name, c.forward) for c in f1.consumers[1]] == [("w0", False)]
    assert sorted((c.worker.name, c.forward) for c in f1.consumers[2]) == [("w1", True)]
    assert saved_points(PLAN, True) == {0, 1, 2, 3, 4}
    assert sched.input_consumers == 2   # F [0-1] and B [0-0]


def test_default_plan_is_valid_and_asymmetric():
    """The default plan covers the model, fuses the tail and has ~3x larger forward stages."""
    for layers in (1, 2, 5, 12, 40, 100):
        plan = default_plan(layers, 4).check(layers)
        if plan.forward:
            assert len(plan.forward[0]) == min(3 * len(plan.backward[1]), plan.fused.start)
        assert len(plan.backward) <= 17


def random_plan(rng, layers):
    cuts = sorted(rng.sample(range(1, layers), rng.randint(0, layers - 1)))
    bounds = [0] + cuts + [layers]
    backward = [range(a, b) for a, b in zip(bounds, bounds[1:])][::-1]
    head = backward[0].start
    fcuts = sorted(rng.sample(range(1, head), rng.randint(0, head - 1))) if head > 1 else []
    fb = [0] + fcuts + [head] if head > 0 else [0]
    return rp.Plan(forward=[range(a, b) for a, b in zip(fb, fb[1:])], backward=backward)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), workers=st.integers(1, 4), num_mb=st.integers(1, 7), per_round=st.integers(1, 5))
def test_random_plans_give_exact_gradients(seed, workers, num_mb, per_round):
    """Any valid plan, pool size, microbatch count and round size gives autograd's gradients."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layers = mlp(rng.randint(1, 7))
    plan = random_plan(rng, len(layers))
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    ref = reference(layers)
    F.mse_loss(ref(x), y).backward()
    with rp.RoundPipe(layers, devices=["cpu"] * workers, num_microbatches=num_mb, plan=plan,
                      microbatches_per_round=per_round) as model:
        model.forward_backward(x, labels=y, loss_fn=F.mse_loss)
        model.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-5, plan
