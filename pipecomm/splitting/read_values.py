"""Python values that a captured forward's own code read, such as a module's ``training`` flag or a temperature: recorded
while torch.export traces it, and checked again before every call of a stage cut from it.

The capture turns every such read into a constant: ``F.dropout(h, 0.1, self.training)`` in a model's forward, outside
its annotated modules, is a dropout or nothing in that capture, whatever ``model.eval()`` says later; split captures
the other mode too where the training flags change the code, and the flags pick one at each call. The annotated modules
are called as the user's own objects and read their attributes at each call; only the code around them is frozen.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__: list[str] = []

_PLAIN = (bool, int, float, str, type(None), torch.dtype)


class ValueRead:
    """``owner.name`` read as ``value`` by the traced code; ``path`` names the owner in the model."""

    def __init__(self, owner: object, path: str, name: str, value: object):
        self.owner, self.path, self.name, self.value = owner, path, name, value
        # Read past the owner's own __getattribute__ (a Hugging Face config's is Python's): checked at every call.
        self._attributes = object.__getattribute__(owner, "__dict__")

    def now(self) -> object:
        return self._attributes.get(self.name, _GONE)

    def changed(self) -> bool:
        return not _same(self.now(), self.value)

    def describe(self) -> str:
        where = f"{type(self.owner).__name__}" + (f" ({self.path})" if self.path else "")
        return f"{where}.{self.name}: {self.value!r} at the capture, {_shown(self.now())} now"


_GONE = object()


def _shown(value: object) -> str:
    return "deleted" if value is _GONE else repr(value)


# While a capture records: id(owner) -> (its path, where its reads go, the names already recorded); and how many
# calls of the modules that run whole on a stage are under way (their own code reads their attributes at every call).
_RECORDING: dict[int, tuple[str, list[ValueRead], set[str]]] = {}
_units_running = [0]


@contextlib.contextmanager
def recording_reads(glue: Sequence[tuple[str, nn.Module]], units: Sequence[tuple[str, nn.Module]] = ()
                    ) -> Iterator[list[ValueRead]]:
    """Within the block, every read by the captured code of a plain value (bool, int, float, str, None, dtype) kept in
    the own attributes of the ``glue`` modules or the ``units`` (the modules called whole), or of the plain objects
    they hold (a Hugging Face config), is recorded once per attribute, as the value first read. Reads made inside a
    unit's call, and torch's own, are not: those run again at every call. Each owner's class is swapped for a
    subclass that records, and restored after."""
    reads: list[ValueRead] = []
    swapped: list[tuple[object, type]] = []
    modules = [*glue, *units]
    owners = [*modules, *((f"{path}.{name}" if path else name, value) for path, module in modules
                          for name, value in vars(module).items() if _plain_object(value))]
    unit_ids = {id(unit) for _, unit in units}

    def entering(module, args):
        if id(module) in unit_ids:
            _units_running[0] += 1

    def leaving(module, args, output):
        if id(module) in unit_ids:
            _units_running[0] -= 1

    hooks = [register_module_forward_pre_hook(entering), register_module_forward_hook(leaving, always_call=True)]
    try:
        for path, owner in owners:
            if id(owner) in _RECORDING:
                continue  # held twice (one config in every module)
            original = type(owner)
            try:  # past the owner's own __setattr__ (a frozen dataclass refuses every assignment)
                object.__setattr__(owner, "__class__", _recording_class(original))
            except Exception:  # noqa: BLE001 - a class that takes no subclass (an enum, slots): left unrecorded
                continue
            swapped.append((owner, original))
            _RECORDING[id(owner)] = (path, reads, set())
        yield reads
    finally:
        for hook in hooks:
            hook.remove()
        _units_running[0] = 0
        for owner, original in swapped:
            object.__setattr__(owner, "__class__", original)
            _RECORDING.pop(id(owner), None)


def _plain_object(value: object) -> bool:
    """An object of the caller's own that keeps its values as attributes (a config), not a module, tensor, function,
    class or container."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not callable(value) and type(value).__module__ != "builtins")


_SUBCLASSES: dict[type, type] = {}


def _recording_class(original: type) -> type:
    if original not in _SUBCLASSES:
        def __getattribute__(self, name):  # noqa: N807 - the hook Python looks up by this name
            value = original.__getattribute__(self, name)
            if (type(value) in _PLAIN and id(self) in _RECORDING and not _units_running[0]
                    and not sys._getframe(1).f_globals.get("__name__", "").startswith("torch.")):
                path, reads, seen = _RECORDING[id(self)]
                if name not in seen and name in object.__getattribute__(self, "__dict__"):
                    seen.add(name)
                    reads.append(ValueRead(self, path, name, value))
            return value

        _SUBCLASSES[original] = type(original.__name__, (original,), {
            "__getattribute__": __getattribute__, "__module__": original.__module__,
            "__qualname__": original.__qualname__})
    return _SUBCLASSES[original]


