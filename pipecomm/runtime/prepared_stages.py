"""A rank's stage modules made ready for its schedule (gradient sinks, zero-bubble deferral, recomputation, the
executor over them), and those changes to the user's modules undone when the Pipeline closes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipecomm.parallel.sharded_stages import ShardedStages
from pipecomm.runtime.checks import gradient_hook, has_post_accumulate_hooks
from pipecomm.runtime.device_timing import DeviceTimeline
from pipecomm.runtime.executor import StageExecutor
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.runtime.recompute import checkpoint_stages
from pipecomm.runtime.split_backward import WeightGradStore, defer_linear_weight_grads, warn_if_nothing_deferred
from pipecomm.schedules.offload import OffloadPlan
from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []


def _nothing() -> None:
    pass


class PreparedStages:
    """The executor over this rank's stage modules, and what was changed in those modules for it."""

    def __init__(self, schedule: Schedule, rank: int, modules: dict[int, nn.Module], sharded: ShardedStages,
                 loss_fn: Callable, channels: dict, *, main_grad: bool, cuda_graphs: bool | str,
                 recompute: bool | Callable[[nn.Module], bool], device_timeline: DeviceTimeline | None,
                 on_stage_backward_done: Callable[[int], None]):
        self.rank = rank
        self.sinks = {stage: GradientSink(list(module.parameters()), main_grad,
                                          live=module if sharded.holds(stage) else None)
                      for stage, module in modules.items()}
        self._modules = list(modules.values())
        self._recompute = recompute
        self.weight_grad_store: WeightGradStore | None = None
        self._undo_deferral = self._undo_recompute = _nothing
        self._fitted_to_split: bool | None = None  # whether the modules are fitted to a split backward; None: not fitted
        self._fit_modules(schedule)
        self.executor = StageExecutor(schedule, rank, modules, self.sinks, channels, loss_fn,
                                      on_stage_backward_done=on_stage_backward_done,
                                      weight_grad_store=self.weight_grad_store, cuda_graphs=cuda_graphs,
                                      device_timeline=device_timeline)
        self._deferral_checked = False

    def check_parameters(self) -> None:
        """Before a step: a ValueError if a stage's parameters were replaced by other objects since the Pipeline was
        built (its gradient sinks, shared-parameter sums, zero-bubble deferrals and CUDA graphs hold the old ones, and
        would hand the new ones some gradients and not others), or if one has a post-accumulate-grad hook that its
        backward would not run."""
        for stage, runner in self.executor.stages.items():
            sink = self.sinks[stage]
            if sink.replaced_in(runner.module):
                raise ValueError(f"Pipeline: stage {stage}'s parameters are not the ones the Pipeline was built with "
                                 "(replaced since, as load_state_dict(assign=True) or assigning a new nn.Parameter "
                                 "does); load in place (assign=False, the default) or build a new Pipeline")
            skipping = runner.skips_post_accumulate_hooks()
            if skipping and has_post_accumulate_hooks(sink.params):
                hook = gradient_hook(runner.module, post_accumulate_only=True)
                raise ValueError(f"Pipeline: stage {stage}'s {hook}, which {skipping} would not run (autograd's "
                                 "accumulation into .grad runs it: an unsplit schedule such as 1f1b, without "
                                 'main_grad, eager or cuda_graphs="auto"); remove the hook or run such a Pipeline')

    def check_deferral(self) -> None:
        """After the first step: a zero-bubble schedule whose W had nothing to defer says so, once."""
        if not self._deferral_checked and self.weight_grad_store:
            self._deferral_checked = True
            warn_if_nothing_deferred(self.weight_grad_store, f"Pipeline rank {self.rank}", self.executor.schedule.name,
                                     sorted(self.executor.stages))

    def switch_schedule(self, schedule: Schedule, device_timing: bool) -> None:
        """From the next step on, ``schedule``: its Linear layers defer if it splits this rank's backward, and run
        as the user's otherwise."""
        self._fit_modules(schedule)
        self.executor.switch_schedule(schedule, self.weight_grad_store, device_timing)

    def set_offload(self, plan: OffloadPlan, device: torch.device) -> None:
        """From the next step on, this rank's waits of ``plan`` go to host memory."""
        self.executor.set_offload(ActivationOffloader(device, plan.offloaded[self.rank], self._modules),
                                  plan.reloads_at(self.rank))

    def restore(self) -> None:
        """The user's modules as they were: recomputation undone first, as it wraps the deferring forward."""
        self._undo_recompute()
        self._undo_deferral()
        self._undo_recompute = self._undo_deferral = _nothing
        self._fitted_to_split = None

    def _fit_modules(self, schedule: Schedule) -> None:
        """The zero-bubble machinery only where this rank's schedule splits a backward into I and W, and the
        recomputation around it (a recomputed Linear then recomputes the deferring forward)."""
        splits = schedule.splits_backward(self.rank)
        if splits == self._fitted_to_split:
            return
        self.restore()
        self.weight_grad_store = WeightGradStore() if splits else None
        if self.weight_grad_store:
            self._undo_deferral = defer_linear_weight_grads(self._modules, self.weight_grad_store)
        self._undo_recompute = checkpoint_stages(self._modules, self._recompute)
        self._fitted_to_split = splits
