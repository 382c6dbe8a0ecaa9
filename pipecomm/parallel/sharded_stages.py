"""Stages sharded with torch's FSDP2 (``fully_shard``): gathered once per step, their gradients reduce-scattered once."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__: list[str] = []


class ShardedStages:
    """The ``fully_shard`` modules of this rank's stages, driven through a pipeline step as torch's pipelining does.

    FSDP2 would all-gather a module's parameters at every micro-batch's forward and backward and
    reduce-scatter its gradients after every backward. Within a step these stages keep their
    parameters gathered (``reshard_after_forward`` and ``reshard_after_backward`` off) and accumulate
    unsharded gradients (``requires_gradient_sync`` off); ``finish`` reduce-scatters a stage's gradients
    once, after its last backward of the step, and reshards it, so that the optimizer steps the shards
    and the next step gathers their new values. While gathered, a module's parameters are FSDP's
    unsharded tensors: the executor reads them at each backward (``GradientSink(live=...)``).
    """

    def __init__(self, modules: dict[int, nn.Module]):
        found = {stage: [m for m in module.modules() if isinstance(m, FSDPModule)] for stage, module in modules.items()}
        self.by_stage = {stage: sharded for stage, sharded in found.items() if sharded}
        self._stepped = False  # FSDP sets its streams up at its first forward: no gather ahead before
        for sharded in self.by_stage.values():
            for module in sharded:
                module.set_reshard_after_forward(False, recurse=False)
            _accumulate_unsharded(sharded)

    def __bool__(self) -> bool:
        return bool(self.by_stage)

    def holds(self, stage: int) -> bool:
        return stage in self.by_stage

    def sharded_parameters(self) -> set[int]:
        """The ids of the parameters FSDP reduces: pipecomm's own data parallelism must leave them alone."""
        return {id(param) for found in self.by_stage.values() for module in found for param in module.parameters()}

    def gather_ahead(self) -> None:
        """At a step's start, every stage's all-gathers issued at once (``unshard(async_op=True)``), so that a later
        stage's shards arrive while the stages before it compute rather than when its first forward asks for them
        (a device trace of pp 2 x FSDP 2 on H200s had the second stage's first forward wait 2.5 ms of a 514 ms step for
        them); FSDP's pre-forward waits for them."""
        if not self._stepped:
            self._stepped = True
            return
        for found in self.by_stage.values():
            for module in found:
                module.unshard(async_op=True)

    def finish(self, stage: int) -> None:
        """After the stage's last backward of the step: one reduce-scatter of its accumulated gradients, then reshard."""
        found = self.by_stage.get(stage)
        if not found:
            return
        for module in found:
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True, recurse=False)
            module.set_requires_gradient_sync(True, recurse=False)
        states = [fully_shard.state(module) for module in found]
        for state in states:
            for group in _param_groups(state):
                group.post_backward()
        for state in states:
            if state._is_root:  # waits for the reduce-scatters and settles FSDP's per-step state
                state._root_post_backward_final_callback()
        _accumulate_unsharded(found)

    def reshard(self) -> None:
        """Frees the gathered parameters after a forward-only pass (no backward reshards them)."""
        for found in self.by_stage.values():
            for module in found:
                module.reshard()


def _param_groups(state) -> list:
    """A fully_shard state's parameter groups: torch 2.13 keeps a list, torch 2.11 one group or None."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _accumulate_unsharded(modules: list[FSDPModule]) -> None:
    """Until the stage's last backward of the step: no reshard after a backward, no reduce-scatter."""
    for module in modules:
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False, recurse=False)
        module.set_requires_gradient_sync(False, recurse=False)
