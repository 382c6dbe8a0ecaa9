"""What both splitters share: each module's stage from ``pipeline_stage`` annotations, and parameters several stages hold."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from torch import nn

__all__: list[str] = []


def annotated_stages(model: nn.Module, num_stages: int) -> dict[str, int | None]:
    """Every module's stage, by qualified name: its own ``pipeline_stage``, else its nearest annotated ancestor's,
    else None. A value that is not an int in ``[0, num_stages)`` is a ValueError naming the module."""
    stage_of: dict[str, int | None] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        inherited = stage_of[name.rpartition(".")[0]] if name else None
        if hasattr(module, "pipeline_stage"):
            assigned = module.pipeline_stage
            # bool is an int, but True for stage 1 is a mistake, not a placement.
            if isinstance(assigned, bool) or not isinstance(assigned, int) or not 0 <= assigned < num_stages:
                raise ValueError(f"split: {name or 'the model'!r} has pipeline_stage={assigned!r}; it must be an "
                                 f"int in [0, {num_stages})")
            inherited = assigned
        stage_of[name] = inherited
    return stage_of


def shared_parameters(
    named_parameters_of_stage: Iterable[Iterable[tuple[str, nn.Parameter]]],
) -> list[tuple[dict[str, tuple[int, ...]], dict[str, str]]]:
    """For each stage's named parameters, given in stage order, those whose Parameter object another stage holds
    too: mapped to the sorted indices of every stage holding it (a stage module's ``shared_parameters``, whose
    gradients the runtime sums across those stages), and to its name on the lowest of them (its
    ``shared_parameter_keys``: the same on every holder, which pairs the holders' reductions of each parameter
    where its names differ, a tied embedding and head)."""
    named_of_stage = [list(named) for named in named_parameters_of_stage]
    holders: dict[int, set[int]] = collections.defaultdict(set)
    first_name: dict[int, str] = {}
    # (device, storage address) -> the elements each holder covers there: (start, end, stage, name, id).
    storages: dict[tuple, list[tuple[int, int, int, str, int]]] = collections.defaultdict(list)
    for stage, named in enumerate(named_of_stage):
        for name, param in named:
            holders[id(param)].add(stage)
            first_name.setdefault(id(param), name)
            if param.device.type == "meta" or not param.numel():
                continue
            start = param.storage_offset()
            end = start + 1 + sum((size - 1) * stride for size, stride in zip(param.shape, param.stride()))
            covered = storages[(param.device, param.untyped_storage().data_ptr(), param.element_size())]
            for other_start, other_end, other_stage, other_name, other_id in covered:
                if other_stage != stage and other_id != id(param) and start < other_end and other_start < end:
                    # Each stage's rank would keep a copy and update it alone: the views would drift apart silently.
                    raise ValueError(f"split: the parameter {name!r} of stage {stage} shares memory with "
                                     f"{other_name!r} on stage {other_stage}, another Parameter object (a view of "
                                     "it): stages on other ranks cannot share memory; tie them as one Parameter or "
                                     "give each its own")
            covered.append((start, end, stage, name, id(param)))
    return [({name: tuple(sorted(holders[id(param)])) for name, param in named if len(holders[id(param)]) > 1},
             {name: first_name[id(param)] for name, param in named if len(holders[id(param)]) > 1})
            for named in named_of_stage]
