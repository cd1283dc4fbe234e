"""The discrete-event core: tasks with explicit dependencies run in order on workers.

A schedule is a list of `Task`s and, per worker, the order in which that worker
runs them (its program).  A task starts when its worker has finished the previous
task of its program and every dependency has finished, plus `comm` for a
dependency that is a data hop from a different worker.  Workers never preempt or
reorder, which is how both the static schedules and RoundPipe's dispatcher work,
so the simulation is one pass in dependency order; a program that waits on a task
scheduled later on the same worker is a deadlock and raises RuntimeError.

Per task we also keep how long it waited only because of communication (its start
minus the start it would have had with comm = 0 given the same predecessors'
finish times): the *exposed* communication.

A `deferrable` task (a weight-gradient W that only fills gaps, roundpipe-zb) is
not run at its place in the program: it waits in its worker's queue and runs in
the first idle gap before a later task that holds at least half of it (so it fills more
idle time than it can delay that task; with "in whole" instead, roundpipe-zb on the
README case ran 3.1% slower than without the split, with "half" 2.6% faster), and at the latest
just before the worker's next task of another stage (or iteration), before a task
that depends on it, or at the end of the program.  Since a task is placed only
once its dependencies' end times are known, the gap before it is known exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from roundpipe.trace import Trace


@dataclass
class Task:
    worker: int
    name: str        # "F2 mb3"
    cat: str         # forward / recompute / backward / fused
    duration: float
    stage: str       # the slot this task belongs to ("F2", "B1", "S3"): switch vs steady bubbles
    mb: int
    iteration: int = 0
    deps: list[tuple[int, bool]] = field(default_factory=list)  # (task id, is a data hop)
    deferrable: bool = False  # may be postponed into an idle gap of its stage (see the module docstring)


@dataclass
class Schedule:
    """Tasks plus each worker's program (task ids in run order)."""

    name: str
    workers: int
    tasks: list[Task] = field(default_factory=list)
    programs: list[list[int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # worker -> trace row name, default "GPU w"

    def __post_init__(self):
        if not self.programs:
            self.programs = [[] for _ in range(self.workers)]

    def add(self, task: Task) -> int:
        self.tasks.append(task)
        self.programs[task.worker].append(len(self.tasks) - 1)
        return len(self.tasks) - 1


@dataclass
class Run:
    """A simulated schedule: start/end/exposed-comm seconds per task."""

    schedule: Schedule
    comm: float
    start: list[float]
    end: list[float]
    exposed: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def worker_name(self, w: int) -> str:
        return self.schedule.names.get(w, f"GPU {w}")

    def trace(self) -> Trace:
        trace = Trace(metadata={"simulated": True, "schedule": self.schedule.name, **self.schedule.meta})
        for w, program in enumerate(self.schedule.programs):
            for i in program:
                t = self.schedule.tasks[i]
                trace.add(self.worker_name(w), t.name, self.start[i], self.end[i], t.cat,
                          stage=t.stage, mb=t.mb, iteration=t.iteration)
        return trace


def simulate(schedule: Schedule, comm: float) -> Run:
    tasks, programs = schedule.tasks, schedule.programs
    n = len(tasks)
    start, end, exposed = [0.0] * n, [0.0] * n, [0.0] * n
    done = [False] * n
    pos = [0] * len(programs)
    free = [0.0] * len(programs)
    deferred: list[list[int]] = [[] for _ in programs]  # per worker, deferrable tasks not yet run (FIFO)

    def run(w: int, i: int, ready: float, no_comm: float) -> None:
        start[i], end[i], exposed[i] = ready, ready + tasks[i].duration, ready - no_comm
        free[w] = end[i]
        done[i] = True

    def flush(w: int, until: float | None = None) -> None:
        """Runs worker w's deferred tasks in order: all of them, or those that end by `until`."""
        queue = deferred[w]
        while queue and (until is None or free[w] + tasks[queue[0]].duration / 2 <= until):
            run(w, queue.pop(0), free[w], free[w])

    remaining = n
    while remaining:
        progress = False
        for w, program in enumerate(programs):
            while pos[w] < len(program):
                i = program[pos[w]]
                t = tasks[i]
                if not all(done[d] or d in deferred[w] for d, _ in t.deps):
                    break
                pos[w] += 1
                remaining -= 1
                progress = True
                if t.deferrable:
                    deferred[w].append(i)
                    continue
                queue = deferred[w]
                if queue and (any(d in queue for d, _ in t.deps)
                              or (tasks[queue[0]].stage, tasks[queue[0]].iteration) != (t.stage, t.iteration)):
                    flush(w)
                no_comm = max([free[w]] + [end[d] for d, _ in t.deps])
                ready = max([free[w]] + [end[d] + (comm if hop and tasks[d].worker != w else 0.0)
                                         for d, hop in t.deps])
                if queue:
                    flush(w, until=ready)
                    no_comm, ready = max(no_comm, free[w]), max(ready, free[w])
                run(w, i, ready, no_comm)
            if pos[w] == len(program) and deferred[w]:
                flush(w)
                progress = True
        if not progress:
            stuck = [w for w in range(len(programs)) if deferred[w]]
            if stuck:  # a worker waits for others while holding deferred work someone may need: run it now
                for w in stuck:
                    flush(w)
                continue
            stuck = {schedule.tasks[p[k]].name for p, k in zip(programs, pos) if k < len(p)}
            raise RuntimeError(f"schedule {schedule.name!r} deadlocks: every worker waits ({sorted(stuck)})")
    return Run(schedule, comm, start, end, exposed)


def total_work(run: Run, workers: Sequence[int] | None = None) -> float:
    return sum(t.duration for t in run.schedule.tasks if workers is None or t.worker in workers)
