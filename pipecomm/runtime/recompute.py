"""Activation recomputation: stage modules, or the submodules a callable picks, run under torch.utils.checkpoint."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__: list[str] = []

_MISSING = object()


def checkpoint_stages(modules: list[nn.Module], recompute: bool | Callable[[nn.Module], bool]) -> Callable[[], None]:
    """Makes ``modules`` (``recompute=True``), or the outermost of their submodules for which ``recompute(module)``
    is True (the stage modules themselves included), recompute their forward during the backward; returns the undo.

    Only a checkpointed module's arguments (positional and keyword) and what it saves outside it are kept between
    forward and backward, so it must take every tensor it reads, parameters and buffers aside, as an argument: the
    pipeline frees a stage's sent outputs that nothing saved, and a tensor reached otherwise (an attribute set by
    its parent) would be read freed by the recomputation. Dropout masks come out the same, since the recomputation
    restores the random state of the forward.
    """
    if not isinstance(recompute, bool) and not callable(recompute):
        raise ValueError(f"Pipeline: recompute must be True, False or a callable module -> bool, not {recompute!r}")
    if recompute is False:
        return lambda: None
    picked = list(modules) if recompute is True else _outermost(modules, recompute)
    originals = []
    for module in {id(module): module for module in picked}.values():
        own = module.__dict__.get("forward", _MISSING)
        originals.append((module, own))
        module.forward = _Checkpointed(None if own is _MISSING else own, module)

    def undo() -> None:
        for module, forward in originals:
            if forward is _MISSING:
                del module.forward  # back to the class's forward
            else:
                module.forward = forward
        originals.clear()

    return undo


def _outermost(modules: list[nn.Module], pick: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules ``pick`` chooses, searched from each stage module down, not below a chosen one: a checkpoint
    inside another would recompute twice."""
    chosen, seen = [], set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        verdict = pick(module)
        if not isinstance(verdict, bool):
            raise ValueError(f"Pipeline: recompute({type(module).__name__}) returned {verdict!r}; the callable must "
                             "return True or False")
        if verdict:
            chosen.append(module)
        else:
            for child in module.children():
                visit(child)

    for module in modules:
        visit(module)
    return chosen


class _Checkpointed:
    """``module``'s forward (its own attribute, or None: its class's, looked up at each call, which a stage cut by
    split changes with the model's training mode), recomputed in the backward. An object and not a closure: a deep copy
    of the module (an EMA or teacher model made while the Pipeline holds it) gets one that runs the copy, and the
    module pickles."""

    def __init__(self, own_forward: Callable | None, module: nn.Module):
        self.own_forward = own_forward
        self.module = module
        self.norms = [norm for norm in module.modules() if isinstance(norm, nn.modules.batchnorm._BatchNorm)]
        in_norms = {id(buffer) for norm in self.norms for buffer in norm.buffers(recurse=False)}
        # Frozen parameters too: an EMA target kept as nn.Parameters and updated by the forward (BYOL, MoCo, DINO).
        self.others = [(name, buffer) for name, buffer in module.named_buffers() if id(buffer) not in in_norms] + [
            (name, param) for name, param in module.named_parameters() if not param.requires_grad]
        self.slots: list[tuple[str, nn.Module, str]] | None = None  # the first call's tensor attributes (_Stashed)

    def __call__(self, *args, **kwargs):
        # Every tensor goes in positionally, keyword ones included: checkpoint saves only its positional
        # arguments through autograd, where the pipeline sees what stays alive for the backward.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        compiling = torch.compiler.is_compiling()
        stashed = None
        if not compiling:
            if self.slots is None:
                self.slots = _tensor_slots(self.module)
            stashed = _Stashed(self.module, self.slots) if self.slots else None

        def replay(*leaves):
            if stashed:
                stashed.seen()
            args, kwargs = pytree.tree_unflatten(list(leaves), spec)
            if self.own_forward is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            return self.own_forward(*args, **kwargs)

        norms, others = self.norms, self.others
        if (others or any(norm.training and norm.track_running_stats for norm in norms)) and not compiling:
            output = checkpoint(replay, *leaves, use_reentrant=False, context_fn=lambda: (
                contextlib.nullcontext(), _recomputing(self.module, norms, others)))
        else:  # without buffers to watch, plain: torch.compile cannot trace a checkpoint given a context_fn
            output = checkpoint(replay, *leaves, use_reentrant=False)
        if stashed:
            stashed.forward_done()
        return output


