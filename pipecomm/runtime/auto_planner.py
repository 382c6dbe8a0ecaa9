"""schedule="auto" on a running Pipeline: the first steps timed, then one plan that every rank computes alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.schedules.auto_schedule import CostMeter
from pipecomm.schedules.planner import plan_schedule
from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []


class AutoPlanner:
    """Times each rank's F, I and W over the measured steps, then plans for the slowest rank's costs (a max over the
    pipeline, so that every rank plans alike) at 1f1b's activation memory."""

    def __init__(self, collectives: PipelineCollectives, num_ranks: int, micro_batches: int):
        self.collectives = collectives
        self.num_ranks = num_ranks
        self.micro_batches = micro_batches
        self.meter = CostMeter()

    def after_step(self, executor: StageExecutor) -> tuple[Schedule, dict[str, float]] | None:
        """The plan and the costs it was made for, once enough steps were measured; None before."""
        if not self.meter.add_step(lambda: step_trace.compute_spans(executor)):
            return None
        costs = torch.tensor(self.meter.costs(), dtype=torch.float64, device=self.collectives.wire_device())
        if self.num_ranks > 1:
            self.collectives.all_reduce(costs, dist.ReduceOp.MAX, "the all-reduce of the measured costs")
        measured = dict(zip(("F", "I", "W"), costs.tolist()))
        plan = plan_schedule(self.num_ranks, self.micro_batches, measured, placement=executor.schedule.placement)
        return plan, measured
