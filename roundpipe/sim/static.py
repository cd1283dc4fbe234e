"""Weight-bound schedules: GPipe, 1F1B, interleaved 1F1B and looped BFS.

S stages, stage s bound to worker s mod N (v = S / N chunks per worker; v = 1
for GPipe and 1F1B).  F(s, m) needs F(s-1, m); B(s, m) needs B(s+1, m) (the last
stage's B needs its own F).  Full recomputation: B costs forward + backward of
its layers; the LM head runs in the last stage, never recomputed.  Programs for
N = 4, M = 4, worker 1 (numbers are microbatches):

    gpipe             F0 F1 F2 F3 B0 B1 B2 B3
    1f1b              F0 F1 F2 B0 F3 B1 B2 B3        (warm-up of S-s-1 forwards)
    looped-bfs, v=2   F0 F1 F2 F3 | F0 F1 F2 F3 (chunk 1) | B chunk 1 ... | B chunk 0 ...
    interleaved, v=2  Megatron order: groups of N microbatches per chunk, warm-up
                      (N-d-1)*2 + (v-1)*N forwards, then one forward one backward
"""
from __future__ import annotations

from typing import Sequence

from roundpipe.sim.costs import Costs, check_sizes
from roundpipe.sim.events import Schedule, Task

STATIC = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")


def _programs(kind: str, d: int, workers: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Worker d's program as (phase, chunk, microbatch) triples."""
    N, v, M = workers, chunks, microbatches
    if kind in ("gpipe", "looped-bfs"):
        return ([("F", c, m) for c in range(v) for m in range(M)]
                + [("B", c, m) for c in reversed(range(v)) for m in range(M)])
    if kind == "1f1b":
        w = min(N - d - 1, M)
        order = [("F", 0, m) for m in range(w)]
        for i in range(M - w):
            order += [("F", 0, w + i), ("B", 0, i)]
        return order + [("B", 0, m) for m in range(M - w, M)]
    assert kind == "interleaved-1f1b", kind
    total = M * v
    fwd = [("F", (k // N) % v, (k // (N * v)) * N + k % N) for k in range(total)]
    bwd = [("B", v - 1 - (k // N) % v, (k // (N * v)) * N + k % N) for k in range(total)]
    w = min((N - d - 1) * 2 + (v - 1) * N, total)
    order = fwd[:w]
    for i in range(total - w):
        order += [fwd[w + i], bwd[i]]
    return order + bwd[total - w:]


def static_schedule(kind: str, costs: Costs, workers: int, microbatches: int,
                    sizes: Sequence[int]) -> Schedule:
    """Builds `kind` over stages of `sizes` layers (len(sizes) a multiple of `workers`)."""
    if kind not in STATIC:
        raise ValueError(f"schedule={kind!r} must be one of {STATIC}")
    sizes = check_sizes("partition", sizes, costs.num_layers)
    S, N, M = len(sizes), workers, microbatches
    if S % N:
        raise ValueError(f"partition has {S} stages; {kind} needs a multiple of workers={N}")
    v = S // N
    if kind in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"partition has {S} stages; {kind} needs exactly one per worker ({N})")
    if kind == "interleaved-1f1b" and M % N:
        raise ValueError(f"microbatches={M} must be a multiple of workers={N} for interleaved-1f1b")
    starts = [sum(sizes[:s]) for s in range(S)]
    ranges = [range(a, a + n) for a, n in zip(starts, sizes)]
    fwd = [costs.forward(r) for r in ranges]
    bwd = [costs.backward(r, costs.recompute) for r in ranges]
    fwd[-1] += costs.head_fwd
    bwd[-1] += costs.head_bwd
    sched = Schedule(kind, N, meta={"stages": sizes, "chunks": v})
    # Create every task first (ids by (phase, stage, mb)), then fill in the programs.
    ids: dict[tuple[str, int, int], int] = {}
    tasks = []
    for phase, times in (("F", fwd), ("B", bwd)):
        for s in range(S):
            for m in range(M):
                ids[phase, s, m] = len(tasks)
                tasks.append(Task(s % N, f"{phase}{s} mb{m}", "forward" if phase == "F" else "backward",
                                  times[s], f"{phase}{s}", m))
    for (phase, s, m), i in ids.items():
        if phase == "F" and s > 0:
            tasks[i].deps.append((ids["F", s - 1, m], True))
        if phase == "B":
            tasks[i].deps.append((ids["F", s, m], False))
            if s < S - 1:
                tasks[i].deps.append((ids["B", s + 1, m], True))
    sched.tasks = tasks
    for d in range(N):
        sched.programs[d] = [ids[phase, c * N + d, m] for phase, c, m in _programs(kind, d, N, v, M)]
    return sched


def default_sizes(kind: str, costs: Costs, workers: int, chunks: int = 2) -> list[int]:
    """The balanced partition for a static schedule: minimises the largest stage's F + B time
    (head included in the last stage) over `workers` stages, or `workers * chunks` when looped (zb-v: 2 chunks)."""
    from roundpipe.planner.partition import balanced_split

    stages = workers * (chunks if kind in ("interleaved-1f1b", "looped-bfs", "zb-v") else 1)
    weights = [(2 if costs.recompute else 1) * f + b for f, b in zip(costs.fwd, costs.bwd)]
    weights[-1] += costs.head_fwd + costs.head_bwd
    if stages > len(weights):
        raise ValueError(f"{kind} on {workers} workers needs {stages} stages but the model has only "
                         f"{len(weights)} layers")
    return balanced_split(weights, stages)
