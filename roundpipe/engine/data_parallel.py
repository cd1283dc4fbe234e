"""Data parallelism across processes and nodes on torch.distributed (NCCL between GPUs, gloo on CPU).

    dist.init_process_group()                      # torchrun sets the environment
    model = rp.RoundPipe(layers, devices=..., process_group=dist.group.WORLD)

rp.hf.wrap and rp.diffusers.wrap take the group themselves when process_group= is not given
(`launched_group`: torchrun's world group, joined first if this process has not).

Each rank runs its own RoundPipe over its local workers on its share of the
batch.  What the ranks share, and when:

    gradients   averaged over the group (summed with loss_reduction="sum") per
                layer, in fp32, on the G-copy thread once the calls a G-copy covers
                have ended: layers last to first, packed into buckets of about
                `bucket_bytes` like DDP's, one all_reduce per bucket.  The G-copy
                then moves the averages into `p.grad` as usual, so the optimizer
                (fused or torch, synchronous or asynchronous) steps identical
                gradients on every rank and the masters stay identical.  With the
                asynchronous step the reduction runs while the next call computes.
                With equal local batches, synchronous training on W ranks equals
                one process on the combined batch (as DDP: each rank's mean over
                its samples, averaged over ranks).
    plans       rank 0's plan, broadcast at every training call's start (the plan
                of a call is chosen there, roundpipe/engine/autoplan.py), on a
                group of its own so it never interleaves with gradient collectives
    randomness  each call's dropout seed mixed with the rank: ranks draw different
                masks, reproducibly for a given seed and rank
    checkpoints one directory: rank 0 writes the shared state, each rank its own
                engine state (roundpipe/engine/state/checkpoint.py)

Collectives are issued in the same order on every rank only if every rank makes
the same engine calls in the same order: forward_backward, step, synchronize,
state_dict/load_state_dict and the checkpoint calls on every rank (a forward-only
`model(x)` needs no collective and may run on one rank alone).  G-copies are
issued only at those points (never eagerly when a call returns, which depends on
thread timing).  A rank that raises or dies makes the others' next collective
fail within the group's timeout (`init_process_group(timeout=...)`); the error
is raised by their next engine call and names the all-reduce.  The job cannot go
on after that: restart it from the last checkpoint.  A training call that runs out
of device memory on one rank fails there alone; a retry on that rank alone (as an
automatic batch-size search does) would pair its collectives with different calls
of the others, silently, so the rank then refuses every collective (`refuse`) and
fails like a rank that raised: every rank must be restarted, with a smaller batch.

Under NCCL each rank all-reduces on a GPU of its own (`reduce_device`): one of its
workers' devices, picked by LOCAL_RANK when the ranks of a node share them, never
`torch.cuda.current_device()` alone (cuda:0 on every rank that did not call
`set_device`, which NCCL refuses: "Duplicate GPU detected").  A bucket is staged
in the model's host memory (`HostState.alloc`: the pinned arena on GPUs), so its
copies to and from the GPU are asynchronous DMA, not staged pageable copies.
"""
from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from roundpipe.planner.plan import Plan
from roundpipe.workers.rng import layer_seed

if TYPE_CHECKING:
    from roundpipe.engine.step.host_state import HostState

BUCKET_BYTES = 25 << 20


def _dist():
    import torch.distributed as dist
    return dist


