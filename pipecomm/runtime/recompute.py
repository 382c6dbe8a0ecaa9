"""Activation recomputation: stage modules, or the submodules a callable picks, run under torch.utils.checkpoint."""

from __future__ import annotations

import contextlib
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
        module.forward = _checkpointed(None if own is _MISSING else own, module)

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


def _checkpointed(own_forward: Callable | None, module: nn.Module) -> Callable:
    """``module``'s forward (its own attribute, or None: its class's, looked up at each call, which a stage cut by
    split changes with the model's training mode), recomputed in the backward."""
    norms = [norm for norm in module.modules() if isinstance(norm, nn.modules.batchnorm._BatchNorm)]
    in_norms = {id(buffer) for norm in norms for buffer in norm.buffers(recurse=False)}
    # Frozen parameters too: an EMA target kept as nn.Parameters and updated by the forward (BYOL, MoCo, DINO).
    others = [(name, buffer) for name, buffer in module.named_buffers() if id(buffer) not in in_norms] + [
        (name, param) for name, param in module.named_parameters() if not param.requires_grad]

    def run(*args, **kwargs):
        # Every tensor goes in positionally, keyword ones included: checkpoint saves only its positional
        # arguments through autograd, where the pipeline sees what stays alive for the backward.
        leaves, spec = pytree.tree_flatten((args, kwargs))

        def replay(*leaves):
            args, kwargs = pytree.tree_unflatten(list(leaves), spec)
            if own_forward is None:
                return type(module).forward(module, *args, **kwargs)
            return own_forward(*args, **kwargs)

        if (others or any(norm.training and norm.track_running_stats for norm in norms)) and \
                not torch.compiler.is_compiling():
            return checkpoint(replay, *leaves, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), _recomputing(module, norms, others)))
        # Without buffers to watch, plain: torch.compile cannot trace a checkpoint given a context_fn.
        return checkpoint(replay, *leaves, use_reentrant=False)

    return run


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
