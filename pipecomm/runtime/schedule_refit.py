"""A zb-h2 or zb-v asked for by name on a running Pipeline: its order is list-scheduled for F, I and W, and one built
for equal costs loses much of its gain where I costs twice W (measured: zb-v 0.96x torch 1F1B against 1.17x
simulated for the measured costs), so the first step times the passes and every rank rebuilds the order alike."""

from __future__ import annotations

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.runtime.offload_planner import slowest_rank
from pipecomm.schedules.auto_schedule import CostMeter
from pipecomm.schedules.schedule import Schedule, make_schedule

__all__: list[str] = []


class ScheduleRefit:
    """Times one step of ``schedule``'s passes and gives the same schedule rebuilt for the slowest rank's F, I and W
    (a max over the pipeline, so that every rank builds the same order)."""

    def __init__(self, collectives: PipelineCollectives, schedule: Schedule):
        self.collectives = collectives
        self.schedule = schedule
        self.costs: dict[str, float] | None = None  # the F, I and W it rebuilt for, in seconds

    def after_step(self, executor: StageExecutor) -> Schedule | None:
        """The rebuilt schedule, or None where a pass took no time (nothing to order by: the order stays)."""
        meter = CostMeter()
        meter.add_step(step_trace.compute_spans(executor))
        measured = slowest_rank(self.collectives, self.schedule.num_ranks, meter.costs(), "the measured costs")
        if min(measured) <= 0.0:
            return None
        self.costs = dict(zip(("F", "I", "W"), measured))
        schedule = self.schedule
        return make_schedule(schedule.name, schedule.num_ranks, schedule.micro_batches, schedule.stages_per_rank,
                             costs=self.costs)
