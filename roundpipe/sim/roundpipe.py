"""RoundPipe's dispatch as a schedule (docs/architecture.md, "Computation dispatch"), synchronous or asynchronous.

Stage sequence of an iteration: F1..Fk, B1..Bm (B1 = fused tail: forward, head,
loss and backward with no recompute).  Microbatches go in rounds of `round_size`
(default N + 1, the engine's default: RoundPipe's `microbatches_per_round`, the
smallest count with no structural bubble).  Slot i of a round goes to GPU
(g0 + i) mod N and g0 advances by k + m after every round, also across
iterations.  A GPU runs its slots in dispatch order and a slot's microbatches in
order.  In a backward stage Bj the recompute of microbatch m needs only its
input (already in host memory, written by the forward stage that produced it)
and starts when the GPU is free; its backward waits for the gradient of Bj-1.
N = 3, k = 1, m = 2, one round of 4 microbatches:

    GPU 0  F1 mb0 mb1 mb2 mb3
    GPU 1        B1 mb0 mb1 mb2 mb3                  (fused)
    GPU 2  R mb0  . B mb0 R mb1 B mb1 ...           (B2: recompute early, backward on gradient)

Asynchronous mode simulates `iterations` consecutive iterations without a flush.
With the one-step-stale optimizer, iteration t uses the weights updated from
iteration t-2's gradients, so a stage's work in iteration t waits for the
backward of the same layers in iteration t-2 (the CPU optimizer time is not
modelled; it overlaps the GPUs).

Split backward (`split_w`, the "roundpipe-zb" schedule): as in Zero Bubble (Qi et
al., ICLR 2024), a backward stage's backward is B (input gradient, which the next
backward stage waits for) and W (weight gradient, `Costs.w_fraction` of it; the
fused stage's W includes the LM head's).  W is a deferrable task (roundpipe.sim.
events): it runs in an idle gap of its own slot, while the GPU waits for the next
microbatch's gradient, and at the latest when the slot ends, since a GPU holds a
stage's weights only for its slot (and the prefetched next one).  So the gradient
reaches the next backward stage after R + B instead of R + B + W per stage, and
the per-microbatch waits inside backward slots fill with W.

Data parallelism (`allreduce`, W > 1 ranks, roundpipe.sim.allreduce): one rank
is simulated, since all run the same pipeline on equally many microbatches.  An
extra worker, the G-copy thread ("all-reduce", tasks of category "copy", which
bubble accounting leaves out), reduces an iteration's gradients bucket by bucket
once every task of that iteration has ended (the engine's G-copy waits for the
calls it covers to end), and reduces one iteration at a time.  Synchronous: the
reduction follows the last backward, fully exposed (the optimizer step is not
modelled, as above).  Asynchronous: it delays the update of a layer instead, so a
stage's work in iteration t also waits for the buckets holding its layers (the
fused stage: and the LM head) in iteration t-2.  Layer 0 is in the last bucket,
so iteration t+2 starts only once the whole reduction of t has ended (in the
engine too: call t+2 starts after call t ended, and its upload of a layer waits
for that layer's update).  The slack is therefore less than an iteration: with
Costs.uniform(16, 1, 2, head 4/8, comm 0.05), 4 workers and 8 microbatches
(T = 160 per iteration), a reduction R <= 0.65 T is hidden, R = 0.9 T adds
0.14 T, and from about R = 1.4 T on the reductions set the period (exposed R - T).

Weight uploads (`uploads`, roundpipe.sim.uploads): each GPU gets a copy worker
("GPU w upload", after the all-reduce worker if any) that uploads a slot's bytes
while the GPU computes the slot before it, one slot ahead (the prefetch); the
slot's first task waits for its upload.  Without `uploads` the weights are
assumed there in time, as before.

Host optimizer step (`host_step`, roundpipe.sim.hoststep): one more worker ("host
step", after the upload workers if any) runs each iteration's step, whole or per
layer; iteration t + `lag`'s work on a layer (and its upload) waits for that
layer's step in iteration t.  `lag` is 2 for the one-step-stale asynchronous
step, 1 for the synchronous one (then the iterations flow only as far as the
updates allow: the first forward stage waits for layer 0's step).  With a `disk`
(roundpipe.sim.disk) one more worker ("disk") reads the offloaded layers' state ahead
of their steps and writes it behind.
"""
from __future__ import annotations

