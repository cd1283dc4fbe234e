"""Zero Bubble schedules: ZB-H1, ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, arXiv:2401.10241, section 2) and ZB-V (same paper, section 6; Qi et al.,
"Pipeline Parallelism with Controllable Memory", arXiv:2405.15362).

The backward splits into B (input gradient: the previous stage waits for it) and W
(weight gradient: only the optimizer needs it), so W can run late and fill bubbles.
Costs.w_fraction sets W's share of each backward.  Stage s is bound to one worker
(ZB-V: 2p chunks, chunk c on worker c for c < p and 2p-1-c after, a "V", so a
microbatch's forward starts and its backward ends on worker 0).  Dependencies:
F(c, m) <- F(c-1, m); B(c, m) <- B(c+1, m) (the last chunk's B <- its own F);
W(c, m) <- B(c, m).

The handcrafted schedules are the paper's orders, designed for F = B = W: each is
built here by list scheduling with unit times (a worker that is free runs a ready
B, else a ready F that the limits allow, else its oldest pending W), and the
resulting per-worker orders are then simulated with the real times and comm, as
the paper evaluates ZB-H1/H2 in its Tables 5 and 8.  Limits (the paper's Table 2),
with memory counted in one stage's forward activations per microbatch (M_B; a
microbatch holds it from its F until its W):

    schedule  warm-up Fs on worker d (0-based)   memory limit   peak (paper)
    zb-h1     p - d      (1F1B's)                p M_B          p M_B       bubble (p-1)(F+B-W)
    zb-h2     2(p - d) - 1                       (2p - 1) M_B   (2p-1) M_B  bubble (p-1)(F+B-2W)
    zb-v      2p - 1 chunk Fs                    p M_B (2p chunk units)     bubble ~0 at F = B = W

p = 4, m = 8, F = B = W = 1, worker 0 and worker 3 (microbatch numbers):

    zb-h1  w0  F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
           w3           F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
    zb-h2  w0  F0 .. F6 (7 Fs) B0 W0 F7 B1 W1 B2 W2 ...: no idle time between its first F and last W

(1F1B's bubble is (p-1)(F+B+W) per worker: 9 here, ZB-H1's 3, ZB-H2's 0 when
m >= 2p - 1.)  "Bubble" here, as in the paper's bubble rate, is a worker's span
(first start to last end) minus its work; metrics.spans measures it.
"""
from __future__ import annotations

from typing import Sequence

from roundpipe.sim.costs import Costs, check_sizes
from roundpipe.sim.events import Schedule, Task

ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-v")


def chunk_workers(kind: str, workers: int) -> list[int]:
    """The worker of each chain position (stage or chunk)."""
    p = workers
    return list(range(p)) + (list(reversed(range(p))) if kind == "zb-v" else [])


def limits(kind: str, workers: int) -> tuple[list[int], int]:
    """(warm-up forwards per worker before its first B, memory limit in chain-position activations)."""
    p = workers
    if kind == "zb-h1":
        return [p - d - 1 for d in range(p)], p
    if kind == "zb-h2":
        return [2 * (p - d) - 2 for d in range(p)], 2 * p - 1
    assert kind == "zb-v", kind
    return [2 * p - 1] * p, 2 * p  # a chunk holds half a stage's activations: p M_B = 2p chunk units


def unit_orders(kind: str, workers: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Each worker's order of ("F" | "B" | "W", chain position, microbatch), by list scheduling at F = B = W = 1."""
    owner = chunk_workers(kind, workers)
    S, M = len(owner), microbatches
    warmup, limit = limits(kind, workers)
    positions = [[c for c in range(S) if owner[c] == w] for w in range(workers)]
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    next_f, next_b = [0] * S, [0] * S
    held = [0] * workers                 # microbatch activations held (F done, W not yet)
    fwds = [0] * workers
    pending: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(workers)]
    left = [3 * M * len(positions[w]) for w in range(workers)]
    last = [""] * workers                # after the warm-up F and B alternate, as in 1F1B
    steady = [0] * workers               # forwards after the warm-up
    group = [positions[w][-1] for w in range(workers)]  # zb-v: the chunk of the last F (its B follows)
    for t in range(3 * S * M + 2 * S):   # unit steps; every op takes one
        for w in range(workers):
            if not left[w]:
                continue
            in_warmup = not last[w] and fwds[w] < min(warmup[w], M * len(positions[w]))
            allow_f = held[w] < limit and (in_warmup or last[w] != "F")
            allow_b = not in_warmup and (last[w] != "B" or fwds[w] == M * len(positions[w]))
            f_order = b_order = sorted(positions[w], reverse=True)
            if kind == "zb-v" and not in_warmup:
                f_order = _v_chunks(positions[w], steady[w], workers - 1 - w, next_f, M)
                b_order = [group[w]] if next_b[group[w]] < M else [c for c in positions[w] if c != group[w]]
            op = _pick(t, S, M, next_f, next_b, f_end, b_end, b_order if allow_b else [], f_order if allow_f else [])
            if op is None and kind == "zb-v" and not in_warmup:  # the op due is late: any ready B (else F) goes
                mine = sorted(positions[w], reverse=True)
                op = _pick(t, S, M, next_f, next_b, f_end, b_end, mine, mine if held[w] < limit else [])
            if op is None and pending[w]:
                op = ("W", *pending[w].pop(0))
            if op is None:
                continue
            kind_, c, m = op
            if kind_ == "F":
                f_end[c, m], next_f[c], fwds[w], held[w] = t + 1, m + 1, fwds[w] + 1, held[w] + 1
                last[w] = "F" if not in_warmup else ""
                steady[w] += not in_warmup
                group[w] = c
            elif kind_ == "B":
                b_end[c, m], next_b[c], last[w] = t + 1, m + 1, "B"
                pending[w].append((c, m))
            else:
                held[w] -= 1
            orders[w].append(op)
            left[w] -= 1
        if not any(left):
            return orders
    raise AssertionError(f"{kind}: list scheduling did not finish")  # pragma: no cover - would be a bug