class DataParallel:
    """One model's place in a process group: its rank, the groups it talks on, the reductions."""

    def __init__(self, process_group: Any, num_layers: int, reduction: str, bucket_bytes: int = BUCKET_BYTES,
                 timeout: datetime.timedelta | None = None, devices: Sequence[torch.device] = ()):
        dist = _dist()
        if dist.is_available() and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD), got "
                            f"{type(process_group).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group() first (torchrun sets its environment)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("process_group does not contain this process")
        self.backend = dist.get_backend(process_group)
        self.reduction = reduction
        self.bucket_bytes = bucket_bytes
        self.L = num_layers
        # plans and barriers on a group of their own: the caller's thread issues them while the
        # G-copy thread may be inside a gradient all_reduce on `group`
        ranks = dist.get_process_group_ranks(process_group)
        self.control = dist.new_group(ranks, backend="gloo", timeout=timeout) if self.world > 1 else process_group
        self.device = reduce_device(self.backend, devices, os.environ.get("LOCAL_RANK"))
        self.refused: BaseException | None = None   # the error after which this rank joins no collective

    # ---- a rank that must not go on
    def refuse(self, error: BaseException) -> None:
        """After `error`, a training call's failure on this rank alone (out of device memory), every later
        collective of this rank raises instead of running: a retry would pair its plan broadcast and
        reductions with different calls of the other ranks, silently averaging gradients of other steps.
        Refusing makes the rank fail, and the others at their next collective."""
        if self.world > 1 and self.refused is None:
            self.refused = error

    def _check_usable(self, what: str) -> None:
        if self.refused is not None:
            raise RuntimeError(
                f"[roundpipe] {what} refused: rank {self.rank} of {self.world} ran out of device memory in a training "
                "call (the chained error) that the other ranks went on from, so its calls may no longer pair with "
                "theirs.  Let every rank stop and restart them all from the last checkpoint with a smaller batch, "
                "more microbatches or a plan with smaller stages") from self.refused

    # ---- plans (caller thread)
    def agree_plan(self, plan: Plan) -> Plan:
        """Rank 0's plan, on every rank."""
        if self.world == 1:
            return plan
        self._check_usable("a training call (the broadcast of its plan)")
        fwd, bwd = list(plan.forward), list(plan.backward)
        size = 2 + 4 * self.L
        buf = torch.zeros(size, dtype=torch.int64)
        if self.rank == 0:
            flat = [len(fwd), len(bwd)] + [x for r in fwd + bwd for x in (r.start, r.stop)]
            buf[:len(flat)] = torch.tensor(flat, dtype=torch.int64)
        _dist().broadcast(buf, src=_dist().get_global_rank(self.control, 0), group=self.control)
        nf, nb = int(buf[0]), int(buf[1])
        pairs = buf[2:2 + 2 * (nf + nb)].view(-1, 2).tolist()
        ranges = [range(a, b) for a, b in pairs]
        return Plan(forward=ranges[:nf], backward=ranges[nf:])

    def sum_over_ranks(self, value: float) -> float:
        """value summed over the ranks (a batch's token count), on the control group."""
        if self.world == 1:
            return value
        self._check_usable("the sum over ranks")
        t = torch.tensor([value], dtype=torch.float64)
        _dist().all_reduce(t, group=self.control)
        return float(t)

    def barrier(self) -> None:
        if self.world > 1:
            self._check_usable("a barrier (a checkpoint's)")
            _dist().barrier(group=self.control)

    def all_true(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (a checkpoint's files were all written)."""
        if self.world == 1:
            return ok
        self._check_usable("a vote (a checkpoint's)")
        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        _dist().all_reduce(t, group=self.control)
        return int(t) == 0

    # ---- randomness
    def rank_seed(self, base: int) -> int:
        """The call's seed for this rank: distinct per rank, fixed by (base, rank)."""
        return base if self.world == 1 else layer_seed(base, -1 - self.rank, 0)

    # ---- gradients (G-copy thread)
    def reduce_landed(self, host: "HostState") -> None:
        """Averages (or sums) every layer's landed gradient sums over the group, in place of them:
        fp32, layers last to first in buckets of about bucket_bytes, one all_reduce each.  A
        parameter no rank has a gradient for keeps none; one some ranks lack counts as zero there."""
        entries = [(l, j) for l in reversed(range(len(host))) for j in host.layers[l].trainable]
        for bucket in buckets(entries, lambda e: host.layers[e[0]].params[e[1]].numel() * 4, self.bucket_bytes):
            self._reduce_bucket(host, bucket)

    def _reduce_bucket(self, host: "HostState", entries: list[tuple[int, int]]) -> None:
        sizes = [host.layers[l].params[j].numel() for l, j in entries]
        n = sum(sizes)
        # the model's host memory (pinned on GPUs): an exact-size arena block, returned when the
        # last gradient viewing it is dropped; only what no landed gradient overwrites is zeroed
        flat = host.alloc((n + len(entries),), torch.float32)
        views = list(flat[:n].split(sizes))
        has = flat[n:]
        has.zero_()
        for k, (l, j) in enumerate(entries):
            st = host.layers[l]
            if st.ghas[j]:
                views[k].copy_(st.gbuf[j].reshape(-1))
                has[k] = 1.0
            else:
                views[k].zero_()
        if self.device.type == "cpu":
            _dist().all_reduce(flat, group=self.group)
        else:
            with torch.cuda.device(self.device):
                work = flat.to(self.device, non_blocking=True)   # from pinned memory: DMA, the host goes on
                _dist().all_reduce(work, group=self.group)      # the current stream waits for NCCL's
                flat.copy_(work, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()   # before the host reads `flat`
        if self.reduction == "mean":
            flat[:n].div_(self.world)
        for k, ((l, j), got) in enumerate(zip(entries, has.tolist())):   # views of the bucket: no copy
            st = host.layers[l]
            st.gbuf[j], st.ghas[j] = (views[k].view(st.params[j].shape), True) if got > 0 else (None, False)

    def reducer(self, host: "HostState") -> Callable[[], None]:
        """The G-copy's reduction: on failure the local sums are dropped and the error names the all_reduce."""
        def reduce() -> None:
            if self.refused is not None:
                self.drop_landed(host)
                self._check_usable("the gradient all_reduce")
            try:
                self.reduce_landed(host)
            except BaseException as e:  # noqa: BLE001 - the landed gradients are dropped on any exit
                self.drop_landed(host)
                raise reduction_failed(e, self.world)  # noqa: B904 - re-raises e itself, with a note
        return reduce

    def drop_landed(self, host: "HostState") -> None:
        """After a failed reduction: the local, unreduced sums are dropped (no rank steps them)."""
        for st in host.layers:
            for j in st.trainable:
                st.gbuf[j], st.ghas[j] = None, False


def launched_group(caller: str = "building the model"):
    """torch.distributed's world group when this process is one of several ranks (torchrun), else None.

    Under torchrun (WORLD_SIZE > 1 in the environment) a process that has not called
    init_process_group yet joins the world group here (env:// rendezvous: RANK, MASTER_ADDR and
    MASTER_PORT from the environment; gloo, which reduces on the CPU whatever the workers are;
    for NCCL call init_process_group("nccl") before wrapping), so that wrapping first and building
    TrainingArguments after, or a hand loop without init_process_group, never trains the ranks apart.
    rp.hf.wrap and rp.diffusers.wrap call it when process_group= is not given; `caller` names the call
    in the errors."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD if dist.get_world_size() > 1 else None
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world:
        return None
    if not world.isdigit():
        raise ValueError(f"WORLD_SIZE={world!r} in the environment must be a positive integer (torchrun sets it)")
    if int(world) <= 1:
        return None
    how = (f"launch every rank with torchrun, or call torch.distributed.init_process_group() before {caller}, "
           "or pass process_group=None to train this process alone")
    if not dist.is_available():
        raise ValueError(f"WORLD_SIZE={world}: this process is one of {world} ranks, but torch.distributed is not "
                         f"built into this torch; unset WORLD_SIZE or pass process_group=None to train alone")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world}: this process is one of {world} ranks, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set in the environment; {how}")
    dist.init_process_group(backend="gloo", init_method="env://")
    return dist.group.WORLD


def reduce_device(backend: str, devices: Sequence[torch.device], local_rank: str | None) -> torch.device:
    """The device this rank's gradient all_reduce runs on: the CPU unless the backend is NCCL.

    Under NCCL two ranks of a node must not use the same GPU.  The candidates are the rank's
    CUDA workers (distinct, in order); LOCAL_RANK (torchrun sets it) picks among them, so ranks
    sharing the same workers (devices=None under torchrun) land on different GPUs and a rank with
    workers of its own stays on one of them.  Without CUDA workers (CPU workers, NCCL group)
    LOCAL_RANK picks among the visible GPUs; without LOCAL_RANK the first worker, else the
    current device (the caller's torch.cuda.set_device)."""
    if backend != "nccl":
        return torch.device("cpu")
    if local_rank and not local_rank.strip().isdigit():
        raise ValueError(f"LOCAL_RANK={local_rank!r} must be a non-negative integer (torchrun sets it)")
    rank = int(local_rank) if local_rank else None
    cuda = list(dict.fromkeys(torch.device(d) for d in devices if torch.device(d).type == "cuda"))
    if cuda:
        return cuda[0] if rank is None else cuda[rank % len(cuda)]
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("process_group uses the NCCL backend but no CUDA device is visible; use a gloo group "
                         "(init_process_group('gloo')) for CPU workers")
    return torch.device("cuda", torch.cuda.current_device() if rank is None else rank % count)


def buckets(items: list, nbytes: Callable[[Any], int], limit: int) -> Iterator[list]:
    """Consecutive runs of items, each closed once it holds at least `limit` bytes (as DDP's)."""
    bucket, size = [], 0
    for item in items:
        bucket.append(item)
        size += nbytes(item)
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def reduction_failed(exc: BaseException, world: int) -> BaseException:
    exc.add_note(f"[roundpipe] the gradient all_reduce across {world} ranks failed: another rank raised, died or "
                 "made different engine calls (every rank must call forward_backward, step, synchronize, state "
                 "dicts and checkpoints in the same order).  The gradients were dropped; restart from the last "
                 "checkpoint.")
    return exc


class OptimizerShards:
    """shard_optimizer=True: this rank's slice of every trainable master, as parameters of their own.

    Each parameter's flattened elements are cut into W contiguous chunks of ceil(n/W); rank r
    owns chunk r.  The optimizer's param_groups are rewritten once to hold these slices (views
    of the masters, so the update lands in the masters themselves): its state then covers about
    1/W of the elements.  After a rank has stepped its slices, an all_gather of the updated fp32
    slices (layers in order, buckets of about bucket_bytes, on a group of its own) makes every
    rank's masters whole and equal again; the upload copies are rewritten from them as each
    layer's gate opens.  Each rank saves its own optimizer state in a checkpoint."""

    def __init__(self, host: "HostState", dp: DataParallel, timeout: datetime.timedelta | None = None):
        self.host, self.dp = host, dp
        ranks = _dist().get_process_group_ranks(dp.group)
        self.group = _dist().new_group(ranks, backend="gloo", timeout=timeout) if dp.world > 1 else dp.group
        self.slices: dict[tuple[int, int], tuple[int, int, int]] = {}   # (layer, j) -> (lo, hi, chunk)
        self.params: dict[tuple[int, int], torch.nn.Parameter] = {}
        for l, st in enumerate(host.layers):
            for j in st.owned:
                p = st.params[j]
                if not p.requires_grad:
                    continue
                n = p.numel()
                c = -(-n // dp.world)
                lo = min(dp.rank * c, n)
                self.slices[(l, j)] = (lo, min(lo + c, n), c)
                self.params[(l, j)] = torch.nn.Parameter(p.data.view(-1)[lo:min(lo + c, n)])
        self.adopted: set[int] = set()   # id of optimizers rewritten to the slices

    def _repoint(self, l: int) -> None:
        """The slices view the masters as they are now (`p.data = t` replaces a master's storage)."""
        st = self.host.layers[l]
        for (layer, j), sp in self.params.items():
            if layer == l:
                lo, hi, _ = self.slices[(l, j)]
                if sp.data.data_ptr() != st.params[j].data.view(-1)[lo:hi].data_ptr():
                    sp.data = st.params[j].data.view(-1)[lo:hi]

    def adopt(self, optimizer: Any) -> None:
        """Rewrites the optimizer's param_groups from the model's masters to this rank's slices (once)."""
        if id(optimizer) in self.adopted:
            return
        if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("shard_optimizer=True: the optimizer already has state for the full parameters (it "
                             "stepped before); build a new one over model.parameters()")
        by_master = {id(self.host.layers[l].params[j]): sp for (l, j), sp in self.params.items()}
        for group in optimizer.param_groups:
            group["params"] = [by_master[id(p)] for p in group["params"]]
        self.adopted.add(id(optimizer))

    def layer(self, l: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor | None]]:
        """This rank's slices of layer l and the matching slices of the gradients the step reads."""
        self._repoint(l)
        st = self.host.layers[l]
        params, grads = [], []
        for j, g in zip(st.owned, self.host.step_grads(l)):
            if (l, j) in self.params:
                lo, hi, _ = self.slices[(l, j)]
                params.append(self.params[(l, j)])
                grads.append(None if g is None else g.reshape(-1)[lo:hi])
        return params, grads

    def gather(self) -> None:
        """Every rank's updated slices into every rank's masters (fp32, bucketed, a broadcast per rank)."""
        if self.dp.world == 1:
            return
        self.dp._check_usable("the gather of the optimizer shards")
        for bucket in buckets(sorted(self.slices), lambda k: self.slices[k][2] * 4 * self.dp.world,
                              self.dp.bucket_bytes):
            self._gather_bucket(bucket)

    def _gather_bucket(self, keys: list[tuple[int, int]]) -> None:
        """One bucket of the gather, as one broadcast per rank of that rank's slices, packed into one
        arena block (reused bucket after bucket, step after step) and unpacked into the other ranks'
        masters.  An all_gather made gloo gather into a buffer of its own and copy out of it: glibc heap
        memory on the gloo threads that the heaps kept, 90 MiB more RSS a step at 28.7M parameters."""
        chunks = [self.slices[k][2] for k in keys]
        buf = self.host.alloc((sum(chunks),), torch.float32)
        views = buf.split(chunks)

        def ranges(q: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            """(bucket view, master range) of rank q's slices."""
            for view, k, c in zip(views, keys, chunks):
                flat = self.host.layers[k[0]].params[k[1]].data.view(-1)
                yield view, flat[min(q * c, flat.numel()):min(q * c + c, flat.numel())]
        for q in range(self.dp.world):
            if q == self.dp.rank:
                for view, master in ranges(q):
                    view[:master.numel()].copy_(master)
                    view[master.numel():].zero_()
            _dist().broadcast(buf, src=_dist().get_global_rank(self.group, q), group=self.group)
            if q != self.dp.rank:
                for view, master in ranges(q):
                    master.copy_(view[:master.numel()])
