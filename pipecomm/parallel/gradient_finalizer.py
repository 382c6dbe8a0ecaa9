"""A step's gradients made final: each stage's reductions over its replicas as soon as its last backward is done,
shared parameters summed over their holders, and clipping by the norm over the whole pipeline."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pipecomm.parallel.grad_sync import DataParallelGrads, SharedParameters, local_shard, stage_norm
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.parallel.sharded_stages import ShardedStages

__all__: list[str] = []


class GradientFinalizer:
    """The gradients of this rank's stages (``sinks``), averaged over ``data_group``'s replicas (FSDP's
    reduce-scatter for the sharded parameters, an all-reduce for the rest) and summed over the holders of a
    shared parameter (``shared``, whose values it also makes equal at the start); a step that changed a parameter of
    several of ``modules`` in place is refused."""

    def __init__(self, modules: dict[int, nn.Module], sinks: dict[int, GradientSink], sharded: ShardedStages,
                 data_group: dist.ProcessGroup | None, shared: SharedParameters | None,
                 collectives: PipelineCollectives, loss_parameters: list[nn.Parameter]):
        self.sinks = sinks
        # loss_fn's own parameters where this rank computes the loss (loss_fn an nn.Module, or a method of one): the
        # replicas average them in this order, the same on each.
        self.loss_parameters = loss_parameters
        self.sharded = sharded
        self.shared = shared
        self.collectives = collectives
        self.data_parallel = (DataParallelGrads(sinks, data_group, collectives, skip=sharded.sharded_parameters())
                              if data_group is not None and dist.get_world_size(data_group) > 1 else None)
        if shared:
            sharded_ids = sharded.sharded_parameters()
            if any(id(param) in sharded_ids for param, _, _ in shared.entries):
                raise ValueError("Pipeline: a parameter shared between stages (a tied embedding and head) is "
                                 "sharded by fully_shard; keep it out of fully_shard (shard the blocks)")
            shared.synchronize_values(collectives)
        self._shared_in_place = SharedInPlace(modules)

    def start_step(self) -> None:
        self._shared_in_place.start_step()

    def stage_done(self, stage: int) -> None:
        """A stage's last backward of the step is done: its gradients go to their reductions over the replicas."""
        self.sharded.finish(stage)
        if self.data_parallel:
            self.data_parallel.start(stage)

    def finish_step(self, beside: list[torch.Tensor]) -> None:
        """Waits for the replicas' reductions, averages over them the gradients of loss_fn's parameters; sums the
        shared parameters' gradients over their holders. Other tensors trained ``beside`` the stages' parameters are
        refused under data parallelism: no name pairs them across the replicas."""
        self._shared_in_place.check()
        if self.data_parallel:
            self.data_parallel.finish()
            known = {id(param) for param in self.loss_parameters}
            unnamed = [tensor for tensor in beside if id(tensor) not in known]
            if unnamed:
                raise ValueError(
                    f"Pipeline: under data parallelism, the step trained {len(unnamed)} tensor(s) of shapes "
                    f"{[tuple(tensor.shape) for tensor in unnamed]} beside the stages' parameters that no module "
                    "names (loss_fn's closure, or a tensor a stage keeps outside its modules' parameters): the "
                    "replicas could not pair their gradients to average them. Make loss_fn an nn.Module that holds "
                    "its parameters (they are averaged in its order), or register the tensor as a parameter of a "
                    "stage module")
            if self.loss_parameters:
                self.data_parallel.average(self.loss_parameters)
        if self.shared:
            self.shared.reduce_grads(self._sink_of, self.collectives)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, several_ranks: bool) -> torch.Tensor:
        """Clips every stage's gradients by the global norm across the whole pipeline; returns that norm."""
        # A parameter of two stages on this rank (a tied embedding and head under zb-v) is one gradient, counted and
        # scaled once.
        held = list({id(p): (p, g) for sink in self.sinks.values() for p in sink.params
                     if (g := sink.target(p)) is not None}.values())
        grads = [grad for _, grad in held]
        elsewhere = self.shared.counted_by_another_rank() if self.shared else set()
        counted = [grad for param, grad in held if id(param) not in elsewhere]
        total = stage_norm(counted, norm_type).to(self.collectives.wire_device())
        if several_ranks:
            op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
            self.collectives.all_reduce(total, op, "clip_grad_norm_'s all-reduce of the gradient norm")
        norm = total if norm_type == math.inf else total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_([local_shard(grad) for grad in grads], scale.to(grads[0].device))
        return norm

    def _sink_of(self, param: nn.Parameter) -> GradientSink:
        return next(sink for sink in self.sinks.values() if any(p is param for p in sink.params))


class SharedInPlace:
    """Refuses a step that changed a parameter of several stages in place (``nn.Embedding(max_norm=...)`` renormalizes
    the rows it looks up, in its forward): one process runs each micro-batch through every stage in turn, the pipeline
    runs a stage's forwards in another order, and ranks holding the parameter each hold a copy, so the result would
    differ from one process, silently. Reads each such parameter's version counter before and after the step."""

    def __init__(self, modules: dict[int, nn.Module]):
        stages_of: dict[int, set[int]] = {}
        for stage, module in modules.items():
            for param in module.parameters():
                stages_of.setdefault(id(param), set()).add(stage)
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for module in modules.values():
            across_ranks = getattr(module, "shared_parameters", {})  # split's: the stages that use each
            for name, param in module.named_parameters(remove_duplicate=False):
                if name in across_ranks or len(stages_of[id(param)]) > 1:
                    named.setdefault(id(param), (name, param))
        self._watched = list(named.values())
        self._versions: list[int] = []

    def start_step(self) -> None:
        self._versions = [param._version for _, param in self._watched]

    def check(self) -> None:
        for (name, param), version in zip(self._watched, self._versions):
            if param._version != version:
                raise RuntimeError(
                    f"Pipeline: the parameter {name!r}, which several stages use, was changed in place during the "
                    "step (as nn.Embedding(max_norm=...) renormalizes the rows it looks up): its stages run their "
                    "forwards in another order than one process, and each rank that holds it keeps a copy, so the "
                    "result would differ from one process; renormalize outside the forward (after the optimizer's "
                    "step) or untie the parameter")