def _pick(t, S, M, next_f, next_b, f_end, b_end, b_order, f_order):
    """The op a worker free at time t starts: a ready B, else a ready F, from positions in the orders given."""
    for c in b_order:
        m = next_b[c]
        if m < M and f_end.get((c, m), t + 1) <= t and (c == S - 1 or b_end.get((c + 1, m), t + 1) <= t):
            return ("B", c, m)
    for c in f_order:
        m = next_f[c]
        if m < M and (c == 0 or f_end.get((c - 1, m), t + 1) <= t):
            return ("F", c, m)
    return None


def _v_chunks(positions, k, lead, next_op, M) -> list[int]:
    """ZB-V's steady state: `lead` groups of the second chunk, then second and first alternately; the one
    chunk whose turn it is (the other once it has no ops left), so a group's B follows its F's chunk."""
    first, second = positions
    want = second if k < lead or (k - lead) % 2 == 0 else first
    other = first if want == second else second
    return [want] if next_op[want] < M else [other]


def peak_memory(orders: Sequence[Sequence[tuple[str, int, int]]]) -> list[int]:
    """Per worker, the most microbatch activations held at once (chain-position units: F +1, W -1)."""
    peaks = []
    for order in orders:
        held = peak = 0
        for op, _, _ in order:
            held += {"F": 1, "W": -1}.get(op, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def zero_bubble_schedule(kind: str, costs: Costs, workers: int, microbatches: int,
                         sizes: Sequence[int]) -> Schedule:
    """Builds `kind` over chain positions of `sizes` layers (p of them, 2p for zb-v); the head is in the last."""
    if kind not in ZERO_BUBBLE:
        raise ValueError(f"schedule={kind!r} must be one of {ZERO_BUBBLE}")
    sizes = check_sizes("partition", sizes, costs.num_layers)
    owner = chunk_workers(kind, workers)
    if len(sizes) != len(owner):
        raise ValueError(f"partition has {len(sizes)} stages; {kind} needs {len(owner)} "
                         f"({'two chunks' if kind == 'zb-v' else 'one stage'} per worker, {workers} workers)")
    S, M = len(sizes), microbatches
    starts = [sum(sizes[:s]) for s in range(S)]
    ranges = [range(a, a + n) for a, n in zip(starts, sizes)]
    times = {"F": [costs.forward(r) for r in ranges],
             "B": [costs.input_grad(r, costs.recompute) for r in ranges],
             "W": [costs.weight_grad(r) for r in ranges]}
    times["F"][-1] += costs.head_fwd
    times["B"][-1] += costs.head_bwd - costs.head_weight_grad
    times["W"][-1] += costs.head_weight_grad
    orders = unit_orders(kind, workers, M)
    sched = Schedule(kind, workers, meta={"stages": list(sizes), "peak_activations": peak_memory(orders)})
    cats = {"F": "forward", "B": "backward", "W": "wgrad"}
    ids = {}
    for phase in "FBW":
        for c in range(S):
            for m in range(M):
                ids[phase, c, m] = len(sched.tasks)
                sched.tasks.append(Task(owner[c], f"{phase}{c} mb{m}", cats[phase], times[phase][c], f"{phase}{c}", m))
    for (phase, c, m), i in ids.items():
        deps = sched.tasks[i].deps
        if phase == "F" and c > 0:
            deps.append((ids["F", c - 1, m], True))
        if phase == "B":
            deps.append((ids["F", c, m], False))
            if c < S - 1:
                deps.append((ids["B", c + 1, m], True))
        if phase == "W":
            deps.append((ids["B", c, m], False))
    for w, order in enumerate(orders):
        sched.programs[w] = [ids[op] for op in order]
    return sched
