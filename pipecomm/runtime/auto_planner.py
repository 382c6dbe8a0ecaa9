"""schedule="auto" on a running Pipeline: costs timed on the starting schedule, one plan that every rank computes
alike, then the plan and 1f1b tried for a few steps each and the fastest kept."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.schedules.auto_schedule import CostMeter, Trials
from pipecomm.schedules.planner import plan_schedule
from pipecomm.schedules.schedule import Schedule, make_schedule

__all__: list[str] = []


class AutoPlanner:
    """Plans for the slowest rank's F, I and W (a max over the pipeline, so that every rank plans alike) at 1f1b's
    activation memory; the plan's simulation counts no host time, so the plan, 1f1b (one stage per rank) and the
    starting schedule each run a few steps, and the one whose slowest rank's median step was shortest stays."""

    def __init__(self, collectives: PipelineCollectives, num_ranks: int, micro_batches: int, starting: Schedule):
        self.collectives = collectives
        self.num_ranks = num_ranks
        self.micro_batches = micro_batches
        self.meter = CostMeter()
        self.trials = Trials(starting)
        self.costs: dict[str, float] | None = None  # the F, I and W planned for
        self.step_times: list[tuple[str, float]] | None = None  # once settled: each schedule tried, its step time
        self.settled = False

    def after_step(self, executor: StageExecutor) -> Schedule | None:
        """The schedule the next steps run, when it changes (or, the last time, is settled on); None otherwise."""
        trials = self.trials
        if not trials.count_step():
            return None
        if trials.running == 0:
            self.meter.add_step(step_trace.compute_spans(executor))
        if not trials.record(step_trace.step_seconds(executor)):
            return None
        if trials.running == 0:
            self._plan(executor.schedule)
        following = trials.advance()
        return following if following is not None else self._settle()

    def _plan(self, starting: Schedule) -> None:
        costs = self._slowest_rank(self.meter.costs(), "the measured costs")
        self.costs = dict(zip(("F", "I", "W"), costs))
        self.trials.add(plan_schedule(self.num_ranks, self.micro_batches, self.costs, placement=starting.placement))
        if starting.stages_per_rank == 1:
            self.trials.add(make_schedule("1f1b", self.num_ranks, self.micro_batches))

    def _settle(self) -> Schedule:
        medians = self._slowest_rank(self.trials.medians(), "the measured step times")
        self.step_times = [(schedule.name, seconds) for schedule, seconds in zip(self.trials.schedules, medians)]
        self.settled = True
        # Ties keep the earlier schedule: the starting one, then the plan.
        return self.trials.schedules[medians.index(min(medians))]

    def _slowest_rank(self, values: list[float], what: str) -> list[float]:
        """Each value's maximum over the pipeline's ranks (the same list on every rank)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.collectives.wire_device())
        if self.num_ranks > 1:
            self.collectives.all_reduce(tensor, dist.ReduceOp.MAX, f"the all-reduce of {what}")
        return tensor.tolist()