def with_every_training_flag(reads: list[ValueRead], modules: Sequence[tuple[str, nn.Module]]) -> list[ValueRead]:
    """``reads``, where it holds a module's ``training`` flag, with those of all ``modules`` (the model's own outside
    the stages' modules, and those): the capture records the flags its code read, which depend on their values
    (``self.training or self.head.training`` reads the second only where the first is False)."""
    if not any(_training_flag(read) for read in reads):
        return reads
    return [read for read in reads if not _training_flag(read)] + [
        ValueRead(module, path, "training", module.training) for path, module in modules]


def mattering(reads: list[ValueRead], capture_again: Callable[[], Any], captured: str) -> tuple[list[ValueRead], Any]:
    """``reads``, but the modules' ``training`` flags where flipping them all together leaves ``captured`` as it was
    (a forward that only warns by them: ``model.eval()`` stays free); and the capture with every flag flipped, the
    code ``model.eval()`` (or ``model.train()``) runs: None where no flag matters, the error where it failed.
    Flags are judged together, never one by one: ``if self.training or self.head.training`` changes with neither
    alone. ``capture_again`` gives a program with ``.graph_module``; other values stay watched without a capture."""
    flags = [read for read in reads if _training_flag(read)]
    if not flags:
        return reads, None
    flipped = _captured_flipped(flags, capture_again)
    if not isinstance(flipped, Exception) and flipped.graph_module.code == captured:
        return [read for read in reads if read not in flags], None
    return reads, flipped


def _captured_flipped(flags: list[ValueRead], capture_again: Callable[[], Any]) -> Any:
    for read in flags:
        vars(read.owner)[read.name] = not read.value
    try:
        return capture_again()
    except Exception as error:  # noqa: BLE001 - a forward that cannot run with them flipped depends on them
        return error
    finally:
        for read in flags:
            vars(read.owner)[read.name] = read.value


class ReadValuesCheck:
    """A stage's forward pre-hook: refuses a call once a value the capture read has changed, naming it; the stage
    would compute what the capture saw. The ``training`` flags among them may all take their other value where split
    captured the forward in both modes (``flippable``): the stage then runs that capture (``picked``)."""

    def __init__(self, model: nn.Module, reads: list[ValueRead], flippable: bool, one_mode: str = ""):
        self.model_name = type(model).__name__
        self.reads = reads
        self.flags = [read for read in reads if _training_flag(read)]
        self.flippable = flippable
        self.one_mode = one_mode  # why split could not keep the other mode too

    def for_copy(self, copy: nn.Module) -> ReadValuesCheck:
        """The check of a deep copy of a stage (an EMA teacher): its mode is its own ``training``, not the model's
        flags, which the original stages train by; the other values read stay the model's."""
        captured = {read.value for read in self.flags}
        if len(captured) != 1:
            return self  # captured in a mixed mode: the copy changes no flag either
        check = ReadValuesCheck.__new__(ReadValuesCheck)
        check.model_name, check.flippable, check.one_mode = self.model_name, self.flippable, self.one_mode
        check.flags = [ValueRead(copy, "", "training", captured.pop())]
        check.reads = [read for read in self.reads if read not in self.flags] + check.flags
        return check

    def picked(self) -> int | None:
        """Which capture the training flags read pick: 0 the one split kept (all as they were), 1 the other mode's
        (all flipped, where split captured it); None where neither holds (some flipped, some not)."""
        flipped = sum(read.changed() for read in self.flags)
        if not flipped:
            return 0
        return 1 if self.flippable and flipped == len(self.flags) else None

    def changed(self) -> list[str]:
        """The values read that have changed since the capture, described: the training flags where they pick no
        capture."""
        flags_fit = self.picked() is not None
        return [read.describe() for read in self.reads
                if read.changed() and not (flags_fit and read in self.flags)]

    def set_training(self, mode: bool) -> None:
        """A stage's ``train(mode)``: the training flags the capture read (the model's own modules outside the stage,
        as ``model.train(mode)`` would set them), so that the stage runs as after ``model.train(mode)``."""
        for read in self.flags:
            read.owner.training = mode

    def __call__(self, module, args, kwargs):
        changed = self.changed()
        if changed:
            mixed = self.flippable and any(read.changed() for read in self.flags)
            raise ValueError(
                f"split captured {self.model_name}.forward's own code (outside the modules that run whole on a stage) "
                "with these values as constants, and they have changed since: "
                + "; ".join(changed)
                + (". It was captured in training and in eval mode, with these flags all True or all False"
                   if mixed else "")
                + (f". Split kept one mode only: the other {self.one_mode}"
                   if self.one_mode and any(read.changed() for read in self.flags) else "")
                + ". The stages would compute what the capture saw. Set them before split, move what reads them into "
                "a module (nn.Dropout rather than F.dropout(x, p, self.training)), or split the model again after "
                "the change (a Pipeline of its own)")


def _training_flag(read: ValueRead) -> bool:
    """A module's ``training``, which ``model.train()`` / ``model.eval()`` set (a config's is a value as any other)."""
    return read.name == "training" and isinstance(read.owner, nn.Module)


def _same(now: object, then: object) -> bool:
    return type(now) is type(then) and now == then
