"""Splitting one model into pipeline stages by ``pipeline_stage`` annotations or a balance rule, reusing its modules."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipecomm.splitting.balance import stage_sizes
from pipecomm.splitting.capture import capture_split
from pipecomm.splitting.stages import annotated_stages, shared_parameters

__all__ = ["StageModule", "merge_checkpoints", "split"]


class StageModule(nn.Module):
    """The consecutive layers of the original model that one pipeline stage runs, called in order.

    ``forward(*inputs)`` calls the first layer with ``inputs`` and each next layer with the previous
    one's output (a tuple unpacked into positional arguments), and returns the last layer's output.

    The layers are the original module objects, registered under their names in the original model
    (an element ``blocks.3`` of a ``ModuleList`` under an ``nn.ModuleDict`` named ``blocks``), so
    ``state_dict()`` keys already are the original model's keys.

    Attributes:
        stage_index: this stage's index.
        num_stages: how many stages the model was split into.
        layer_names: the layers' qualified names in the original model, in execution order.
        shared_parameters: this module's parameter names whose Parameter object also belongs to
            layers on other stages (a tied embedding and head), mapped to the sorted indices of every
            stage holding it. Their gradients must be summed across those stages before an
            optimizer step; ``split`` only reports them.
        shared_parameter_keys: the same names mapped to each parameter's name on the lowest stage
            holding it, the same on every holder.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        stage_index: int,
        num_stages: int,
        shared_parameters: dict[str, tuple[int, ...]],
        shared_parameter_keys: dict[str, str] | None = None,
    ):
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_names = tuple(name for name, _ in layers)
        self.shared_parameters = shared_parameters
        self.shared_parameter_keys = shared_parameter_keys or {name: name for name in shared_parameters}
        for name, layer in layers:
            container_name, _, leaf_name = name.rpartition(".")
            top_name = container_name or leaf_name
            if top_name not in self._modules and hasattr(self, top_name):
                raise ValueError(
                    f"split: layer {name!r} is named like the StageModule attribute {top_name!r}; rename it"
                )
            parent = self
            if container_name:
                if container_name not in self._modules:
                    self.add_module(container_name, nn.ModuleDict())
                parent = self._modules[container_name]
            parent.add_module(leaf_name, layer)

    def forward(self, *inputs):
        output = inputs
        for name in self.layer_names:
            output = self.get_submodule(name)(*(output if isinstance(output, tuple) else (output,)))
        return output

    def original_names(self) -> dict[str, str]:
        """Maps this module's ``state_dict()`` keys to the original model's keys.

        The identity, since layers keep their original names; checkpoint code that goes through this
        mapping keeps working should that ever change.
        """
        return {key: key for key in self.state_dict()}

    def extra_repr(self) -> str:
        return f"stage_index={self.stage_index}, num_stages={self.num_stages}"


