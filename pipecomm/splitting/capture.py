"""Splitting a model by its own ``forward``: captured with torch.export on one micro-batch, cut where annotations say.

The model's forward is exported (non-strict, every input dimension dynamic) with the call
signature of every *unit* preserved. A unit is a module that runs whole on one stage: the largest
modules whose annotation (``pipeline_stage``, their own or their nearest annotated ancestor's) is
the same throughout, plus the largest unannotated modules with no annotation inside, which go where
the data flow puts them. Each unit's traced body is replaced by a call to the user's own module, so
its hooks, ``torch.compile``, CUDA graphs and zb-h1's weight-gradient deferral see the module as
usual. What is left, the functional glue (``F.relu``, residual adds, reshapes, masks), stays as
captured ATen ops and runs on the stage its annotated module gives or, outside every annotated
module, on the earliest stage where all its inputs exist. Every value that one stage produces and a
later stage uses crosses each boundary in between.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import itertools
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from pipecomm.runtime import boundary
from pipecomm.splitting.read_values import ReadValuesCheck, mattering, recording_reads, with_every_training_flag
from pipecomm.splitting.stages import annotated_stages, shared_parameters

__all__: list[str] = []


class CapturedStage(torch.fx.GraphModule):
    """One stage of a captured model: a graph over the user's own modules and the glue between them.

    Stage 0 takes the model's own arguments; the last stage returns the model's own output
    structure; in between, a stage takes and returns the flat tuple of values crossing its
    boundaries. Submodules, parameters and buffers sit under their names in the original model, so
    ``state_dict()`` keys are the original keys.

    Attributes (as on ``StageModule``): ``stage_index``, ``num_stages``, ``layer_names`` (the
    units this stage calls, by qualified name), ``shared_parameters`` (names of parameters other
    stages hold too, mapped to the stages holding them), ``shared_parameter_keys`` (the same names
    mapped to each one's name on its lowest stage), ``boundary_names`` (what this stage sends to the
    next, as graph value names).
    """

    stage_index: int
    num_stages: int
    layer_names: tuple[str, ...]
    shared_parameters: dict[str, tuple[int, ...]]
    shared_parameter_keys: dict[str, str]
    boundary_names: tuple[str, ...]

    def original_names(self) -> dict[str, str]:
        return {key: key for key in self.state_dict()}

    def train(self, mode: bool = True) -> CapturedStage:
        """Also sets the training flags of the model's own modules that the captured code outside the stage's
        modules read (``F.dropout(h, p, self.training)`` in a Hugging Face model's forward): ``stage.eval()`` is
        then ``model.eval()`` to the capture's check, rather than a dropout left running."""
        super().train(mode)
        for hook in self._forward_pre_hooks.values():
            if isinstance(hook, ReadValuesCheck):
                hook.set_training(mode)
        return self

    def __call__(self, *args, **kwargs):
        modes = self.__dict__.get("_modes")
        if modes is not None:
            picked = modes.check.picked()
            if picked is not None and self.graph is not modes.graphs[picked]:
                self.graph = modes.graphs[picked]  # its code compiled anew: once per change of mode
        return super().__call__(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> CapturedStage:
        """A copy (an EMA or teacher model, AveragedModel) that is a stage as this one is. torch's GraphModule copy
        would fail on the fake tensors in the nodes' metadata (shared here: the copy's graph is the same), and drops
        the stage's attributes and the capture's checks (its forward pre-hooks, which read the original model)."""
        checks = [hook for hook in self._forward_pre_hooks.values()
                  if isinstance(hook, (_ArgumentCheck, ReadValuesCheck))]
        for node in self.graph.nodes:
            for value in pytree.tree_leaves([node.meta.get("val"), node.meta.get("example_value")]):
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = value
        for shared in [*checks, getattr(self, "shape_env", None)]:
            memo[id(shared)] = shared
        copied = super().__deepcopy__(memo)
        copied.__class__.__name__ = type(self).__name__
        for name in ("stage_index", "num_stages", "layer_names", "shared_parameters", "shared_parameter_keys",
                     "boundary_names"):
            setattr(copied, name, copy.deepcopy(getattr(self, name), memo))
        # The copy's mode is its own (an EMA teacher evaluates while the model trains).
        own = {id(hook): hook.for_copy(copied) if isinstance(hook, ReadValuesCheck) else hook for hook in checks}
        for hook in checks:
            copied.register_forward_pre_hook(own[id(hook)], with_kwargs=True)
        modes = self.__dict__.get("_modes")
        if modes is not None:
            graphs = tuple(copied.graph if graph is self.graph else copy.deepcopy(graph, memo)
                           for graph in modes.graphs)
            for graph in graphs:
                _attach_attributes(copied, graph, self, lambda value: copy.deepcopy(value, memo))
            copied._modes = _Modes(own.get(id(modes.check), modes.check), graphs)
        return copied


class _Modes:
    """A stage's two captures, as the model's training flags that its code reads were at split and flipped, and the
    check that says which one they pick."""

    def __init__(self, check: ReadValuesCheck, graphs: tuple[torch.fx.Graph, torch.fx.Graph]):
        self.check, self.graphs = check, graphs


def capture_split(
    model: nn.Module,
    num_stages: int,
    stages: Sequence[int],
    example_args: tuple,
    example_kwargs: dict,
    device: torch.device | None,
) -> list[CapturedStage]:
    """The requested stages of ``model``, cut from one capture of its forward."""
    stage_of = annotated_stages(model, num_stages)
    units = _units(model, stage_of)
    glue, called_whole = _glue_modules(model, units), [(unit, model.get_submodule(unit)) for unit in units]

    def capture(stack_traces: bool = False) -> torch.export.ExportedProgram:
        return _export(model, example_args, example_kwargs, units, stack_traces=stack_traces)

    # A forward that writes a value it read (a Hugging Face classifier sets config.problem_type at its first call) is
    # captured again from the state it left, which its next calls start from.
    for _ in range(2):
        with recording_reads(glue, called_whole) as reads:
            exported = capture()
        if not any(read.changed() for read in reads):
            break
    reads, other_mode = mattering(with_every_training_flag(reads, [*glue, *called_whole]), capture,
                                  exported.graph_module.code)

    def cut(exported: torch.export.ExportedProgram, described: bool = True) -> list[CapturedStage]:
        graph = _outline_units(exported, set(units))
        try:
            placement = _place(graph, stage_of, num_stages)
        except _DataFlowAgainstStages:
            if not described:
                raise
            # Its message names source lines: captured again, recording them, to raise it so.
            _place(_outline_units(capture(stack_traces=True), set(units)), stage_of, num_stages)
            raise
        return _cut(model, exported, graph, placement, num_stages, device,
                    _argument_names(model, example_args, example_kwargs))

    built = cut(exported)
    shared = shared_parameters(stage.named_parameters(remove_duplicate=False) for stage in built)
    for stage, (stage_shared, keys) in zip(built, shared):
        stage.shared_parameters, stage.shared_parameter_keys = stage_shared, keys
    built[0].register_forward_pre_hook(_ArgumentCheck(model, example_args, example_kwargs, built[0], exported),
                                       with_kwargs=True)
    # The forward's own code read training flags that change it (F.dropout(h, p, self.training)): the stages also hold
    # the capture of the other mode, and run the one the flags pick at each call, where both cut alike.
    others, one_mode = None, ""
    if isinstance(other_mode, Exception):
        one_mode = f"could not be captured ({type(other_mode).__name__}: {str(other_mode).splitlines()[0][:300]})"
    elif other_mode is not None:
        others = _other_mode_graphs(model, built, lambda: cut(other_mode, described=False))
        one_mode = "" if others is not None else ("cuts the model otherwise (other values cross the stages' "
                                                  "boundaries, or other modules are called)")
    if reads:
        check = ReadValuesCheck(model, reads, flippable=others is not None, one_mode=one_mode)
        for index, stage in enumerate(built):
            stage.register_forward_pre_hook(check, with_kwargs=True)
            if others is not None:
                stage._modes = _Modes(check, (stage.graph, others[index]))
    _name_unheld_aliases(model, built)
    chosen = [built[index] for index in stages]
    if device is not None:
        for module in chosen:
            module.to(device)
    return chosen


# -- units -----------------------------------------------------------------------------------------


def _units(model: nn.Module, stage_of: dict[str, int | None]) -> list[str]:
    """The largest submodules that run whole on one stage, or, unannotated, hold no annotation inside."""
    subtree_stages: dict[str, set] = collections.defaultdict(set)
    for name, stage in stage_of.items():
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            subtree_stages[".".join(parts[:depth])].add(stage)
    units = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module._modules.items():
            if child is None:
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            whole = len(subtree_stages[name]) == 1
            if whole and (type(child).forward is not nn.Module.forward or _compiled_wrapper(child)):
                units.append(name)
            else:
                visit(name, child)

    if subtree_stages[""] == {None}:
        raise ValueError(f"split: {type(model).__name__} defines its own forward, so split cuts it by "
                         "pipeline_stage annotations on its submodules, and none carries one; annotate them "
                         "(any depth), or pass an nn.Sequential to balance automatically")
    if len(subtree_stages[""]) == 1:
        raise ValueError("split: the whole model sits on one stage; there is nothing to cut")
    visit("", model)
    return units


def _compiled_wrapper(module: nn.Module) -> bool:
    """A ``torch.compile(module)`` wrapper, whose forward is an instance attribute calling its ``_orig_mod``."""
    from torch._dynamo.eval_frame import OptimizedModule  # as runtime/compiled_modules.py tells one

    return isinstance(module, OptimizedModule)


@contextlib.contextmanager
def _compiled_units_unwrapped(model: nn.Module, units: list[str]) -> Iterator[None]:
    """Each unit that is a ``torch.compile`` wrapper replaced by the module it wraps, under the wrapper's name: the
    capture then sees that module's call as the unit's (through the wrapper it records none, and the unit's body
    would land in the glue, placed by data flow), and the stage calls the wrapper, compiled, as the model does."""
    swapped = []
    try:
        for unit in units:
            wrapper = model.get_submodule(unit)
            if _compiled_wrapper(wrapper):
                parent_name, _, child = unit.rpartition(".")
                parent = model.get_submodule(parent_name)
                parent._modules[child] = wrapper._orig_mod
                swapped.append((parent, child, wrapper))
        yield
    finally:
        for parent, child, wrapper in swapped:
            parent._modules[child] = wrapper


def _glue_modules(model: nn.Module, units: list[str]) -> list[tuple[str, nn.Module]]:
    """The modules whose own forward code the capture traces into the glue: those not within a unit."""
    return [(name, module) for name, module in model.named_modules()
            if not any(name == unit or name.startswith(unit + ".") for unit in units)]


# -- capture ---------------------------------------------------------------------------------------


def _export(model: nn.Module, args: tuple, kwargs: dict, units: list[str],
            stack_traces: bool) -> torch.export.ExportedProgram:
    """The model's forward on the example micro-batch, every tensor dimension left to torch.export; with
    ``stack_traces``, each node records the source line that made it (a quarter of the capture's time)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    dynamic_shapes = {
        name: pytree.tree_map(lambda value: {d: Dim.AUTO for d in range(value.dim())}
                              if isinstance(value, torch.Tensor) else None, value)
        for name, value in bound.arguments.items()
    }
    kinds = {param.name: param.kind for param in signature.parameters.values()}
    if any(kinds[name] in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for name in bound.arguments):
        dynamic_shapes = None  # torch.export names *args/**kwargs differently; fall back to its default
    called_whole = [model.get_submodule(unit) for unit in units]
    try:
        with (torch.random.fork_rng(devices=[]), _recording_stack_traces(stack_traces),
              _compiled_units_unwrapped(model, units), _without_pre_hooks(called_whole),
              _dataclasses_registered(called_whole), _reentrant_checkpoints_traced_through()):
            return torch.export.export(model, tuple(args), dict(kwargs), strict=False, dynamic_shapes=dynamic_shapes,
                                       preserve_module_call_signature=tuple(units))
    except Exception as error:  # noqa: BLE001 - every capture failure becomes the same clear error
        raise ValueError(_capture_failure(model, error, lambda: _units_given_odd_values(model, args, kwargs, units))
                         ) from error


@contextlib.contextmanager
def _reentrant_checkpoints_traced_through() -> Iterator[None]:
    """torch.utils.checkpoint with use_reentrant=True (Hugging Face's default) runs its function under no_grad inside
    an autograd.Function, which the capture cannot cut into module calls; the capture traces the function itself
    instead. A unit's traced body gives way to its module call, which checkpoints as written at every step; a
    checkpoint in the glue is not kept, as a non-reentrant one is not (docs/your-model.md)."""
    function = torch.utils.checkpoint.CheckpointFunction
    own = function.__dict__.get("apply")
    function.apply = staticmethod(lambda run, preserve_rng_state, *args: run(*args))
    try:
        yield
    finally:
        if own is None:
            del function.apply
        else:
            function.apply = own


@contextlib.contextmanager
def _dataclasses_registered(units: list[nn.Module]) -> Iterator[None]:
    """A dataclass a unit takes or returns is registered as a pytree node as the runtime registers it at a stage
    boundary (``boundary.flatten``), before torch.export's own hooks at the unit's call take its arguments and output
    apart, which refuse anything else than tensors and plain values."""
    def arguments(module, args, kwargs):
        boundary.flatten((args, kwargs))

    def output(module, args, result):
        boundary.flatten(result)

    handles = [hook for unit in units for hook in (unit.register_forward_pre_hook(arguments, with_kwargs=True),
                                                   unit.register_forward_hook(output))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _without_pre_hooks(units: list[nn.Module]) -> Iterator[None]:
    """The units' forward pre-hooks set aside: torch.export marks where a unit's call begins after them, so what they
    compute would land in the glue, and run again in the unit's own call at every step."""
    kept = [(unit, unit._forward_pre_hooks) for unit in units if unit._forward_pre_hooks]
    try:
        for unit, _ in kept:
            unit._forward_pre_hooks = collections.OrderedDict()
        yield
    finally:
        for unit, hooks in kept:
            unit._forward_pre_hooks = hooks


@contextlib.contextmanager
def _recording_stack_traces(record: bool) -> Iterator[None]:
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):  # a torch that records them always (2.11)
        yield
        return
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = not record
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _units_given_odd_values(model: nn.Module, args: tuple, kwargs: dict, units: list[str]) -> list[str]:
    """The units that one eager call of the model calls with, or that return, a value torch.export cannot keep at a
    module's call (a str, an object of the model's own; an int, which may be a size read from a shape), each said
    once with what it got: the culprits of a capture that failed there."""
    found: dict[str, str] = {}

    def odd(values) -> str | None:
        for value in pytree.tree_leaves(values):
            if isinstance(value, str):
                return f"the str {value!r}"
            if not isinstance(value, (torch.Tensor, bool, float, type(None), int)):
                return f"a {type(value).__name__}"
        ints = [value for value in pytree.tree_leaves(values) if type(value) is int]
        return f"the int(s) {ints} (sizes read from a shape?)" if ints else None

    def hooks(name):
        def before(module, given_args, given_kwargs):
            said = odd((given_args, given_kwargs))
            if said:
                found.setdefault(name, f"{name!r} is called with {said}")

        def after(module, given_args, output):
            said = odd(output)
            if said:
                found.setdefault(name, f"{name!r} returns {said}")
        return before, after

    handles, buffers = [], [(buffer, buffer.clone()) for buffer in model.buffers()]  # left as they were
    try:
        for name in units:
            before, after = hooks(name)
            module = model.get_submodule(name)
            handles += [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the capture's own message stands
        pass
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return list(found.values())


def _capture_failure(model: nn.Module, error: Exception, odd_units: Callable[[], list[str]] = list) -> str:
    text = str(error)
    lines = [line for line in text.splitlines() if line.strip()]
    where = [line.strip() for line in lines if line.strip().startswith(("File ", "User Stack", "Potential framework"))]
    data_dependent = any(word in text for word in ("data-dependent", "data dependent", "GuardOnDataDependent",
                                                   "Could not guard on", "DataDependent"))
    construct = ("control flow or a Python value that depends on tensor contents (an `if` on a tensor, "
                 ".item(), .tolist(), a nonzero-sized result)") if data_dependent else "an operation torch.export cannot capture"
    summary = lines[0] if lines else type(error).__name__
    location = f" at {where[0]}" if where else ""
    said = f"torch.export said: {type(error).__name__}: {summary[:400]}"
    if "Cache" in text and "pytree flattened inputs" in text:
        return (f"split: cannot capture {type(model).__name__}.forward on example_inputs: a module that runs whole on a "
                f"stage is called with a key-value cache ({said}). A cache serves generation, not a training step: "
                "set use_cache=False in the model's config")
    if "pytree flattened inputs" in text or "Expected code to be unreachable" in text:
        culprits = odd_units()
        named = f" ({'; '.join(culprits)})" if culprits else ""
        return (f"split: cannot capture {type(model).__name__}.forward on example_inputs: a module that runs whole on a "
                "stage is called with, or returns, a value torch.export cannot keep at a module's call (a str, a size "
                f"read from a tensor's shape, an object of its own){named}; {said}. Let the module find it itself (a "
                "str as its attribute, a size from its input's shape), or annotate the module above it, so that the "
                "call lies inside one stage")
    return (f"split: cannot capture {type(model).__name__}.forward on example_inputs: it uses {construct}{location}. "
            f"{said}. Make that code depend on shapes or "
            "Python values only, or annotate at a coarser level by splitting the model by hand into stage modules "
            "(nn.Sequential children) and passing them to pipecomm.Pipeline")


class _ArgumentCheck:
    """Stage 0's forward pre-hook: the model's arguments, given as in any call of its forward, put in the
    positional/keyword form of the capture and checked against the shapes the capture holds for."""

    def __init__(self, model: nn.Module, example_args: tuple, example_kwargs: dict, stage: nn.Module, exported):
        self.signature = inspect.signature(model.forward)
        names = list(self.signature.parameters)
        self.positional = names[: len(example_args)]
        self.keywords = list(example_kwargs)
        self.placeholders = [node for node in stage.graph.nodes if node.op == "placeholder"]
        self.range_constraints = exported.range_constraints
        # What torch's check of the inputs leaves out: a None of the example (a mask left out), which the captured
        # code never reads, and each tensor's dtype, which the model's code may branch on (a bool mask or a float one).
        self.kinds = {pytree.keystr(path): _kind(value)
                      for path, value in pytree.tree_flatten_with_path((tuple(example_args), dict(example_kwargs)))[0]}

    def _check_kinds(self, flat: list) -> None:
        for path, value in flat:
            captured, now = self.kinds.get(pytree.keystr(path)), _kind(value)
            if captured is not None and captured != now and (captured == "None" or now != "None"):
                # (args, kwargs)[0][i] is the i-th positional argument, [1][name] the keyword one.
                index = path[1].idx if path[0].idx == 0 else None
                name = path[1].key if index is None else (
                    self.positional[index] if index < len(self.positional) else f"positional argument {index}")
                where = name + pytree.keystr(path[2:])
                raise ValueError(
                    f"split: these inputs do not fit the captured forward: the input {where} is {now}, where the "
                    f"example split captured was {captured}. The capture holds for its example's Nones (code "
                    "reading an input captured as None is not in it) and dtypes (the model's code may branch on "
                    "them); pass the same, or split with an example that has the ones you call with (a Pipeline of "
                    "its own)")

    def __call__(self, module, args, kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError as error:
            raise ValueError(f"split: stage 0 takes the model's forward arguments: {error}") from error
        expected = set(self.positional) | set(self.keywords)
        if set(bound) != expected:
            raise ValueError(f"split: the model was captured with arguments {sorted(expected)} but is called with "
                             f"{sorted(bound)}; capture it with example inputs of the same arguments")
        args = tuple(bound[name] for name in self.positional)
        kwargs = {name: bound[name] for name in self.keywords}
        flat = pytree.tree_flatten_with_path((args, kwargs))[0]
        self._check_kinds(flat)
        try:
            torch._export.utils._check_input_constraints_for_graph(self.placeholders, flat, self.range_constraints)
        except RuntimeError as error:
            # torch's advice to export again with dynamic_shapes is for its callers: split's message says what to do.
            text = " ".join(str(error).split())
            text = re.sub(r"\s*If you meant for this dimension to be dynamic.*", "", text).rstrip(".")
            if ".shape[" in text and "to be equal to" in text:
                # torch.export kept a size fixed: a layer's, or one the forward's own code loops or branches over.
                advice = ("The capture holds for that size only: something fixes it (a layer's feature size, or the "
                          "model's own code outside the modules that run whole on a stage looping or branching over "
                          "it). Call with that size, or split with an example of the size you call with (a Pipeline "
                          "of its own)")
            elif "to be equal to" in text or "to be a tensor" in text or "to be None" in text:
                # A Python value (or None for a tensor) is part of the capture, as a constant.
                advice = ("The capture holds for the Python values and the Nones of its example as they were; pass "
                          "the same, or split with an example that has the ones you call with (a Pipeline of its own)")
            else:
                advice = ("The capture holds for the shapes torch.export could keep symbolic; capture with an "
                          "example micro-batch of at least 2 samples and sequence positions")
            raise ValueError(f"split: these inputs do not fit the captured forward: {text}. {advice}") from error
        return args, kwargs


def _kind(value: object) -> str:
    """An input leaf as the argument check compares it: a tensor's dtype, None, or any other value."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return "None" if value is None else "a value"


# -- units back to module calls --------------------------------------------------------------------


def _unit_call_of(node: torch.fx.Node, units: set[str]) -> str | None:
    """The unit call (``fqn``, or ``fqn@n`` for its n-th repeat) whose traced body ``node`` belongs to."""
    for key, (fqn, _) in (node.meta.get("nn_module_stack") or {}).items():
        if fqn in units:
            return fqn + ("@" + key.rsplit("@", 1)[1] if "@" in key else "")
    return None


def _outline_units(exported, units: set[str]) -> torch.fx.Graph:
    """The exported graph with every unit's body replaced by a call of the user's module."""
    signatures = {entry.fqn: entry.signature for entry in exported.module_call_graph if entry.signature}
    state_inputs = {spec.arg.name: spec for spec in exported.graph_signature.input_specs
                    if spec.kind != InputKind.USER_INPUT}
    unit_outputs = _check_mutations(exported, units)
    graph = torch.fx.Graph()
    body_of = {node: _unit_call_of(node, units) for node in exported.graph.nodes}
    values = _Bindings({node.name: call for node, call in body_of.items()},
                       {node.name: node for node in exported.graph.nodes}, graph)
    specs: dict[str, Any] = {}
    outlined: set[str] = set()

    def value(arg):
        return pytree.tree_map_only(torch.fx.Node, lambda node: values[node.name], arg)

    for node in exported.graph.nodes:
        call = body_of[node]
        if node.op == "placeholder":
            spec = state_inputs.get(node.name)
            if spec is None:
                values[node.name] = graph.placeholder(node.name)
                values[node.name].meta = dict(node.meta)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                values[node.name] = _Deferred(spec.target)
            else:
                specs[spec.target] = exported.constants[spec.target]
                values[node.name] = _Deferred(spec.target)
        elif node.op == "output":
            user_outputs = [arg for arg, out in zip(node.args[0], exported.graph_signature.output_specs)
                            if out.kind == OutputKind.USER_OUTPUT]
            graph.output(tuple(_materialize(graph, value(arg)) for arg in user_outputs))
        elif call is None:
            args = pytree.tree_map(lambda v: _materialize(graph, v), value(node.args))
            kwargs = pytree.tree_map(lambda v: _materialize(graph, v), value(node.kwargs))
            new = graph.call_function(node.target, args, kwargs)
            new.meta = dict(node.meta)
            values[node.name] = new
        elif call not in outlined:
            outlined.add(call)
            _emit_unit_call(graph, call, signatures[call], values, specs)
    # Code outside every unit that read an inner value was refused above, by `values`; left are uses
    # inside another unit's body, which its module call would not see.
    for node in exported.graph.nodes:
        call = body_of[node]
        if (call is not None and node.name not in values and node.name not in unit_outputs
                and not _is_shape_arithmetic(node) and any(body_of[user] not in (None, call) for user in node.users)):
            raise _inner_value_escapes(node.name, call)
    _drop_unused(graph)
    graph.lint()
    graph._pipecomm_attributes = specs  # spec and constant attributes the stage modules need
    return graph


class _Bindings(dict):
    """Exported node name -> its value in the new graph. A unit's inner values have none: only its outputs
    leave its module call, so code outside that reads one (a router's logits a hook recorded for the
    model's auxiliary loss) is refused by name; but for a size, which torch.export computed once inside the unit
    and reused outside (``torch.ones(embeddings.size()[:-1])`` after a vision tower), read again from a value
    outside that has it as a dimension."""

    def __init__(self, unit_call_of: dict[str, str | None], exported: dict[str, torch.fx.Node], graph: torch.fx.Graph):
        super().__init__()
        self._unit_call_of, self._exported, self._graph = unit_call_of, exported, graph

    def exported_value(self, name: str) -> Any:
        return self._exported[name].meta.get("val")

    def __missing__(self, name: str):
        size = self.exported_value(name)
        if isinstance(size, int):
            return size
        if isinstance(size, torch.SymInt):
            for bound, node in list(self.items()):
                value = self._exported[bound].meta.get("val")
                if not isinstance(node, torch.fx.Node) or not isinstance(value, torch.Tensor):
                    continue
                for dim, extent in enumerate(value.shape):
                    if isinstance(extent, torch.SymInt) and extent.node.expr == size.node.expr:
                        read = self._graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                        read.meta["val"] = size
                        self[name] = read
                        return read
        raise _inner_value_escapes(name, self._unit_call_of[name])


def _inner_value_escapes(name: str, call: str) -> ValueError:
    return ValueError(f"split: {name}, computed inside {call.split('@')[0]!r}, is used outside it without being one "
                      "of its outputs; annotate its parent instead, or turn off what reads it (a Hugging Face "
                      "mixture of experts' output_router_logits, say)")


def _is_shape_arithmetic(node: torch.fx.Node) -> bool:
    """A symbolic size (batch x sequence, say) rather than a tensor. Export computes one such expression
    once and reuses it in every later block (an MoE's token count); each block called as a module
    recomputes it from its own inputs, so its use inside another block is no hidden dependency."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _drop_unused(graph: torch.fx.Graph) -> None:
    """Removes what only the replaced unit bodies used: shape reads, attribute reads, tuple picks."""
    pure = (torch.ops.aten.sym_size.int, operator.getitem)
    for node in reversed(graph.nodes):
        if not node.users and (node.op == "get_attr" or (node.op == "call_function" and node.target in pure)):
            graph.erase_node(node)


class _Deferred:
    """A parameter, buffer or constant of the model: a get_attr emitted where it is used."""

    def __init__(self, target: str):
        self.target = target


def _materialize(graph: torch.fx.Graph, value):
    if isinstance(value, _Deferred):
        return graph.get_attr(value.target)
    return value


def _emit_unit_call(graph: torch.fx.Graph, call: str, signature, values: dict, specs: dict) -> None:
    """``module(*args, **kwargs)`` with the unit's original arguments; its flat outputs bound to their names."""
    fqn = call.split("@")[0]
    leaves = [arg.value if type(arg).__name__ == "ConstantArgument" else _materialize(graph, values[arg.name])
              for arg in signature.inputs]
    args_spec, kwargs_spec = _children(signature.in_spec)
    per_argument = list(_subtrees(leaves, args_spec)) + list(_subtrees(leaves[args_spec.num_leaves:], kwargs_spec))
    arguments = [_rebuild(graph, sub_leaves, sub_spec, specs) for sub_leaves, sub_spec in per_argument]
    positional = tuple(arguments[: args_spec.num_children])
    keywords = dict(zip(kwargs_spec.context, arguments[args_spec.num_children:]))
    result = graph.call_module(fqn, positional, keywords)
    out_spec = signature.out_spec
    outputs = signature.outputs
    if out_spec.is_leaf():
        flat = [result]
    elif out_spec.type in (tuple, list) and all(child.is_leaf() for child in _children(out_spec)):
        flat = [graph.call_function(operator.getitem, (result, index)) for index in range(out_spec.num_leaves)]
    else:
        name = f"_pipecomm_out_spec_{len(specs)}"
        specs[name] = out_spec
        flattened = graph.call_function(_flatten_as, (result, graph.get_attr(name)))
        flat = [graph.call_function(operator.getitem, (flattened, index)) for index in range(out_spec.num_leaves)]
    for argument, node in zip(outputs, flat):
        if type(argument).__name__ != "ConstantArgument":
            values[argument.name] = node
            # What the boundaries' comparison of two captures reads (a unit's output may cross one).
            node.meta.setdefault("val", values.exported_value(argument.name))


def _subtrees(leaves: list, spec):
    """(leaves, spec) of each child of a tuple/dict spec, in order."""
    offset = 0
    for child in _children(spec):
        yield leaves[offset : offset + child.num_leaves], child
        offset += child.num_leaves


def _children(spec) -> list:
    return list(spec.children()) if callable(getattr(spec, "children", None)) else list(spec.children_specs)


def _rebuild(graph: torch.fx.Graph, leaves: list, spec, specs: dict):
    """One argument of a unit call from its flat leaves: the leaf itself, or a tree_unflatten node."""
    if spec.is_leaf():
        return leaves[0]
    name = f"_pipecomm_in_spec_{len(specs)}"
    specs[name] = spec
    return graph.call_function(pytree.tree_unflatten, (list(leaves), graph.get_attr(name)))


def _flatten_as(value, spec) -> list:
    return torch.fx._pytree.tree_flatten_spec(value, spec)


def _check_mutations(exported, units: set[str]) -> set[str]:
    """Buffer updates inside units (BatchNorm statistics) happen in the user's module; any other mutation is refused."""
    unit_outputs = set()
    for spec in exported.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            if not any(spec.target.startswith(unit + ".") for unit in units):
                raise ValueError(f"split: the forward updates buffer {spec.target!r} outside every annotated module "
                                 "(it would not be updated in the pipeline); move that code into a module")
            unit_outputs.add(spec.arg.name)
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise ValueError(f"split: the forward mutates {spec.target!r} in place ({spec.kind.name}), which a "
                             "captured pipeline stage cannot reproduce")
    return unit_outputs


# -- placement -------------------------------------------------------------------------------------


def _place(graph: torch.fx.Graph, stage_of: dict, num_stages: int) -> dict:
    """Each node's stage: an annotated unit's own, the rest by data flow.

    Glue is never pinned to the module whose forward holds it: that module spans several stages
    (else it would be a unit), and its code between them belongs wherever its inputs are.
    """
    placement: dict[torch.fx.Node, int] = {}
    fixed: dict[torch.fx.Node, str] = {}
    for node in graph.nodes:
        if node.op == "call_module" and stage_of.get(node.target) is not None:
            placement[node] = stage_of[node.target]
            fixed[node] = node.target
    # No producer (a constant, an arange of a literal): as late as its first consumer, so it is not carried.
    for node in reversed(graph.nodes):
        if node.op == "output":
            placement[node] = num_stages - 1
        elif node.op == "placeholder":
            placement[node] = 0
        elif node not in placement and not _producers(node) and node.op != "get_attr":
            consumers = [placement[user] for user in node.users if user in placement]
            placement[node] = min(consumers) if consumers else 0
    for node in graph.nodes:
        if node not in placement and node.op != "get_attr":
            placement[node] = max((placement[p] for p in _producers(node)), default=0)
    # What only parameters and constants feed (W.t(), a logit scale's exp()) goes where its first consumer is, glue
    # consumers included, rather than being computed on stage 0 and carried over every boundary.
    free = set()
    for node in graph.nodes:
        if node.op == "call_function" and node not in fixed and all(p in free for p in _producers(node)):
            free.add(node)
    for node in reversed(graph.nodes):
        if node in free and node.users:
            placement[node] = min(placement[user] for user in node.users)
    # A unit's argument rebuilt from its leaves (rotary cos/sin as a tuple) is built where the unit runs,
    # so that the leaves cross once rather than once per consuming unit.
    for node in reversed(graph.nodes):
        if node.target is pytree.tree_unflatten and node not in fixed and node.users:
            placement[node] = max(placement[node], min(placement[user] for user in node.users))
    for node in graph.nodes:
        for producer in _producers(node):
            if placement[producer] > placement[node]:
                raise _DataFlowAgainstStages(
                    f"split: {_describe(node, fixed, placement)} uses a value that {_describe(producer, fixed, placement)} "
                    f"computes; stages must not decrease along the data flow")
    used = {stage for node, stage in placement.items() if node.op in ("call_module", "call_function")}
    for stage in range(num_stages):
        if stage not in used:
            raise ValueError(f"split: stage {stage} gets nothing to compute; annotate modules onto every stage in "
                             f"[0, {num_stages})")
    return placement


class _DataFlowAgainstStages(ValueError):
    """A value flows from a later stage to an earlier one."""


def _producers(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [arg for arg in node.all_input_nodes if arg.op != "get_attr"]


def _describe(node: torch.fx.Node, fixed: dict, placement: dict) -> str:
    if node in fixed:
        return f"{fixed[node]!r} (pipeline_stage {placement[node]})"
    stack = node.meta.get("stack_trace", "")
    line = [text.strip() for text in stack.splitlines() if text.strip().startswith("File")][-1:] if stack else []
    where = f" ({line[0]})" if line else ""
    return f"the operation {node.name}{where} on stage {placement[node]}"


# -- cutting ---------------------------------------------------------------------------------------


def _cut(model, exported, graph: torch.fx.Graph, placement: dict, num_stages: int, device,
         argument_names: list[str]) -> list[CapturedStage]:
    """The stages' graph modules; stage 0 takes the model's forward arguments, ``argument_names`` (each a structure
    of tensors: its placeholders are the leaves)."""
    nodes = [node for node in graph.nodes if node.op not in ("get_attr",)]
    last_use = {node: max((placement[user] for user in node.users), default=placement[node]) for node in nodes}
    attributes = dict(graph._pipecomm_attributes)
    capture_device = _capture_device(exported)
    stages = []
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    for stage in range(num_stages):
        crossing = [node for node in nodes if node.op != "output" and placement[node] <= stage < last_use[node]]
        stage_graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in inputs if stage == 0 else received:
            env[node] = stage_graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output") or placement[node] != stage:
                continue
            env[node] = stage_graph.node_copy(node, lambda arg: _local(stage_graph, env, arg))
            if device is not None:
                env[node].args, env[node].kwargs = _moved(env[node].args, capture_device, device), \
                    _moved(env[node].kwargs, capture_device, device)
        if stage == num_stages - 1:
            output = next(node for node in graph.nodes if node.op == "output")
            stage_graph.output(pytree.tree_map_only(torch.fx.Node, lambda arg: _local(stage_graph, env, arg), output.args[0]))
        else:
            stage_graph.output(tuple(env[node] for node in crossing))
        stage_graph._codegen = torch.fx.graph._PyTreeCodeGen(torch.fx.graph._PyTreeInfo(
            argument_names if stage == 0 else [node.name for node in received],
            exported.module_call_graph[0].signature.in_spec if stage == 0 else pytree.tree_structure(tuple(range(len(received)))),
            exported.module_call_graph[0].signature.out_spec if stage == num_stages - 1 else None,
        ))
        root = {**_model_attributes(model, stage_graph), **attributes}
        module = CapturedStage(root, stage_graph, class_name=f"CapturedStage{stage}")
        _keep_buffers_non_persistent(model, module)
        module.stage_index = stage
        module.num_stages = num_stages
        module.layer_names = tuple(node.target for node in stage_graph.nodes if node.op == "call_module")
        module.boundary_names = tuple(node.name for node in crossing)
        stages.append(module)
        received = crossing
    return stages


def _name_unheld_aliases(model: nn.Module, built: list[CapturedStage]) -> None:
    """A parameter the model also registers under a name no stage holds (BART's and T5's ``shared`` embedding, used
    only as the encoder's and decoder's ``embed_tokens``) is saved under that name too, by the lowest stage holding it,
    and that name is taken off again at loading: merged checkpoints then load strictly into the unsplit model."""
    held = [{id(param): name for name, param in stage.named_parameters(remove_duplicate=False)} for stage in built]
    names = {name for stage in built for name in stage.state_dict()}
    for name, param in model.named_parameters(remove_duplicate=False):
        holder = next((index for index, own in enumerate(held) if id(param) in own), None)
        if name in names or holder is None:
            continue
        stage, own = built[holder], held[holder][id(param)]
        stage._register_state_dict_hook(functools.partial(_saved_also_as, own, name))
        stage._register_load_state_dict_pre_hook(functools.partial(_loaded_without, name))
        names.add(name)


def _saved_also_as(own: str, alias: str, module, state_dict, prefix, local_metadata) -> None:
    if prefix + own in state_dict:
        state_dict[prefix + alias] = state_dict[prefix + own]


def _loaded_without(alias: str, state_dict, prefix, *args) -> None:
    state_dict.pop(prefix + alias, None)


def _argument_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The names of the model's forward arguments in a call with ``args`` and ``kwargs``: positional ones by the
    signature (``*args`` as args_0, args_1, ...), then the keywords, as the capture's input structure lists them."""
    signature = inspect.signature(model.forward)
    names = []
    for name, value in signature.bind_partial(*args).arguments.items():
        if signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL:
            names.extend(f"{name}_{index}" for index in range(len(value)))
        else:
            names.append(name)
    return names + list(kwargs)


def _other_mode_graphs(model: nn.Module, built: list[CapturedStage],
                       cut_other: Callable[[], list[CapturedStage]]) -> list[torch.fx.Graph] | None:
    """Each stage's graph cut from the capture of the model's other training mode, its attributes (constants) attached
    to the stage; None where that capture cuts otherwise than ``built`` (another number or kind of values crossing a
    boundary, another module called, a parameter or buffer the stage does not hold), which then keeps one mode."""
    try:
        others = cut_other()
    except Exception:  # noqa: BLE001 - its data flow goes against the stages: the stages keep the captured mode
        return None
    for stage, other in zip(built, others):
        if _interface(stage.graph) != _interface(other.graph):
            return None
        for node in other.graph.nodes:
            if node.op == "call_module" and _resolved(stage, node.target) is not _resolved(other, node.target):
                return None
            if (node.op == "get_attr" and _resolved(stage, node.target) is not _resolved(other, node.target)
                    and _resolved(model, node.target) is not _MISSING):
                return None
    for stage, other in zip(built, others):
        _attach_attributes(stage, other.graph, other, lambda value: value)
    return [other.graph for other in others]


def _interface(graph: torch.fx.Graph) -> tuple:
    """What a stage's callers and the next stage see of its graph: its inputs' and outputs' kinds, dtypes and ranks,
    and the output's structure."""
    def kind(node) -> tuple:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, value.dim())
        return (type(value).__name__,)

    output = next(node for node in graph.nodes if node.op == "output")
    return (tuple(kind(node) for node in graph.nodes if node.op == "placeholder"),
            tuple(kind(leaf) for leaf in pytree.tree_leaves(output.args[0])),
            graph._codegen.pytree_info.out_spec)


_MISSING = object()


def _resolved(module: nn.Module, target: str) -> Any:
    value = module
    for part in target.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            break
    return value


def _attach_attributes(stage: nn.Module, graph: torch.fx.Graph, source: nn.Module, convert: Callable) -> None:
    """The constants ``graph`` reads that ``stage`` lacks, taken from ``source`` (through ``convert``) as
    non-persistent buffers or plain attributes; one that ``stage`` holds under the same name as another object (a
    constant of the other capture) is attached under a new name, which the graph then reads."""
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = convert(_resolved(source, node.target))
        held = _resolved(stage, node.target)
        if held is value:
            continue
        if held is not _MISSING:
            node.target = next(name for name in (f"_pipecomm_other_mode_{n}" for n in itertools.count())
                               if _resolved(stage, name) is _MISSING)
        *path, field = node.target.split(".")
        owner = stage
        for part in path:
            if _resolved(owner, part) is _MISSING:
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            owner.register_buffer(field, value, persistent=False)
        else:
            setattr(owner, field, value)


def _local(graph: torch.fx.Graph, env: dict, arg: torch.fx.Node) -> torch.fx.Node:
    if arg.op == "get_attr":
        key = ("attr", arg.target)
        if key not in env:
            env[key] = graph.get_attr(arg.target)
        return env[key]
    return env[arg]


def _capture_device(exported) -> torch.device:
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            node = next(node for node in exported.graph.nodes if node.name == spec.arg.name)
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def _moved(arguments, capture_device: torch.device, device):
    """Glue that creates tensors on the capture device (an arange, a mask) creates them on ``device`` instead."""
    target = torch.device(device)
    return pytree.tree_map(lambda value: target if isinstance(value, torch.device) and value == capture_device else value,
                           arguments)


def _model_attributes(model: nn.Module, graph: torch.fx.Graph) -> dict[str, Any]:
    found = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and not node.target.startswith("_pipecomm_"):
            value = _resolved(model, node.target)
            if value is not _MISSING:  # else a lifted constant of the capture, supplied from the graph's attributes
                found[node.target] = value
    return found


def _keep_buffers_non_persistent(model: nn.Module, stage: nn.Module) -> None:
    """GraphModule registers every tensor it copies as a persistent buffer; restore the original's choice."""
    for name, _ in list(stage.named_buffers()):
        owner_name, _, field = name.rpartition(".")
        try:
            original = model.get_submodule(owner_name)
        except AttributeError:
            original = None
        if original is None or field in original._non_persistent_buffers_set or field not in original._buffers:
            stage.get_submodule(owner_name)._non_persistent_buffers_set.add(field)
