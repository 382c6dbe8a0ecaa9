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

from pipecomm import boundary
from pipecomm.schedule import Schedule

__all__: list[str] = []

_WARMUP_ITERATIONS = 2  # eager runs on a side stream before capture, so lazy initialisation stays out of the graph


def in_flight_slots(schedule: Schedule, rank: int, stage: int) -> int:
    """How many micro-batches ``stage`` holds between forward and backward at most; checks backwards run in forward order."""
    pending: list[int] = []
    most = 0
    for action in schedule.actions[rank]:
        if action.stage != stage:
            continue
        if action.kind == "F":
            pending.append(action.micro_batch)
            most = max(most, len(pending))
        elif action.kind == "B":
            if pending[0] != action.micro_batch:
                raise ValueError(f"cuda_graphs: schedule {schedule.name!r} runs stage {stage}'s backwards out of "
                                 "forward order, which round-robin graph slots cannot follow")
            pending.pop(0)
        elif action.kind in ("I", "W"):
            raise ValueError(f"cuda_graphs: schedule {schedule.name!r} splits the backward into I and W, which is "
                             "not captured; use gpipe, 1f1b or interleaved-1f1b")
    return most


class _Slot:
    """One captured forward/backward pair and the static tensors they read and write."""

    def __init__(self, inputs: boundary.Flat, targets: boundary.Flat, outputs: list, grad_outputs: list,
                 forward: torch.cuda.CUDAGraph, backward: torch.cuda.CUDAGraph, input_grads: list, param_grads: list):
        self.inputs, self.targets, self.outputs = inputs, targets, outputs
        self.grad_outputs, self.forward, self.backward = grad_outputs, forward, backward
        self.input_grads, self.param_grads = input_grads, param_grads


class GraphedStage:
    """A stage module whose forward and backward replay CUDA graphs captured at the first forward."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], slots: int, stage: int,
                 loss: Callable | None):
        self.module = module
        self.params = params
        self.stage = stage
        self.num_slots = slots
        self.loss = loss  # (output, *targets) -> scaled loss, on the last stage
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

    # -- capture -------------------------------------------------------------------------------

    def _run(self, inputs: boundary.Flat, targets: boundary.Flat) -> list[torch.Tensor]:
        args, kwargs = boundary.unflatten(inputs.tensors, inputs.layout)
        output = self.module(*args, **kwargs)
        if self.loss is not None:
            output = self.loss(output, *boundary.unflatten(targets.tensors, targets.layout))
        flat = boundary.flatten(output)
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
        wanted_params = [p for p in self.params if p.requires_grad]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), autocast:
            static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
            for _ in range(_WARMUP_ITERATIONS):
                outputs = self._run(static_inputs, static_targets)
                self._grad(outputs, [torch.ones_like(t) for t in outputs if t.requires_grad], static_inputs.tensors,
                           wanted_params)
        torch.cuda.current_stream(device).wait_stream(side)
        for _ in range(self.num_slots):
            static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
            pool = torch.cuda.graph_pool_handle()
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with autocast:
                with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
                    outputs = self._run(static_inputs, static_targets)
                grad_outputs = [torch.ones_like(t) for t in outputs if t.requires_grad]
                with torch.cuda.graph(backward, pool=pool, capture_error_mode="thread_local"):
                    grads = self._grad(outputs, grad_outputs, static_inputs.tensors, wanted_params)
            self._slots.append(_Slot(static_inputs, static_targets, outputs, grad_outputs, forward, backward,
                                     *self._align(grads, static_inputs.tensors)))

    def _grad(self, outputs: list, grad_outputs: list, inputs: list, params: list) -> tuple:
        differentiable = [t for t in outputs if t.requires_grad]
        wanted = [t for t in inputs if t.requires_grad] + params
        if not differentiable or not wanted:
            return (None,) * len(wanted)
        return torch.autograd.grad(differentiable, wanted, grad_outputs, allow_unused=True)

    def _align(self, grads: tuple, inputs: list) -> tuple[list, list]:
        """``_grad``'s results as one entry per input tensor and one per stage parameter (None: no gradient)."""
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