def split(
    model: nn.Module,
    num_stages: int,
    stage: int | Sequence[int],
    balance: str | Sequence[int] | None = None,
    sample_inputs: tuple | None = None,
    device: torch.device | str | None = None,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
) -> nn.Module | list[nn.Module]:
    """The part of ``model`` that pipeline stage ``stage`` runs (a list of them when ``stage`` is a list).

    **A model with its own forward** (anything but an ``nn.Sequential`` chain, e.g. a Hugging Face
    model) is cut by capturing that forward with torch.export on one micro-batch,
    ``model(*example_inputs, **example_kwargs)``, and cutting the captured graph where the
    ``pipeline_stage`` annotations say (``pipecomm.splitting.capture``). Annotations may sit on modules at any
    depth (``model.transformer.h[3].pipeline_stage = 1``); a module takes its own annotation or its
    nearest annotated ancestor's; functional code outside annotated modules goes where the data flow
    puts it, and every value crossing a cut is sent, skips over several stages included. A module
    that lands whole on one stage runs as the user's own module. Stage 0 takes the model's own
    arguments, the last stage returns the model's own output. Without ``example_inputs`` /
    ``example_kwargs`` such a model is a ValueError, never a silent chain of its children; a
    forward torch.export cannot capture (control flow on tensor contents) is a ValueError naming the
    construct. ``balance`` needs an ``nn.Sequential``.

    **An nn.Sequential, or a module without a forward of its own** (its children, run in order, each
    output feeding the next child, a tuple unpacked into positional arguments) is split as that
    chain. The units placed on stages, called *layers*, are its children, except that a ``ModuleList`` child (which has no forward) contributes its elements,
    named ``blocks.0``, ``blocks.1``, ... An annotation below the layers needs ``example_inputs``,
    and the model is then captured as above.

    Placement, when any layer carries a ``pipeline_stage`` attribute (MindSpore / OneFlow style), its
    own or, as above, its nearest annotated ancestor's (a ``ModuleList`` annotated as a whole): every
    layer with parameters must carry one, in ``[0, num_stages)``, not decreasing in execution order; a
    layer without parameters and without the attribute joins the stage of the layer before it (stage 0
    for leading ones); every stage must get a layer; and ``balance`` must be None. Each violation is a
    ValueError naming the module.

    Otherwise ``balance`` splits the layers into ``num_stages`` consecutive non-empty groups:
    ``"parameters"`` (the default) minimises the largest stage's parameter count (exactly, then the
    largest layer count, so parameter-free layers spread evenly); ``"uniform"`` gives every stage the
    same number of layers (the later stages one more when it does not divide, as the first stages
    hold the most activations in flight under 1F1B); a list gives each stage's number of layers;
    ``"profile"`` times every layer's forward and backward on ``sample_inputs`` (the first layer's
    positional inputs, on the model's device) and minimises the slowest stage's time, leaving
    parameters, their ``.grad``, buffers and the RNG state as they were. Each call measures anew, so
    ask for all of a process's stages in one call; under torch.distributed the timings are averaged
    over the default group, so every rank of it must call ``split`` with ``"profile"`` and all get
    the same placement. The automatic modes warn when the layers do not divide evenly into the
    stages.

    The returned modules reuse the original layer objects, nothing is copied. With ``device``, only
    the requested stages' layers are moved there (a Parameter shared with another stage moves too).
    """
    stages = list(stage) if isinstance(stage, Sequence) else [stage]
    if _needs_capture(model):
        if balance is not None:
            raise ValueError(f"split: balance={balance!r} splits an nn.Sequential chain; {type(model).__name__} "
                             "defines its own forward, so annotate its submodules with pipeline_stage instead")
        if example_inputs is None and example_kwargs is None:
            raise ValueError(
                f"split: {type(model).__name__} defines its own forward (or carries annotations below its "
                "children), which split captures to cut exactly; pass example_inputs= (and example_kwargs=): "
                "one micro-batch of the model's arguments. Splitting it as a plain chain of its children could "
                "drop the functional code between them"
            )
        _check_stage_arguments(num_stages, stages, num_stages)
        captured = capture_split(model, num_stages, stages, tuple(example_inputs or ()), dict(example_kwargs or {}),
                                 None if device is None else torch.device(device))
        return captured if isinstance(stage, Sequence) else captured[0]
    layers = _layers(model)
    _check_stage_arguments(num_stages, stages, len(layers))
    stage_of_layer = _annotated_placement(layers, annotated_stages(model, num_stages), num_stages, balance)
    if stage_of_layer is None:
        sizes = stage_sizes(layers, num_stages, balance, sample_inputs)
        stage_of_layer = [index for index, size in enumerate(sizes) for _ in range(size)]
    layers_of_stage = [[] for _ in range(num_stages)]
    for layer, owner in zip(layers, stage_of_layer):
        layers_of_stage[owner].append(layer)
    shared = shared_parameters(
        [param for name, layer in stage_layers for param in layer.named_parameters(name, remove_duplicate=False)]
        for stage_layers in layers_of_stage
    )
    modules = []
    for index in stages:
        if device is not None:
            for _, layer in layers_of_stage[index]:
                layer.to(device)
        modules.append(StageModule(layers_of_stage[index], index, num_stages, *shared[index]))
    return modules if isinstance(stage, Sequence) else modules[0]


