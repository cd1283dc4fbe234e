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
    remaining = n
    while remaining:
        progress = False
        for w, program in enumerate(programs):
            while pos[w] < len(program):
                i = program[pos[w]]
                t = tasks[i]
                if not all(done[d] for d, _ in t.deps):
                    break
                no_comm = max([free[w]] + [end[d] for d, _ in t.deps])
                ready = max([free[w]] + [end[d] + (comm if hop and tasks[d].worker != w else 0.0)
                                         for d, hop in t.deps])
                start[i], end[i], exposed[i] = ready, ready + t.duration, ready - no_comm
                free[w] = end[i]
                done[i] = True
                pos[w] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {schedule.tasks[p[k]].name for p, k in zip(programs, pos) if k < len(p)}
            raise RuntimeError(f"schedule {schedule.name!r} deadlocks: every worker waits ({sorted(stuck)})")
    return Run(schedule, comm, start, end, exposed)


def total_work(run: Run, workers: Sequence[int] | None = None) -> float:
    return sum(t.duration for t in run.schedule.tasks if workers is None or t.worker in workers)
