"""schedule="auto" on a running Pipeline: costs timed on the starting schedule, one plan that every rank computes
alike, then the plan and 1f1b tried for a few steps each and the fastest kept; with offload, each with its
offload plan."""

from __future__ import annotations

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.runtime.offload_planner import SavedBytesMeter, offload_plan_for, slowest_rank
from pipecomm.schedules.auto_schedule import CostMeter, Trials
from pipecomm.schedules.offload import OffloadPlan
from pipecomm.schedules.planner import plan_schedule
from pipecomm.schedules.schedule import Schedule, make_schedule

__all__: list[str] = []


class AutoPlanner:
    """Plans for the slowest rank's F, I and W (a max over the pipeline, so that every rank plans alike) at 1f1b's
    activation memory; the plan's simulation counts no host time, so the plan, 1f1b (one stage per rank) and the
    starting schedule each run a few steps, and the one whose slowest rank's median step was shortest stays. With
    ``saved_bytes`` (offload=True), the starting schedule's steps also count what its forwards save, the plan may
    rely on offload to fit (``plan_schedule``'s ``offload_times``), and every schedule tried after them offloads as
    ``plan_offload`` plans for it (``offload_plan``)."""

    def __init__(self, collectives: PipelineCollectives, num_ranks: int, micro_batches: int, starting: Schedule,
                 saved_bytes: SavedBytesMeter | None = None):
        self.collectives = collectives
        self.num_ranks = num_ranks
        self.micro_batches = micro_batches
        self.meter = CostMeter()
        self.trials = Trials(starting)
        self.saved_bytes = saved_bytes
        self.costs: dict[str, float] | None = None  # the F, I and W planned for
        self.copy_times: list[float] | None = None  # with offload: a micro-batch's copy out and back, in seconds
        self.offload_plan: OffloadPlan | None = None  # for the schedule after_step returned last
        self.step_times: list[tuple[str, float]] | None = None  # once settled: each schedule tried, its step time
        self.settled = False

    def before_step(self, executor: StageExecutor) -> None:
        """On the starting schedule's steps, with offload: what its forwards save counted."""
        if self.saved_bytes and self.trials.running == 0:
            self.saved_bytes.attach(executor)

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
            if self.saved_bytes:
                self.saved_bytes.detach(executor)
            self._plan(executor.schedule)
        following = trials.advance()
        following = following if following is not None else self._settle()
        if self.copy_times is not None:
            costs = {**self.costs, "B": self.costs["I"] + self.costs["W"]}
            self.offload_plan = offload_plan_for(following, costs, self.copy_times)
        return following

    def _plan(self, starting: Schedule) -> None:
        measured = [*self.meter.costs(), *(self.saved_bytes.copy_times() if self.saved_bytes else [])]
        measured = slowest_rank(self.collectives, self.num_ranks, measured, "the measured costs")
        self.costs = dict(zip(("F", "I", "W"), measured[:3]))
        self.copy_times = measured[3:] if self.saved_bytes else None
        self.trials.add(plan_schedule(self.num_ranks, self.micro_batches, self.costs, placement=starting.placement,
                                      offload_times=tuple(self.copy_times) if self.copy_times else None))
        if starting.stages_per_rank == 1:
            self.trials.add(make_schedule("1f1b", self.num_ranks, self.micro_batches))

    def _settle(self) -> Schedule:
        medians = slowest_rank(self.collectives, self.num_ranks, self.trials.medians(), "the measured step times")
        self.step_times = [(schedule.name, seconds) for schedule, seconds in zip(self.trials.schedules, medians)]
        self.settled = True
        # Ties keep the earlier schedule: the starting one, then the plan.
        return self.trials.schedules[medians.index(min(medians))]
