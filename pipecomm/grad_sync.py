"""Gradient reductions around the pipeline: parameters shared across stages, and data-parallel replicas."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipecomm.executor import GradientSink
from pipecomm.failure import Collective

__all__: list[str] = []


class SharedParameters:
    """Parameters used by several stages (a tied embedding and LM head): one value, summed gradients.

    Stage modules made by ``pipecomm.split`` list them in ``shared_parameters`` (name -> stages).
    Every rank of the job creates the same process groups in the same order, which
    ``dist.new_group`` requires, so the holders of each shared parameter can reduce among themselves.
    """

    def __init__(self, modules: dict[int, nn.Module], global_rank_of_stage: Callable[[int], int]):
        local: list[tuple[nn.Parameter, tuple[int, ...]]] = []
        seen: set[int] = set()
        for module in modules.values():
            parameters = dict(module.named_parameters(remove_duplicate=False))
            for name, stages in getattr(module, "shared_parameters", {}).items():
                param = parameters[name]
                if id(param) in seen:
                    continue  # two stages on this rank hold it: autograd already sums their grads
                seen.add(id(param))
                holders = tuple(sorted({global_rank_of_stage(stage) for stage in stages}))
                local.append((param, holders))
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, sorted({holders for _, holders in local if len(holders) > 1}))
        groups = {holders: dist.new_group(list(holders)) for holders in sorted({h for ranks in every_rank for h in ranks})}
        self.entries = [(param, holders, groups[holders]) for param, holders in local if len(holders) > 1]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def synchronize_values(self, wait: Callable[[Collective], None]) -> None:
        """Every holder starts from the value of the lowest stage that holds the parameter."""
        for param, holders, group in self.entries:
            data = param.data
            wait(Collective(lambda: dist.broadcast(data, src=holders[0], group=group, async_op=True),
                            [data], group, f"the broadcast of a shared parameter among ranks {holders}"))

    def reduce_grads(self, sink_for: Callable[[nn.Parameter], GradientSink], wait: Callable[[Collective], None]) -> None:
        """Sums the gradients of the shared parameters that require grad (every holder freezes them alike)."""
        for param, holders, group in self.entries:
            if not param.requires_grad:
                continue
            grad = _grad_or_zeros(sink_for(param), param)
            wait(Collective(lambda: dist.all_reduce(grad, group=group, async_op=True), [grad], group,
                            f"the all-reduce of a shared parameter's gradient among ranks {holders}"))


class DataParallelGrads:
    """Averages each stage's gradients over its data-parallel replicas.

    A stage's all-reduce starts as soon as its last micro-batch's backward is done, so it overlaps
    the rest of the pipeline's flush; ``finish`` waits for them at the end of the step.
    """

    def __init__(self, sinks: dict[int, GradientSink], group: dist.ProcessGroup):
        self.sinks = sinks
        self.group = group
        self.size = dist.get_world_size(group)
        holders: dict[int, list[int]] = {}
        for stage, sink in sinks.items():
            for param in sink.params:
                holders.setdefault(id(param), []).append(stage)
        # A parameter of two stages on this rank is complete only when both are: reduce it last.
        self._own = {stage: [p for p in sink.params if len(holders[id(p)]) == 1] for stage, sink in sinks.items()}
        self._late = list({id(p): (stage, p) for stage, sink in sinks.items() for p in sink.params
                           if len(holders[id(p)]) > 1}.values())
        self._in_flight: list[tuple[Collective, torch.Tensor]] = []

    def start(self, stage: int) -> None:
        for param in self._own[stage]:
            self._reduce(stage, param)

    def finish(self, wait: Callable[[Collective], None]) -> None:
        for stage, param in self._late:
            self._reduce(stage, param)
        in_flight, self._in_flight = self._in_flight, []
        for collective, _ in in_flight:
            wait(collective)
        grads = [grad for _, grad in in_flight]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.size)

    def _reduce(self, stage: int, param: nn.Parameter) -> None:
        if not param.requires_grad:
            return  # frozen: no gradient, on every replica alike
        grad = _grad_or_zeros(self.sinks[stage], param)
        collective = Collective(lambda: dist.all_reduce(grad, group=self.group, async_op=True), [grad], self.group,
                                f"the data-parallel all-reduce of stage {stage}'s gradients")
        self._in_flight.append((collective, grad))


def _grad_or_zeros(sink: GradientSink, param: nn.Parameter) -> torch.Tensor:
    """The accumulated gradient of a parameter that requires grad; zeros where this rank got none, so every
    member joins the reduction."""
    if sink.target(param) is None:
        sink.add([torch.zeros_like(param)], [param])
    return sink.target(param)
