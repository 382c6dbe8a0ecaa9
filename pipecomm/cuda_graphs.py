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

    def __init__(self, inputs: tuple, targets: tuple, outputs: tuple, grad_outputs: list,
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
        self._slots: list[_Slot] = []

    def forward(self, micro_batch: int, args: tuple, targets: tuple) -> tuple:
        """Replays the slot's forward on copies of ``args``; returns its outputs (or the 1-tuple of the loss), detached."""
        if not self._slots:
            self._capture(args, targets)
        slot = self._slots[micro_batch % self.num_slots]
        self._copy_in(slot.inputs, args, "input", micro_batch)
        self._copy_in(slot.targets, targets, "target", micro_batch)
        slot.forward.replay()
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in slot.outputs)

    def backward(self, micro_batch: int, grads: tuple | None) -> tuple[list, list]:
        """Replays the slot's backward for the outputs' ``grads`` (None: the loss's, captured as 1); returns
        the static (input grads, parameter grads), one entry per input and per stage parameter (None where
        there is no gradient)."""
        slot = self._slots[micro_batch % self.num_slots]
        differentiable = iter(slot.grad_outputs)
        for output, grad in zip(slot.outputs, grads or ()):
            if _differentiable(output):
                static = next(differentiable)
                static.copy_(grad) if grad is not None else static.zero_()
        slot.backward.replay()
        return slot.input_grads, slot.param_grads

    # -- capture -------------------------------------------------------------------------------

    def _run(self, inputs: tuple, targets: tuple) -> tuple:
        output = self.module(*inputs)
        if self.loss is not None:
            return (self.loss(output, *targets),)
        return output if isinstance(output, tuple) else (output,)

    def _capture(self, args: tuple, targets: tuple) -> None:
        device = next(t.device for t in args if isinstance(t, torch.Tensor))
        autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )
        wanted_params = [p for p in self.params if p.requires_grad]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), autocast:
            inputs, static_targets = _static_copy(args, self.stage > 0), _static_copy(targets, False)
            for _ in range(_WARMUP_ITERATIONS):
                outputs = self._run(inputs, static_targets)
                self._grad(outputs, [torch.ones_like(t) for t in outputs if _differentiable(t)], inputs, wanted_params)
        torch.cuda.current_stream(device).wait_stream(side)
        for _ in range(self.num_slots):
            inputs, static_targets = _static_copy(args, self.stage > 0), _static_copy(targets, False)
            pool = torch.cuda.graph_pool_handle()
            forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with autocast:
                with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
                    outputs = self._run(inputs, static_targets)
                grad_outputs = [torch.ones_like(t) for t in outputs if _differentiable(t)]
                with torch.cuda.graph(backward, pool=pool, capture_error_mode="thread_local"):
                    grads = self._grad(outputs, grad_outputs, inputs, wanted_params)
            self._slots.append(_Slot(inputs, static_targets, outputs, grad_outputs, forward, backward,
                                     *self._align(grads, inputs)))

    def _grad(self, outputs, grad_outputs, inputs, params) -> tuple:
        differentiable = [t for t in outputs if _differentiable(t)]
        wanted = [t for t in inputs if _differentiable(t)] + params
        if not differentiable or not wanted:
            return (None,) * len(wanted)
        return torch.autograd.grad(differentiable, wanted, grad_outputs, allow_unused=True)

    def _align(self, grads: tuple, inputs: tuple) -> tuple[list, list]:
        """``_grad``'s results as one entry per input and one per stage parameter (None: no gradient)."""
        produced = iter(grads)
        input_grads = [next(produced) if _differentiable(t) else None for t in inputs]
        return input_grads, [next(produced) if p.requires_grad else None for p in self.params]

    def _copy_in(self, static: tuple, values: tuple, what: str, micro_batch: int) -> None:
        if len(static) != len(values):
            raise ValueError(f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {len(values)} {what}s, "
                             f"but the graphs were captured with {len(static)}")
        for index, (target, value) in enumerate(zip(static, values)):
            if not isinstance(target, torch.Tensor):
                if value is not target and value != target:
                    raise ValueError(f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {what} {index} "
                                     f"is {value!r}, captured as {target!r}")
                continue
            if not isinstance(value, torch.Tensor) or value.shape != target.shape or value.dtype != target.dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {what} {index} is {got}, but the "
                    f"graphs were captured for {(tuple(target.shape), target.dtype)}; CUDA graphs need static shapes"
                )
            target.detach().copy_(value)  # the static input is an autograd leaf


def _differentiable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _static_copy(values: tuple, grad_for_floats: bool) -> tuple:
    return tuple(
        value.detach().clone().requires_grad_(grad_for_floats and value.is_floating_point())
        if isinstance(value, torch.Tensor) else value
        for value in values
    )
