"""A stage's backward split in two, as zero-bubble schedules need: input gradients now (I), weight gradients later (W).

I runs the autograd engine only towards the stage's inputs. On the way it records the gradient
arriving at each "intermediate" node: a node on the input path from which a parameter hangs. W
then starts, for each group of parameters hanging off the same intermediates, from those recorded
gradients and walks only the short subgraph down to them, instead of re-running the backward.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__: list[str] = []

RunBackward = Callable[[Sequence[torch.Tensor], Sequence, Sequence[torch.Tensor], bool], tuple]


@dataclass
class DeferredWeightGrads:
    """What I leaves for W."""

    params: list[torch.Tensor]
    # Parameter indices grouped by the intermediates they hang off.
    groups: dict[tuple[Node, ...], list[int]] = field(default_factory=dict)
    captured: dict[Node, tuple] = field(default_factory=dict)
    # Set when some parameter hangs off no input path (the first stage, whose inputs are data):
    # W then runs the ordinary backward from the outputs, which I kept alive for it.
    outputs: Sequence[torch.Tensor] | None = None
    grads: Sequence | None = None


def backward_input(outputs: Sequence, grads: Sequence, inputs: list[torch.Tensor], params: list[torch.Tensor],
                   run_backward: RunBackward) -> tuple[tuple, DeferredWeightGrads]:
    roots = [out.grad_fn for out in outputs if isinstance(out, torch.Tensor) and out.grad_fn is not None]
    parents = _parents(roots)
    on_input_path = _ancestors([get_gradient_edge(t).node for t in inputs], parents)
    groups, reaches_root_directly = _intermediates(params, parents, on_input_path)
    intermediates = {node for group in groups for node in group}
    deferred = DeferredWeightGrads(params, groups)
    if reaches_root_directly or not intermediates:
        deferred.outputs, deferred.grads = outputs, grads
        return run_backward(outputs, grads, inputs, True), deferred
    handles = [
        node.register_prehook(lambda grad_outputs, node=node: deferred.captured.__setitem__(node, grad_outputs))
        for node in intermediates
    ]
    try:
        input_grads = run_backward(outputs, grads, inputs, True)
    finally:
        for handle in handles:
            handle.remove()
    return input_grads, deferred


def backward_weight(deferred: DeferredWeightGrads, run_backward: RunBackward) -> tuple:
    if deferred.outputs is not None:
        return run_backward(deferred.outputs, deferred.grads, deferred.params, False)
    results: list = [None] * len(deferred.params)
    for intermediates, indices in deferred.groups.items():
        edges, edge_grads = [], []
        for node in intermediates:
            for output, grad in enumerate(deferred.captured.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, output))
                    edge_grads.append(grad)
        if not edges:
            continue
        # When one intermediate lies below another, the walk from the upper one would add to what
        # the lower one recorded: pin each to its recorded gradient.
        handles = [
            node.register_prehook(lambda _, recorded=deferred.captured[node]: recorded)
            for node in intermediates
            if node in deferred.captured
        ] if len(intermediates) > 1 else []
        try:
            grads = torch.autograd.grad(
                edges, [get_gradient_edge(deferred.params[i]) for i in indices], edge_grads,
                retain_graph=True, allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        for index, grad in zip(indices, grads):
            results[index] = grad
    return tuple(results)


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _ancestors(nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """Every node from which one of ``nodes`` is reached: the path the input-gradient pass runs."""
    found: set[Node] = set()
    stack = [node for node in nodes if node in parents]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(parents[node])
    return found


def _intermediates(params, parents, on_input_path) -> tuple[dict[tuple[Node, ...], list[int]], bool]:
    """Groups parameters by their nearest input-path ancestors, and says whether some parameter
    reaches an output without passing through the input path (then I cannot record what W needs)."""
    groups: dict[tuple[Node, ...], list[int]] = {}
    reaches_root_directly = False
    for index, param in enumerate(params):
        start = get_gradient_edge(param).node
        if start not in parents:
            continue  # this micro-batch did not use the parameter
        found: dict[Node, None] = {}
        stack, visited = [start], set()
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            if not parents[node]:
                reaches_root_directly = True
            for parent in parents[node]:
                if parent in on_input_path:
                    found[parent] = None
                else:
                    stack.append(parent)
        groups.setdefault(tuple(found), []).append(index)
    return groups, reaches_root_directly
