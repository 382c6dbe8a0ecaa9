"""CUDA-graph capture of a stage's forward and backward: one graph launch per action instead of one launch per kernel.

A small model's stage is bound by the host launching its kernels one by one. With static shapes,
each stage's forward (with the loss, on the last stage) and backward are captured once and then
replayed. A graph's activations live in its own memory, so a stage gets one pair of graphs per
micro-batch it can hold in flight (the schedule says how many), used round-robin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.runtime import boundary
from pipecomm.schedules.schedule import Schedule
from pipecomm.runtime.split_backward import DeferredGrad, Deferral, WeightGradStore, check_reported, weight_grad

__all__: list[str] = []

_WARMUP_ITERATIONS = 2  # eager runs on a side stream before capture, so lazy initialisation stays out of the graph


def in_flight_slots(schedule: Schedule, rank: int, stage: int) -> int:
    """How many micro-batches ``stage`` holds between its forward and its last backward pass (B, or W where the
    backward is split) at most; checks that each kind of pass runs the micro-batches in forward order."""
    order = [action.micro_batch for action in schedule.actions[rank] if action.stage == stage and action.kind == "F"]
    for kind in ("B", "I", "W"):
        runs = [action.micro_batch for action in schedule.actions[rank] if action.stage == stage and action.kind == kind]
        if runs and runs != order:
            raise ValueError(f"cuda_graphs: schedule {schedule.name!r} runs stage {stage}'s {kind} passes out of "
                             "forward order, which round-robin graph slots cannot follow")
    held = most = 0
    for action in schedule.actions[rank]:
        if action.stage == stage and action.kind in ("F", "B", "W"):
            held += 1 if action.kind == "F" else -1
            most = max(most, held)
    return most


class _Slot:
    """One captured forward and its backward (one graph, or I and W) and the static tensors they read and write."""

    def __init__(self, inputs: boundary.Flat, targets: boundary.Flat, outputs: list, grad_outputs: list,
                 forward: torch.cuda.CUDAGraph, backward: torch.cuda.CUDAGraph, input_grads: list, param_grads: list,
                 weights: torch.cuda.CUDAGraph | None = None, weight_grads: list | None = None):
        self.inputs, self.targets, self.outputs = inputs, targets, outputs
        self.grad_outputs, self.forward, self.backward = grad_outputs, forward, backward
        self.input_grads, self.param_grads = input_grads, param_grads
        self.weights, self.weight_grads = weights, weight_grads


class GraphedStage:
    """A stage module whose forward and backward replay CUDA graphs captured at the first forward.

    With a ``weight_grad_store`` (zero-bubble schedules, whose Linear layers defer to it) the backward is
    captured as two graphs, as the eager executor splits it: I (input gradients and every parameter's
    gradient but the deferred Linear weight GEMMs') and W (those GEMMs, from the layer's input and output
    gradient that I left in the slot).
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], slots: int, stage: int,
                 loss: Callable | None, weight_grad_store: WeightGradStore | None = None):
        self.module = module
        self.params = params
        self.stage = stage
        self.num_slots = slots
        self.loss = loss  # (output, *targets) -> scaled loss, on the last stage
        self.store = weight_grad_store
        self.output_layout: boundary.Layout | None = None  # the output structure without its tensors, from the capture
        self._trainable: tuple[bool, ...] = ()  # each parameter's requires_grad at the capture
        self._slots: list[_Slot] = []

    def forward(self, micro_batch: int, args: tuple, targets: tuple, kwargs: dict | None = None) -> tuple:
        """Replays the slot's forward on copies of the inputs (any pytrees); returns the output's tensors (the
        1-tuple of the loss on the last stage): the slot's static outputs, detached, requiring grad where the
        captured outputs do. ``output_layout`` makes them the output structure again."""
        inputs, target_leaves = boundary.flatten((args, kwargs or {})), boundary.flatten(targets)
        if not self._slots:
            self._capture(inputs, target_leaves)
        if tuple(p.requires_grad for p in self.params) != self._trainable:
            raise ValueError(f"cuda_graphs: stage {self.stage}: parameters were frozen or unfrozen after the graphs "
                             "were captured at the first step, which replay the gradients captured; build a new "
                             "Pipeline")
        slot = self._slots[micro_batch % self.num_slots]
        self._copy_in(slot.inputs, inputs, "input", micro_batch)
        self._copy_in(slot.targets, target_leaves, "target", micro_batch)
        slot.forward.replay()
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in slot.outputs)

    def backward(self, micro_batch: int, grads: tuple | None) -> tuple[list, list]:
        """Replays the slot's backward for the outputs' ``grads`` (None: the loss's, captured as 1); returns
        the static (input grads, parameter grads), one entry per input tensor and per stage parameter (None
        where there is no gradient)."""
        slot = self._slots[micro_batch % self.num_slots]
        differentiable = iter(slot.grad_outputs)
        for output, grad in zip(slot.outputs, grads or ()):
            if output.requires_grad:
                static = next(differentiable)
                static.copy_(grad) if grad is not None else static.zero_()
        slot.backward.replay()
        return slot.input_grads, slot.param_grads

    def backward_weights(self, micro_batch: int) -> list:
        """Replays the slot's W (after its I): the deferred weights' gradients, one entry per stage parameter."""
        slot = self._slots[micro_batch % self.num_slots]
        slot.weights.replay()
        return slot.weight_grads

    # -- capture -------------------------------------------------------------------------------

    def _run(self, inputs: boundary.Flat, targets: boundary.Flat, deferrals: list | None) -> list[torch.Tensor]:
        """The stage (and loss) on ``inputs``; with ``deferrals``, the Linear layers record theirs there."""
        if self.store:
            self.store.recording = deferrals
        try:
            args, kwargs = boundary.unflatten(inputs.tensors, inputs.layout)
            output = self.module(*args, **kwargs)
        finally:
            if self.store:
                self.store.recording = None
        if self.loss is not None:
            output = self.loss(output, *boundary.unflatten(targets.tensors, targets.layout))
        flat = boundary.flatten(output)
        if self.loss is None and any(isinstance(tensor, DTensor) for tensor in flat.tensors):
            raise TypeError(f"cuda_graphs: stage {self.stage}'s output holds a DTensor, which a graph's static outputs "
                            "cannot hand over as its local shard; keep use_local_output=True in the last layer's plan")
        self.output_layout = flat.layout
        return flat.tensors

    def _capture(self, inputs: boundary.Flat, targets: boundary.Flat) -> None:
        device = inputs.tensors[0].device
        autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )
        self._trainable = tuple(p.requires_grad for p in self.params)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), autocast:
            static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
            for _ in range(_WARMUP_ITERATIONS):
                deferrals = [] if self.store else None
                outputs = self._run(static_inputs, static_targets, deferrals)
                grad_outputs = [torch.ones_like(t) for t in outputs if t.requires_grad]
                _, deferred = self._input_pass(outputs, grad_outputs, static_inputs.tensors, deferrals)
                if self.store:
                    self._weight_pass(deferred)
        torch.cuda.current_stream(device).wait_stream(side)
        for _ in range(self.num_slots):
            static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
            pool = torch.cuda.graph_pool_handle()
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            weights = torch.cuda.CUDAGraph() if self.store else None
            deferrals = [] if self.store else None
            with autocast:
                with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
                    outputs = self._run(static_inputs, static_targets, deferrals)
                grad_outputs = [torch.ones_like(t) for t in outputs if t.requires_grad]
                with torch.cuda.graph(backward, pool=pool, capture_error_mode="thread_local"):
                    grads, deferred = self._input_pass(outputs, grad_outputs, static_inputs.tensors, deferrals)
                weight_grads = None
                if weights is not None:
                    with torch.cuda.graph(weights, pool=pool, capture_error_mode="thread_local"):
                        weight_grads = self._weight_pass(deferred)
            self._slots.append(_Slot(static_inputs, static_targets, outputs, grad_outputs, forward, backward,
                                     *self._align(grads, static_inputs.tensors), weights, weight_grads))

    def _input_pass(self, outputs: list, grad_outputs: list, inputs: list,
                    deferrals: list[Deferral] | None) -> tuple[tuple, list[DeferredGrad]]:
        """The backward (or, with ``deferrals``, its I part): gradients of the inputs that require grad and of the
        trainable parameters, and what the deferring Linear layers leave to W."""
        wanted = [t for t in inputs if t.requires_grad] + [p for p in self.params if p.requires_grad]
        differentiable = [t for t in outputs if t.requires_grad]
        if not differentiable or not wanted:
            return (None,) * len(wanted), []
        deferred: list[DeferredGrad] = []
        if self.store:
            self.store.collecting = deferred
        try:
            grads = torch.autograd.grad(differentiable, wanted, grad_outputs, allow_unused=True)
        finally:
            if self.store:
                self.store.collecting = None
        check_reported(deferrals or (), differentiable, f"cuda_graphs: stage {self.stage}, capture of the I pass")
        return grads, deferred

    def _weight_pass(self, deferred: list[DeferredGrad]) -> list:
        """The deferred weights' gradients, one entry per stage parameter; a layer run twice adds both."""
        by_weight: dict[int, torch.Tensor] = {}
        for weight, x, grad in deferred:
            part = weight_grad(grad, x).to(weight.dtype)
            by_weight[id(weight)] = by_weight[id(weight)] + part if id(weight) in by_weight else part
        return [by_weight.get(id(p)) for p in self.params]

    def _align(self, grads: tuple, inputs: list) -> tuple[list, list]:
        """The I pass's results as one entry per input tensor and one per stage parameter (None: no gradient)."""
        produced = iter(grads)
        input_grads = [next(produced) if t.requires_grad else None for t in inputs]
        return input_grads, [next(produced) if p.requires_grad else None for p in self.params]

    def _copy_in(self, static: boundary.Flat, values: boundary.Flat, what: str, micro_batch: int) -> None:
        mismatch = boundary.layout_mismatch(values.layout, static.layout)
        if mismatch:
            raise ValueError(f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: the {what}s differ from "
                             f"those the graphs were captured with: {mismatch}")
        for index, (target, value) in enumerate(zip(static.tensors, values.tensors)):
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(
                    f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {what} tensor {index} is "
                    f"{(tuple(value.shape), value.dtype)}, but the graphs were captured for "
                    f"{(tuple(target.shape), target.dtype)}; CUDA graphs need static shapes"
                )
            target.detach().copy_(value)  # the static input is an autograd leaf


def _static_copy(values: boundary.Flat, differentiable: bool) -> boundary.Flat:
    """Static copies of the tensors; those of a later stage require grad where the received ones do."""
    return values._replace(tensors=[
        tensor.detach().clone().requires_grad_(differentiable and tensor.requires_grad) for tensor in values.tensors
    ])
