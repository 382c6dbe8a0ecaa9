"""What a Pipeline measures on its first steps and changes after them: schedule="auto"'s trials, a zb-h2 or zb-v
rebuilt for the measured costs, offload=True's plan; each change from the next step on."""

from __future__ import annotations

import torch
from torch import nn

from pipecomm.runtime.auto_planner import AutoPlanner
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.offload_planner import OffloadPlanner, SavedBytesMeter
from pipecomm.runtime.prepared_stages import PreparedStages
from pipecomm.runtime.schedule_refit import ScheduleRefit
from pipecomm.schedules.offload import OffloadPlan

__all__: list[str] = []


class StepTuning:
    """The measurements of the first steps (which time compute on the device, where there is one) and the schedule
    and offload plan they lead to, installed in the rank's prepared stages; afterwards the device timeline stays only
    if the user asked for it."""

    def __init__(self, prepared: PreparedStages, collectives: PipelineCollectives, num_ranks: int,
                 micro_batches: int, device: torch.device, modules: list[nn.Module], *, auto: bool, refit: bool,
                 offload: bool | OffloadPlan, device_timing: bool):
        self.prepared = prepared
        self.device = device
        self.device_timing = device_timing
        self.planned_costs: dict[str, float] | None = None  # "auto", "zb-h2", "zb-v": the F, I and W planned for
        self.auto_step_times: list[tuple[str, float]] | None = None  # "auto": each schedule it tried
        self.offload_plan: OffloadPlan | None = None
        schedule = prepared.executor.schedule
        saved_bytes = SavedBytesMeter(device, modules) if offload is True and auto else None
        self._planner = AutoPlanner(collectives, num_ranks, micro_batches, schedule, saved_bytes) if auto else None
        self._refit = ScheduleRefit(collectives, schedule) if refit else None
        self._offload_planner = (OffloadPlanner(collectives, num_ranks, device, modules)
                                 if offload is True and not auto else None)
        if isinstance(offload, OffloadPlan):  # checked against the schedule as the Pipeline was built
            self._use_offload_plan(offload)
        prepared.executor.hold_graphs(self.measuring)

    @property
    def measuring(self) -> bool:
        """Whether later steps are still measured for a change of schedule or an offload plan."""
        return bool(self._planner or self._refit or self._offload_planner)

    def before_step(self) -> None:
        """On a measured step: what its forwards save counted (offload=True)."""
        if self._planner:
            self._planner.before_step(self.prepared.executor)
        elif self._offload_planner:
            self._offload_planner.before_step(self.prepared.executor)

    def after_step(self) -> None:
        """What the step measured, acted on."""
        if self._planner:
            self._after_auto_step()
        elif self._refit or self._offload_planner:
            self._after_measured_step()
        else:
            return
        self.prepared.executor.hold_graphs(self.measuring)

    def _after_measured_step(self) -> None:
        """The first step timed: a zb-h2 or zb-v rebuilt for the measured costs, and with offload=True the plan for
        the schedule the next steps run."""
        executor = self.prepared.executor
        following = self._refit.after_step(executor) if self._refit else None
        plan = (self._offload_planner.after_step(executor, following or executor.schedule)
                if self._offload_planner else None)
        if following is not None:
            self.planned_costs = self._refit.costs
            self.prepared.switch_schedule(following, self.device_timing)
        if plan is not None:
            self._use_offload_plan(plan)
        if not self.device_timing:
            executor.device_timeline = None
        self._refit = self._offload_planner = None

    def _after_auto_step(self) -> None:
        """schedule="auto": the schedule it tries next, or settles on."""
        planner = self._planner
        following = planner.after_step(self.prepared.executor)
        self.planned_costs = planner.costs
        if following is None:
            return
        # Trials time their steps on the device (when on a GPU); once settled, only if the user asked to.
        self.prepared.switch_schedule(following, self.device_timing or not planner.settled)
        if planner.offload_plan:
            self._use_offload_plan(planner.offload_plan)
        if planner.settled:
            self.auto_step_times = planner.step_times
            self._planner = None

    def _use_offload_plan(self, plan: OffloadPlan) -> None:
        self.offload_plan = plan
        self.prepared.set_offload(plan, self.device)
