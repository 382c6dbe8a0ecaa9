"""Gradient reductions around the pipeline: parameters shared across stages, and data-parallel replicas."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.failure import Collective, CollectiveWaiter

__all__: list[str] = []


class SharedParameters:
    """Parameters used by several stages (a tied embedding and LM head): one value, summed gradients.

    Stage modules made by ``pipecomm.split`` list them in ``shared_parameters`` (name -> stages).
    Every rank of the job creates the same process groups in the same order, which
    ``dist.new_group`` requires, so the holders of each shared parameter can reduce among themselves.
    """

    def __init__(self, modules: dict[int, nn.Module], global_rank_of_stage: Callable[[int], int],
                 gather: Callable[[object], list]):
        """``gather(value)``: every rank's ``value`` in rank order (``failure.gather_through_store``)."""
        local: dict[int, tuple[tuple[int, ...], str, nn.Parameter]] = {}
        for module in modules.values():
            parameters = dict(module.named_parameters(remove_duplicate=False))
            keys = getattr(module, "shared_parameter_keys", {})
            for name, stages in getattr(module, "shared_parameters", {}).items():
                param = parameters[name]
                holders = tuple(sorted({global_rank_of_stage(stage) for stage in stages}))
                # Two stages on this rank hold it: autograd already sums their grads.
                local.setdefault(id(param), (holders, keys.get(name, name), param))
        # Each holder reduces its shared parameters in the order of their keys (the name on the lowest stage): the
        # holders' orders of parameters and names may differ, and a parameter paired with another of its shape
        # would take the other's value and gradient, silently.
        ordered = sorted((entry for entry in local.values() if len(entry[0]) > 1), key=lambda entry: entry[:2])
        described = [(holders, key, tuple(param.shape), str(param.dtype)) for holders, key, param in ordered]
        every_rank = gather((described, [param.requires_grad for _, _, param in ordered]))
        _check_holders_agree([entries for entries, _ in every_rank])
        _check_frozen_alike(every_rank)
        every_rank = [entries for entries, _ in every_rank]
        groups = {holders: dist.new_group(list(holders))
                  for holders in sorted({entry[0] for ranks in every_rank for entry in ranks})}
        self.entries = [(param, holders, groups[holders]) for holders, _, param in ordered]

    def __bool__(self) -> bool:
        return bool(self.entries)

    def synchronize_values(self, collectives: CollectiveWaiter) -> None:
        """Every holder starts from the value of the lowest stage that holds the parameter."""
        for param, holders, group in self.entries:
            collectives.wait(Collective.broadcast(local_shard(param.data), holders[0], group,
                                                  f"the broadcast of a shared parameter among ranks {holders}",
                                                  collectives.timeout))

    def counted_by_another_rank(self) -> set[int]:
        """ids of the shared parameters whose gradient a lower holder counts in a pipeline-wide norm: after
        reduce_grads every holder has the same sum, which the norm must count once, as one process does."""
        rank = dist.get_rank()
        return {id(param) for param, holders, _ in self.entries if rank != holders[0]}

    def reduce_grads(self, sink_for: Callable[[nn.Parameter], GradientSink], collectives: CollectiveWaiter) -> None:
        """Sums the gradients of the shared parameters that require grad (every holder freezes them alike)."""
        for param, holders, group in self.entries:
            if not param.requires_grad:
                continue
            grad = local_shard(_grad_or_zeros(sink_for(param), param))
            collectives.wait(Collective.all_reduce(
                grad, group, f"the all-reduce of a shared parameter's gradient among ranks {holders} (a holder where it "
                "does not require grad skips it: freeze it alike on every rank that holds it, under each of its names "
                "there)", collectives.timeout))


