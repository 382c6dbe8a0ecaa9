"""Balancing a chain of layers over stages: by parameters, uniformly, by given sizes, or by each layer's measured
forward and backward time (averaged over the ranks, so that every rank places the layers alike)."""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm.parallel.backend import uses_nccl

__all__ = ["BALANCE_MODES"]


BALANCE_MODES = ("parameters", "uniform", "profile")


# Timed runs per layer when profiling, after one warm-up run (allocator, kernel selection); the
# fastest is kept, as noise only ever adds time.
_PROFILE_REPEATS = 3


def stage_sizes(layers, num_stages, balance, sample_inputs) -> list[int]:
    """Numbers of consecutive layers per stage, by the ``balance`` rule."""
    num_layers = len(layers)
    if balance is None:
        balance = "parameters"
    if not isinstance(balance, str):
        sizes = list(balance)
        if len(sizes) != num_stages:
            raise ValueError(f"split: balance lists {len(sizes)} stage sizes for num_stages={num_stages}")
        if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"split: balance {sizes} must give every stage a whole number >= 1 of layers")
        if sum(sizes) != num_layers:
            raise ValueError(f"split: balance {sizes} places {sum(sizes)} layers but the model has {num_layers}")
        return sizes
    if balance not in BALANCE_MODES:
        raise ValueError(
            f"split: unknown balance {balance!r}; known: {', '.join(BALANCE_MODES)} or a list of layer counts"
        )
    if balance == "profile" and sample_inputs is None:
        raise ValueError("split: balance='profile' needs sample_inputs, the first layer's positional inputs")
    if num_layers % num_stages:
        warnings.warn(
            f"split: {num_layers} layers do not divide evenly into {num_stages} stages", UserWarning, stacklevel=3
        )
    if balance == "uniform":
        base, extra = divmod(num_layers, num_stages)
        return [base + (index >= num_stages - extra) for index in range(num_stages)]
    if balance == "parameters":
        costs = [sum(param.numel() for param in layer.parameters()) for _, layer in layers]
    else:
        costs = _agreed(_profile(layers, tuple(sample_inputs)))
    return _balanced_sizes(costs, num_stages)


def _balanced_sizes(costs: Sequence[float], num_stages: int) -> list[int]:
    """Consecutive non-empty groups minimising the largest (cost, layer count) pair, compared in that order.

    An exact dynamic program over where the last group starts, O(num_stages * layers^2), which is
    instant for models of hundreds of layers.
    """
    num_layers = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0))
    # best[end]: the smallest bottleneck for the first `end` layers in the groups placed so far.
    best = [(prefix[end], end) for end in range(num_layers + 1)]
    starts_per_group = []
    for groups in range(2, num_stages + 1):
        new_best: list[Any] = [None] * (num_layers + 1)
        start_of_last = [0] * (num_layers + 1)
        # Leave at least one layer to each earlier and each later group.
        for end in range(groups, num_layers - (num_stages - groups) + 1):
            for start in range(groups - 1, end):
                candidate = max(best[start], (prefix[end] - prefix[start], end - start))
                if new_best[end] is None or candidate < new_best[end]:
                    new_best[end], start_of_last[end] = candidate, start
        best = new_best
        starts_per_group.append(start_of_last)
    sizes = []
    end = num_layers
    for start_of_last in reversed(starts_per_group):
        sizes.append(end - start_of_last[end])
        end = start_of_last[end]
    sizes.append(end)
    return sizes[::-1]


def _profile(layers, sample_inputs: tuple) -> list[float]:
    """Seconds of one forward and backward of each layer, fed the previous layer's outputs."""
    cuda_devices = {
        tensor.device.index or 0
        for tensor in itertools.chain(sample_inputs, *(layer.parameters() for _, layer in layers))
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda
    }
    costs = []
    inputs = sample_inputs
    with torch.random.fork_rng(devices=sorted(cuda_devices)), _buffers_restored(layers):
        for _, layer in layers:
            timings = []
            for _ in range(_PROFILE_REPEATS + 1):
                leaves = tuple(_as_leaf(value) for value in inputs)
                start = time.perf_counter()
                output = layer(*leaves)
                outputs = output if isinstance(output, tuple) else (output,)
                _backward(layer, leaves, outputs)
                for device in cuda_devices:
                    torch.cuda.synchronize(device)
                timings.append(time.perf_counter() - start)
            costs.append(min(timings[1:]))
            inputs = tuple(value.detach() if isinstance(value, torch.Tensor) else value for value in outputs)
    return costs


def _agreed(costs: list[float]) -> list[float]:
    """The costs averaged over the default process group, when there is one.

    Timings differ from run to run: ranks that each balanced their own measurements would place
    layers differently and their stages would not fit together.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return costs
    device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl() else torch.device("cpu")
    total = torch.tensor(costs, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _as_leaf(value):
    """A floating-point tensor input becomes a leaf that requires grad, so the backward reaches it as in a pipeline."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value


def _backward(layer: nn.Module, leaves: tuple, outputs: tuple) -> None:
    # autograd.grad rather than backward(): it returns the gradients instead of accumulating them
    # into the parameters' .grad, which the caller's training must not see.
    differentiable = [value for value in outputs if isinstance(value, torch.Tensor) and value.requires_grad]
    if not differentiable:
        return
    wrt = [param for param in layer.parameters() if param.requires_grad]
    wrt += [value for value in leaves if isinstance(value, torch.Tensor) and value.requires_grad]
    torch.autograd.grad(differentiable, wrt, [torch.ones_like(value) for value in differentiable], allow_unused=True)


@contextlib.contextmanager
def _buffers_restored(layers) -> Iterator[None]:
    """Profiling runs forwards in the model's mode, which updates running statistics (BatchNorm); undo that."""
    buffers = [buffer for _, layer in layers for buffer in layer.buffers()]
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