from typing import Sequence

from roundpipe.sim.allreduce import AllReduce
from roundpipe.sim.costs import Costs, check_sizes
from roundpipe.sim.events import Schedule, Task
from roundpipe.sim.hoststep import HostStep
from roundpipe.sim.uploads import Uploads


def default_round_size(workers: int) -> int:
    """Microbatches per round when none is given: N + 1, as the engine (roundpipe.engine.calls.dispatcher)."""
    return workers + 1


def roundpipe_schedule(costs: Costs, workers: int, microbatches: int, forward: Sequence[int],
                       backward: Sequence[int], iterations: int = 1, round_size: int | None = None,
                       g0: int = 0, allreduce: AllReduce | None = None, split_w: bool = False,
                       uploads: Uploads | None = None, host_step: HostStep | None = None,
                       lag: int = 2) -> Schedule:
    """Builds `iterations` RoundPipe iterations; `backward[0]` is the fused stage (may be 0 layers).

    With `allreduce` over W > 1 ranks, worker N (named "all-reduce") runs each iteration's reduction;
    with `uploads`, the next N workers ("GPU w upload") run each GPU's weight uploads; with `host_step`,
    the worker after those ("host step") runs the optimizer step.  Iteration t's work on a layer waits
    for the update of iteration t - `lag` (2: one step stale; 1: synchronous)."""
    N, M, L = workers, microbatches, costs.num_layers
    backward = check_sizes("backward", backward, L, allow_empty_first=True)
    forward = check_sizes("forward", forward, L - backward[0])
    round_size = default_round_size(N) if round_size is None else round_size
    if not isinstance(round_size, int) or round_size < 1:
        raise ValueError(f"round_size={round_size!r} must be an int >= 1 (microbatches per round)")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an int >= 1")
    if lag not in (1, 2):
        raise ValueError(f"lag={lag!r} must be 1 (synchronous step) or 2 (one step stale)")
    if host_step is not None and host_step.num_layers != L:
        raise ValueError(f"host_step has parameters for {host_step.num_layers} layers (+ head) but the model has {L}")
    k = len(forward)
    fwd_ranges = [range(sum(forward[:j]), sum(forward[:j + 1])) for j in range(k)]
    top = L
    bwd_ranges = []
    for n in backward:
        bwd_ranges.append(range(top - n, top))
        top -= n
    fused = bwd_ranges[0]
    # Which forward stage produced the input of layer i (i > 0): the one holding layer i - 1.
    producer = {i: j for j, r in enumerate(fwd_ranges) for i in range(r.start + 1, r.stop + 1)}
    if allreduce is not None and allreduce.num_layers != L:
        raise ValueError(f"allreduce has gradient bytes for {allreduce.num_layers} layers (+ head) but the model "
                         f"has {L}")
    buckets = allreduce.buckets() if allreduce is not None else []
    meta = {"forward": list(forward), "backward": list(backward), "round_size": round_size}
    if buckets:
        meta["ranks"] = allreduce.ranks
    if uploads is not None and uploads.num_layers != L:
        raise ValueError(f"uploads has bytes for {uploads.num_layers} layers but the model has {L}")
    name = ("roundpipe" if iterations == 1 or lag == 1 else "roundpipe-async") + ("-zb" if split_w else "")
    meta["w_fraction"] = costs.w_fraction if split_w else 0.0
    names = {N: "all-reduce"} if buckets else {}
    up_base = N + (1 if buckets else 0)
    if uploads is not None:
        meta["upload_gbps"] = uploads.bandwidth(N) / 1e9
        names.update({up_base + w: f"GPU {w} upload" for w in range(N)})
    host = up_base + (N if uploads is not None else 0)
    workers_total = host
    if host_step is not None:
        meta["host_step"] = host_step.policy
        names[host] = "host step"
        workers_total += 1
        if host_step.disk is not None:
            meta["disk"] = host_step.disk
            names[host + 1] = "disk"
            workers_total += 1
    sched = Schedule(name, workers_total, meta=meta, names=names)
    held: list[list[int]] = [[] for _ in range(N)]   # per GPU, the last compute task of each slot it ran
    ids: dict[tuple, object] = {}  # task ids, and per ("done", it, j) lists
    slots = [("F", j) for j in range(k)] + [("B", j) for j in range(len(backward))]
    g = g0
    for it in range(iterations):
        for first in range(0, M, round_size):
            mbs = range(first, min(first + round_size, M))
            for i, (phase, j) in enumerate(slots):
                w = (g + i) % N
                up = None
                if uploads is not None:
                    layers = fwd_ranges[j] if phase == "F" else bwd_ranges[j]
                    nbytes = uploads.slot_bytes(layers, len(mbs), phase == "B", head=(phase, j) == ("B", 0))
                    # the memory it is uploaded into is free once the slot before the previous one ended
                    deps = [(held[w][-2], False)] if len(held[w]) >= 2 else []
                    deps += _updated(ids, it - lag, layers, (phase, j) == ("B", 0))  # the P-copy of its layers
                    up = sched.add(Task(up_base + w, f"{phase}{j + 1} upload", "copy",
                                        nbytes / uploads.bandwidth(N), f"{phase}{j + 1}", mbs[0], it, deps))
                    sched.meta["upload_bytes"] = sched.meta.get("upload_bytes", 0.0) + nbytes
                for m in mbs:
                    first = len(sched.tasks)
                    _add_slot(sched, ids, costs, w, phase, j, m, it, fwd_ranges, bwd_ranges, producer, fused, split_w,
                              lag)
                    if up is not None and m == mbs[0]:
                        sched.tasks[first].deps.append((up, False))
                held[w].append(ids[phase, it, j, mbs[-1]])
            g += len(slots)
        if buckets:
            _add_reduction(sched, ids, N, it, len(backward), buckets, allreduce.bucket_times())
        if host_step is not None:
            _add_host_step(sched, ids, host, it, bwd_ranges, host_step, iterations)
    return sched


