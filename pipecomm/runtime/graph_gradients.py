"""Gradient tensors at fixed addresses that captured backward graphs add into, bound as the parameters' ``.grad``.

A captured backward that returned every parameter's gradient would need a set of gradients at fixed addresses, for
the caller to add into ``.grad``. Captured adding in place into one persistent tensor per parameter (autograd's own
in-place accumulation, or the zero-bubble W's ``addmm_``), each gradient is freed as soon as it is added, so the
graphs' pool holds what eager would: activations and the backward's transients.

The tensor stays where the graphs write it, so each step it is handed to the parameter again as ``.grad`` holding
what an eager ``.grad`` would hold: zeros after ``zero_grad()`` (which sets ``.grad`` to None), the gradients left
there otherwise, or a tensor the caller put there. It is handed out as a new alias each step: a gradient the caller
kept from an earlier step gets storage of its own before the zeroing, and keeps its values, as it would eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__: list[str] = []


class _Accumulator:
    """One parameter's accumulator, the ``.grad`` last handed out on it, and the graphed stages adding into it."""

    def __init__(self, param: nn.Parameter, tensor: torch.Tensor):
        self.param = param
        self.tensor = tensor
        self.alias: weakref.ref | None = None  # the .grad last handed out
        self.users: set[int] = set()  # the graphed stages that add into it


class GradientAccumulators:
    """A rank's accumulators, one per parameter a graphed stage's backward reaches (stages may share parameters)."""

    def __init__(self) -> None:
        self._held: dict[int, _Accumulator] = {}

    def tensors(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The accumulators of ``params`` that have one, in order."""
        return [self._held[id(p)].tensor for p in params if id(p) in self._held]

    def holds(self, param: nn.Parameter) -> bool:
        return id(param) in self._held

    def bind(self, params: Iterable[nn.Parameter]) -> None:
        """Each held parameter's accumulator as its ``.grad``, holding what its ``.grad`` held (zeros for None)."""
        zeroed, rebound = [], []
        for param in params:
            entry = self._held.get(id(param))
            if entry is None:
                continue
            grad = param.grad
            alias = entry.alias() if entry.alias is not None else None
            if grad is not None and grad is alias:
                continue  # not zeroed since: accumulation goes on, as it would into an eager .grad
            if alias is not None:
                alias.data = alias.clone()  # a .grad the caller kept keeps its values
            if grad is None:
                zeroed.append(entry.tensor)
            else:
                entry.tensor.copy_(grad)
            rebound.append(entry)
        if zeroed:
            torch._foreach_zero_(zeroed)  # one launch, not one per parameter
        for entry in rebound:
            self._hand_out(entry)

    @contextmanager
    def capturing(self, params: list[nn.Parameter]) -> Iterator[None]:
        """Around a capture of a stage, whose runs add into the parameters' ``.grad``: each trainable parameter's
        ``.grad`` is None on entry, so the first run shows which ones the backward reaches (``adopt_reached``); on
        exit every parameter's ``.grad`` holds what it held before, the reached ones' in their accumulators."""
        trainable = [p for p in params if p.requires_grad]
        before = {id(p): _copy_if_held(p.grad, self._held.get(id(p))) for p in trainable}
        for param in trainable:
            param.grad = None
        try:
            yield
        finally:
            for param in trainable:
                param.grad = before[id(param)]
            self.bind(p for p in trainable if self.holds(p))  # another stage's graphs may add into one too

    def adopt_reached(self, stage: int, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """During ``capturing``, after a first run: the parameters that got a gradient get an accumulator (zeros) as
        their ``.grad``, which the runs after add into; returns them. A new accumulator is the first run's gradient
        tensor itself (autograd made it the parameter's own, in its layout), so a capture holds no extra set."""
        reached = [p for p in params if p.requires_grad and p.grad is not None]
        for param in reached:
            entry = self._held.get(id(param))
            if entry is None:
                entry = self._held[id(param)] = _Accumulator(param, param.grad)
            entry.users.add(stage)
        self.zero(reached)
        return reached

    def zero(self, params: list[nn.Parameter]) -> None:
        """The accumulators of ``params`` zeroed and bound (during a capture: before each run compared)."""
        entries = [self._held[id(p)] for p in params]
        torch._foreach_zero_([entry.tensor for entry in entries])
        for entry in entries:
            self._hand_out(entry)

    def release(self, stage: int) -> None:
        """``stage`` adds into none of them any more; those no stage uses are let go (their ``.grad`` stays)."""
        for key, entry in list(self._held.items()):
            entry.users.discard(stage)
            if not entry.users:
                del self._held[key]

    @staticmethod
    def _hand_out(entry: _Accumulator) -> None:
        alias = entry.tensor.detach()  # a new tensor object on the accumulator's storage
        entry.param.grad = alias
        entry.alias = weakref.ref(alias)


def _copy_if_held(grad: torch.Tensor | None, entry: _Accumulator | None) -> torch.Tensor | None:
    """``grad`` as it is, or a copy where it is an accumulator's alias, which the capture's runs overwrite."""
    if grad is None or entry is None or grad.untyped_storage().data_ptr() != entry.tensor.untyped_storage().data_ptr():
        return grad
    return grad.clone()