def _check_frozen_alike(every_rank: list[tuple[list[tuple], list[bool]]]) -> None:
    """Every holder of a shared parameter freezes it alike: one that does not sum its gradient would leave the others
    waiting for it."""
    trains: dict[tuple, dict[int, bool]] = {}
    for rank, (described, requires_grad) in enumerate(every_rank):
        for (holders, key, *_), wanted in zip(described, requires_grad):
            trains.setdefault((holders, key), {})[rank] = wanted
    for (holders, key), by_rank in trains.items():
        if len(set(by_rank.values())) > 1:
            frozen = [rank for rank, wanted in by_rank.items() if not wanted]
            raise ValueError(f"Pipeline: the parameter shared among ranks {holders} under the key {key!r} is frozen "
                             f"(requires_grad=False) on ranks {frozen} only: freeze it alike on every rank that holds "
                             "it, under each of its names there (a tied embedding's and head's), or through the "
                             "original model, where it is one object")


def _check_holders_agree(every_rank: list[list[tuple]]) -> None:
    """Every holder of a shared parameter lists it under the same key, shape and dtype, among the same holders."""
    for rank, described in enumerate(every_rank):
        for holders, *parameter in described:
            for other in holders:
                if (holders, *parameter) not in every_rank[other]:
                    key, shape, dtype = parameter
                    found = [entry[1:] for entry in every_rank[other] if entry[0] == holders]
                    raise ValueError(
                        f"Pipeline: rank {rank} shares a parameter with ranks {holders} under the key {key!r} "
                        f"{shape} {dtype}, and rank {other} holds no such parameter among them (it has {found}): "
                        "shared parameters pair by the name the lowest stage gives them (split's "
                        "shared_parameter_keys, or the stages' own names); split every rank's stages from the same "
                        "model, or name a parameter shared by hand-made stages alike on each")