def merge_checkpoints(state_dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state dict for the unsplit model from the stages' state dicts, all keyed by original names.

    A key present in several of them must hold equal values (same shape, dtype and elements), else a
    ValueError names it: a later stage never silently overwrites an earlier one.
    """
    merged: dict[str, Any] = collections.OrderedDict()
    # load_state_dict reads per-module format versions from here to upgrade old checkpoints.
    metadata: dict[str, Any] = collections.OrderedDict()
    first_holder: dict[str, int] = {}
    for index, state_dict in enumerate(state_dicts):
        metadata.update(getattr(state_dict, "_metadata", {}))
        for key, value in state_dict.items():
            if key not in merged:
                merged[key] = value
                first_holder[key] = index
            elif not _equal_values(merged[key], value):
                raise ValueError(
                    f"merge_checkpoints: {key!r} differs between state dict {first_holder[key]} and state dict {index}"
                )
    merged._metadata = metadata
    return merged


# -- layers and placement --------------------------------------------------------------------------


def _needs_capture(model: nn.Module) -> bool:
    """Whether the model's forward must be captured: it has one of its own, or annotations sit below its layers.

    An ``nn.Sequential`` and a module with no forward of its own can only mean their children in order.
    """
    if type(model).forward not in (nn.Module.forward, nn.Sequential.forward):
        return True
    layer_names = set()
    for name, child in model._modules.items():
        if isinstance(child, nn.ModuleList):
            layer_names.update(f"{name}.{index}" for index in range(len(child)))
        layer_names.add(name)
    return any(name and name not in layer_names and hasattr(module, "pipeline_stage")
               for name, module in model.named_modules(remove_duplicate=False))


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units that get placed on stages, with their qualified names, in execution order."""
    own_state = [
        name for name, value in itertools.chain(model._parameters.items(), model._buffers.items()) if value is not None
    ]
    if own_state:
        raise ValueError(
            f"split: the model holds {', '.join(own_state)} itself, outside every child; split runs only the "
            f"children, so move them into a child module"
        )
    layers = []
    # _modules rather than named_children(): the latter skips a module registered twice, which
    # nn.Sequential still runs twice.
    for name, child in model._modules.items():
        if child is None:
            continue
        if isinstance(child, nn.ModuleList):
            layers.extend((f"{name}.{index}", element) for index, element in enumerate(child))
        else:
            layers.append((name, child))
    for name, layer in layers:
        if type(layer).forward is nn.Module.forward:
            raise ValueError(
                f"split: {name!r} ({type(layer).__name__}) has no forward, but split calls every layer in order"
            )
    return layers


def _check_stage_arguments(num_stages: int, stages: list[int], num_layers: int) -> None:
    if num_stages < 1:
        raise ValueError(f"split: num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"split: num_stages={num_stages} but the model has only {num_layers} layers; every stage needs at least one"
        )
    for index in stages:
        if not 0 <= index < num_stages:
            raise ValueError(f"split: stage {index} is out of range for num_stages={num_stages}")
    if len(set(stages)) != len(stages):
        raise ValueError(f"split: stages {stages} name a stage more than once")


def _annotated_placement(layers, stage_of_module, num_stages, balance) -> list[int] | None:
    """Each layer's stage from the annotations, or None when no layer carries or inherits one."""
    annotated = [name for name, _ in layers if stage_of_module[name] is not None]
    if not annotated:
        return None
    if balance is not None:
        raise ValueError(
            f"split: balance={balance!r} cannot be combined with pipeline_stage annotations "
            f"(found on {annotated[0]!r}); pass balance=None"
        )
    stage_of_layer = []
    previous_name = None
    for name, layer in layers:
        assigned = stage_of_module[name]
        if assigned is not None:
            if stage_of_layer and assigned < stage_of_layer[-1]:
                raise ValueError(
                    f"split: {name!r} has pipeline_stage={assigned} but comes after {previous_name!r} on stage "
                    f"{stage_of_layer[-1]}; stages must not decrease in execution order"
                )
        elif any(True for _ in layer.parameters()):
            raise ValueError(
                f"split: {name!r} has parameters but no pipeline_stage; annotate every layer that has parameters"
            )
        else:
            assigned = stage_of_layer[-1] if stage_of_layer else 0
        if stage_of_layer and assigned > stage_of_layer[-1] + 1:
            raise ValueError(
                f"split: stage {stage_of_layer[-1] + 1} gets no layer: {previous_name!r} is on stage "
                f"{stage_of_layer[-1]} and the next layer, {name!r}, on stage {assigned}"
            )
        if not stage_of_layer and assigned > 0:
            raise ValueError(f"split: stage 0 gets no layer: the first layer, {name!r}, is on stage {assigned}")
        stage_of_layer.append(assigned)
        previous_name = name
    if stage_of_layer[-1] < num_stages - 1:
        raise ValueError(
            f"split: stage {stage_of_layer[-1] + 1} gets no layer: the last layer, {previous_name!r}, is on stage "
            f"{stage_of_layer[-1]} of {num_stages}"
        )
    return stage_of_layer


def _equal_values(first, second) -> bool:
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return (
            first.shape == second.shape
            and first.dtype == second.dtype
            and torch.equal(first, second.to(first.device))
        )
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return False
    return bool(first == second)
