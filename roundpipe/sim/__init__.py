"""Discrete-event simulator of pipeline schedules (GPipe, 1F1B, interleaved 1F1B,
looped BFS, Zero Bubble ZB-H1/ZB-H2/ZB-V, RoundPipe synchronous, asynchronous and
with a split backward).

    costs      Costs: per-layer/head times and per-hop communication (the modelling rules)
    events     Task, Schedule, simulate: the event core (workers run programs in order)
    static     weight-bound schedules;  roundpipe: round-robin dispatch
    zerobubble ZB-H1, ZB-H2, ZB-V: backward split into B and W (Costs.w_fraction)
    metrics    bubble ratio split into fill / switch / drain / steady, for any Trace
    simulate   simulate(schedule, costs, workers, microbatches, ...) -> Result
    allreduce  AllReduce: data-parallel ranks and their bucketed ring all-reduce of gradients
    uploads    Uploads: each stage's weight bytes over a PCIe bandwidth, overlapping compute
    hoststep   HostStep: the optimizer step on the host (whole or per layer, synchronous or one step stale)
    disk       Disk: the state tier's layers on NVMe, read ahead of and written behind their host step
    scaling    data_parallel(...): one rank's iteration time with the reduction, scaling vs 1 rank
    tune       best_partition / tuned_plan: the planner's candidates ranked by simulation
    cli        `roundpipe simulate`;  timeline: `roundpipe timeline TRACE --png FILE`
"""
from roundpipe.sim.allreduce import AllReduce, ring_time
from roundpipe.sim.costs import Costs, sizes_from_plan
from roundpipe.sim.disk import Disk
from roundpipe.sim.hoststep import HostStep
from roundpipe.sim.metrics import Bubbles, bubbles
from roundpipe.sim.scaling import DataParallelResult, data_parallel
from roundpipe.sim.simulate import SCHEDULES, HostStepResult, Result, host_step, roundpipe_sizes, simulate
from roundpipe.sim.tune import best_partition, tuned_plan
from roundpipe.sim.uploads import Uploads

__all__ = ["AllReduce", "ring_time", "DataParallelResult", "data_parallel", "Costs", "sizes_from_plan", "Bubbles",
           "bubbles", "SCHEDULES", "Result", "roundpipe_sizes", "simulate", "best_partition", "tuned_plan", "Uploads",
           "HostStep", "HostStepResult", "host_step", "Disk"]