class DataParallelGrads:
    """Averages each stage's gradients over its data-parallel replicas (but those of ``skip``, ids of the parameters
    FSDP reduces itself).

    A stage's all-reduce starts as soon as its last micro-batch's backward is done, so it overlaps
    the rest of the pipeline's flush; ``finish`` waits for them at the end of the step. A parameter no replica
    used in the step (an idle expert, a head left out) keeps no gradient, as in one process, where an optimizer
    then skips it: a replica without one joins the reduction with zeros, and the replicas' "used" flags, reduced
    beside the gradients, say where every one went without.
    """

    def __init__(self, sinks: dict[int, GradientSink], group: dist.ProcessGroup, collectives: CollectiveWaiter,
                 skip: set[int] = frozenset()):
        self.sinks = sinks
        self.group = group
        self.collectives = collectives
        self.size = dist.get_world_size(group)
        params = {stage: [p for p in sink.params if id(p) not in skip] for stage, sink in sinks.items()}
        holders: dict[int, list[int]] = {}
        for stage, own in params.items():
            for param in own:
                holders.setdefault(id(param), []).append(stage)
        # A parameter of two stages on this rank is complete only when both are: reduce it last.
        self._own = {stage: [p for p in own if len(holders[id(p)]) == 1] for stage, own in params.items()}
        self._late = list({id(p): (stage, p) for stage, own in params.items() for p in own
                           if len(holders[id(p)]) > 1}.values())
        self._in_flight: list[tuple[Collective, torch.Tensor]] = []
        self._reduced: list[tuple[int, nn.Parameter, bool]] = []  # (stage, parameter, whether this replica used it)
        self._all_used: torch.Tensor | None = None  # ones, for the steps where this replica used every parameter

    def start(self, stage: int) -> None:
        for param in self._own[stage]:
            self._reduce(stage, param)

    def finish(self) -> None:
        for stage, param in self._late:
            self._reduce(stage, param)
        in_flight, self._in_flight = self._in_flight, []
        reduced, self._reduced = self._reduced, []
        flags = [flag for _, _, flag in reduced]
        used = self._used_flags(flags, reduced[0][1].device) if reduced else None
        for collective, _ in in_flight:
            self.collectives.wait(collective)
        grads = [grad for _, grad in in_flight]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.size)
        if used is not None:
            self.collectives.wait(used)
        if not all(flags):  # only a replica that went without some gradient reads the flags back (a wait for the GPU)
            for (stage, param, _), anywhere in zip(reduced, used.tensors[0].tolist()):
                if not anywhere and not self.sinks[stage].main_grad:
                    param.grad = None

    def average(self, params: list[nn.Parameter]) -> None:
        """Averages the gradients of ``params`` (loss_fn's, in its order, the same on every replica) over the
        replicas in one all-reduce, as each replica's loss saw its share of the batch; one that no replica used keeps
        none, as in one process."""
        params = [param for param in params if param.requires_grad]
        if not params:
            return
        flags = [param.grad is not None for param in params]
        grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        used = self._used_flags(flags, flat.device)
        self.collectives.wait(Collective.all_reduce(
            flat, self.group, "the data-parallel all-reduce of the gradients of loss_fn's parameters",
            self.collectives.timeout))
        self.collectives.wait(used)
        flat /= self.size
        anywhere = used.tensors[0].tolist() if not all(flags) else [True] * len(params)
        for param, part, grad, kept in zip(params, flat.split([grad.numel() for grad in grads]), grads, anywhere):
            param.grad = part.view_as(grad).clone() if kept else None

    def _used_flags(self, flags: list[bool], device: torch.device) -> Collective:
        """Starts the MAX all-reduce of which parameters each replica used. Where this one used them all, its
        all-ones tensor stays all ones under MAX: it is kept for the next steps."""
        if all(flags):
            if self._all_used is None or self._all_used.numel() != len(flags) or self._all_used.device != device:
                self._all_used = torch.ones(len(flags), dtype=torch.uint8, device=device)
            tensor = self._all_used
        else:
            tensor = torch.tensor(flags, dtype=torch.uint8).to(device)
        return Collective.all_reduce(tensor, self.group, "the data-parallel all-reduce of which parameters got gradients",
                                     self.collectives.timeout, dist.ReduceOp.MAX)

    def _reduce(self, stage: int, param: nn.Parameter) -> None:
        if not param.requires_grad:
            return  # frozen: no gradient, on every replica alike
        self._reduced.append((stage, param, self.sinks[stage].target(param) is not None))
        grad = local_shard(_grad_or_zeros(self.sinks[stage], param))
        collective = Collective.all_reduce(grad, self.group, f"the data-parallel all-reduce of stage {stage}'s gradients",
                                           self.collectives.timeout)
        self._in_flight.append((collective, grad))


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """What a process group reduces of a gradient: a DTensor's (a tensor-parallel layer's) local shard, which it
    shares storage with."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grad_or_zeros(sink: GradientSink, param: nn.Parameter) -> torch.Tensor:
    """The accumulated gradient of a parameter that requires grad; zeros where this rank got none, so every
    member joins the reduction."""
    if sink.target(param) is None:
        sink.add([torch.zeros_like(param)], [param])
    return sink.target(param)


def stage_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The max (inf) or the sum of squares (2) of a rank's gradients, as a 0-d fp32 tensor on the host or its GPU.

    A DTensor gradient (FSDP's shard, a tensor-parallel layer's) counts whole: its part is reduced over its
    mesh (``full_tensor``) with the others of its mesh and placements, in the order of their first gradient,
    which every rank of that mesh shares.
    """
    def part(grad: torch.Tensor) -> torch.Tensor:
        return grad.abs().max().float() if norm_type == math.inf else grad.float().pow(2).sum()

    combine = torch.max if norm_type == math.inf else torch.sum
    parts = [part(grad) for grad in grads if not isinstance(grad, DTensor)]
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            by_layout.setdefault((grad.device_mesh, grad.placements), []).append(part(grad))
    for same_layout in by_layout.values():
        reduced = same_layout[0]
        for other in same_layout[1:]:
            reduced = torch.maximum(reduced, other) if norm_type == math.inf else reduced + other
        parts.append(reduced.full_tensor())
    return combine(torch.stack(parts)) if parts else torch.zeros(())