def _updated(ids, it, layers, head) -> list[tuple[int, bool]]:
    """Dependencies on the host steps of `layers` (+ the LM head) in iteration `it` (none before the first)."""
    if it < 0:
        return []
    stop = layers.stop + (1 if head else 0)
    return [(ids["step", it, l], False) for l in range(layers.start, stop) if ("step", it, l) in ids]


def _add_host_step(sched, ids, worker, it, bwd_ranges, step, iterations) -> None:
    """Iteration `it`'s optimizer step on the host `worker`: whole, or per layer as each stage's gradients land
    (with a disk: the offloaded layers read ahead and written behind on worker `worker` + 1)."""
    L = step.num_layers

    def reduced(layers):
        return [(ids["reduced", it, l], False) for l in layers if ("reduced", it, l) in ids]

    if step.policy == "whole":
        deps = [(i, False) for j in range(len(bwd_ranges)) for i in ids["done", it, j]] + reduced(range(L + 1))
        i = sched.add(Task(worker, "step", "optimizer", step.time(), "step", 0, it, deps))
        for l in range(L + 1):
            ids["step", it, l] = i
        return
    order = [L] + [l for r in bwd_ranges for l in reversed(r)]
    disk = step.disk
    offloaded = [l for l in order if disk is not None and disk.layer_bytes[l] > 0]
    if offloaded and it == 0:
        _read_ahead(sched, ids, worker + 1, it, offloaded[:disk.slots], disk)
    for j, r in enumerate(bwd_ranges):
        landed = [(i, False) for i in ids["done", it, j]]   # a stage's gradients download after its last microbatch
        for l in ([L] if j == 0 else []) + list(reversed(r)):
            name = "step head" if l == L else f"step L{l}"
            deps = landed + reduced([l]) + ([(ids["read", it, l], False)] if l in offloaded else [])
            ids["step", it, l] = sched.add(Task(worker, name, "optimizer", step.layer_time(l), "step", l, it, deps))
            landed = []
            if l in offloaded:
                _write_behind(sched, ids, worker, it, l, offloaded, disk, iterations)


def _read_ahead(sched, ids, worker, it, layers, disk, deps=()) -> None:
    for l in layers:
        ids["read", it, l] = sched.add(Task(worker, f"read L{l}", "copy", disk.read_time(l), "disk", l, it,
                                            list(deps)))