class _Stashed:
    """The plain tensor attributes of a checkpointed module and its submodules (not parameters or buffers), as one
    micro-batch's forward read them: a parent that stashes a tensor on its child (``self.block.mask = mask``) before
    calling it has set another micro-batch's there by the time this one's backward recomputes, wherever a schedule
    runs forwards between a micro-batch's forward and its backward, and the recomputation would read it. Refused
    when the recomputation begins, naming the attribute. Attributes the forward sets itself (an output kept for
    logging) are not the forward's inputs and are left alone. Weak references: the check keeps nothing alive.

    ``slots`` are the (path, submodule, name) where the first forward found tensors (``_tensor_slots``): looking only
    there keeps the check to a few attribute reads per call."""

    def __init__(self, module: nn.Module, slots: list[tuple[str, nn.Module, str]]):
        self.module = module
        self.slots = slots
        self.at_start: list[tuple[weakref.ref, int] | None] | None = None
        self.set_by_forward: list[bool] = []

    def seen(self) -> None:
        """Called as the forward begins, then as the recomputation begins."""
        now = self._read()
        if self.at_start is None:
            self.at_start = now
            return
        for (path, _, name), before, after, own in zip(self.slots, self.at_start, now, self.set_by_forward):
            if own or before is None or _same(before, after):
                continue
            raise RuntimeError(
                f"recompute: the recomputed {type(self.module).__name__} reads its tensor attribute "
                f"{'.'.join(filter(None, (path, name)))!r}, which was "
                f"{'changed in place' if after is not None and before[0]() is after[0]() else 'replaced'} between "
                "this micro-batch's forward and its recomputation (another micro-batch's forward set it, as a parent "
                "stashing a tensor on its child does): the recomputation would compute with it. Pass the tensor as an "
                "argument to the module, or leave the module out of recompute=")

    def forward_done(self) -> None:
        if self.at_start is not None:
            self.set_by_forward = [not _same(before, after) if before else after is not None
                                   for before, after in zip(self.at_start, self._read())]

    def _read(self) -> list[tuple[weakref.ref, int] | None]:
        values = [sub.__dict__.get(name) for _, sub, name in self.slots]
        return [(weakref.ref(value), value._version) if isinstance(value, torch.Tensor) else None for value in values]


def _tensor_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, submodule, name) of each plain tensor attribute of ``module`` and its submodules."""
    return [(path, sub, name) for path, sub in module.named_modules() for name, value in vars(sub).items()
            if isinstance(value, torch.Tensor)]


def _same(before: tuple[weakref.ref, int], after: tuple[weakref.ref, int] | None) -> bool:
    """Whether an attribute holds the tensor it held before (a freed one's reference is dead), at its version then."""
    value = before[0]()
    return after is not None and value is not None and value is after[0]() and before[1] == after[1]


@contextlib.contextmanager
def _recomputing(module: nn.Module, norms: list[nn.Module], others: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """A recomputation, which must not update batch norms' running statistics a second time: ``norms``' buffers are
    put back as the forward left them (one process updates them once per micro-batch; they are a few numbers per
    channel). Any other buffer or frozen parameter the recomputation changes in place (a running mean the forward
    also reads, a counter, a cache, an EMA target) is refused: the recomputation would compute with another value
    than the forward did."""
    kept = [(buffer, buffer.clone()) for norm in norms if norm.training and norm.track_running_stats
            for buffer in norm.buffers(recurse=False)]
    versions = [buffer._version for _, buffer in others]
    try:
        yield
    finally:  # also where checkpoint stops the recomputation early, by an exception, once it has what it needs
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)
        changed = [name for (name, buffer), version in zip(others, versions) if buffer._version != version]
        if changed:
            raise RuntimeError(
                f"recompute: recomputing {type(module).__name__}'s forward changed its buffer(s) or frozen "
                f"parameter(s) {changed} in place again (a running mean, a counter, a cache, an EMA target): the "
                "recomputation computes with other values than the forward did, and they count each micro-batch "
                "twice, where one process without recomputation "
                "does it once; leave this module out of recompute= (a callable choosing modules) or move the update "
                "out of its forward")