def _write_behind(sched, ids, host, it, l, offloaded, disk, iterations) -> None:
    """Layer l's write once its step ended, then the read its ring slot frees; after the step's last offloaded
    layer the step settles its writes and reads the next step's first layers ahead."""
    wrote = sched.add(Task(host + 1, f"write L{l}", "copy", disk.write_time(l), "disk", l, it,
                           [(ids["step", it, l], False)]))
    i = offloaded.index(l)
    if i + disk.slots < len(offloaded):
        _read_ahead(sched, ids, host + 1, it, [offloaded[i + disk.slots]], disk, [(wrote, False)])
    if i + 1 < len(offloaded):
        return
    ids["step", it, l] = sched.add(Task(host, "settle writes", "optimizer", 0.0, "step", l, it,
                                        [(ids["step", it, l], False), (wrote, False)]))
    if it + 1 < iterations:
        _read_ahead(sched, ids, host + 1, it + 1, offloaded[:disk.slots], disk)

def _add_reduction(sched, ids, worker, it, stages, buckets, seconds) -> None:
    """The all-reduce of iteration `it`: buckets in order on `worker`, after every task of `it` has ended."""
    ended = [(i, False) for j in range(stages) for i in ids["done", it, j]]
    for b, (layers, t) in enumerate(zip(buckets, seconds)):
        i = sched.add(Task(worker, f"all-reduce b{b}", "copy", t, "all-reduce", b, it, ended if b == 0 else []))
        for layer in layers:
            ids["reduced", it, layer] = i


def _add_slot(sched, ids, costs, w, phase, j, m, it, fwd_ranges, bwd_ranges, producer, fused, split_w,
              lag=2) -> None:
    """Adds microbatch m of slot (phase, j) of iteration `it` on worker w, with its dependencies."""
    stale = []  # updated weights: every backward of the same layers in iteration it - lag is done (and stepped)
    if it >= lag:
        layers = fwd_ranges[j] if phase == "F" else bwd_ranges[j]
        stale = [(t, False) for b, r in enumerate(bwd_ranges)
                 if (r.start < layers.stop and layers.start < r.stop) or (phase == "B" and b == j)
                 for t in ids["done", it - lag, b]]
        stale += _updated(ids, it - lag, layers, phase == "B" and j == 0)
        if phase == "B" and j == 0:
            layers = range(layers.start, layers.stop + 1)  # the fused stage also holds the LM head
        stale += [(ids["reduced", it - lag, l], False) for l in layers if ("reduced", it - lag, l) in ids]
    if phase == "F":
        deps = [(ids["F", it, j - 1, m], True)] if j > 0 else []
        i = sched.add(Task(w, f"F{j + 1} mb{m}", "forward", costs.forward(fwd_ranges[j]), f"F{j + 1}", m, it,
                           deps + stale))
        ids["F", it, j, m] = i
        return
    r = bwd_ranges[j]
    wgrad = costs.weight_grad(r) + (costs.head_weight_grad if j == 0 else 0.0) if split_w else 0.0
    if j == 0:
        deps = [(ids["F", it, len(fwd_ranges) - 1, m], True)] if fwd_ranges else []
        work = costs.backward(fused, recompute=False) + costs.forward(fused) + costs.head_fwd + costs.head_bwd
        i = sched.add(Task(w, f"B1 mb{m}", "fused", work - wgrad, "B1", m, it, deps + stale))
    else:
        deps = [(ids["F", it, producer[r.start], m], True)] if r.start > 0 else []
        rec = sched.add(Task(w, f"B{j + 1} mb{m} recompute", "recompute", costs.forward(r), f"B{j + 1}", m, it,
                             deps + stale))
        i = sched.add(Task(w, f"B{j + 1} mb{m}", "backward", costs.backward(r, recompute=False) - wgrad,
                           f"B{j + 1}", m, it, [(rec, False), (ids["B", it, j - 1, m], True)]))
    ids["B", it, j, m] = i
    ids.setdefault(("done", it, j), []).append(i)
    if split_w:
        ids["done", it, j].append(sched.add(Task(w, f"B{j + 1} mb{m} W", "wgrad", wgrad, f"B{j + 1}", m, it,
                                                 [(i, False)], deferrable=True)))
