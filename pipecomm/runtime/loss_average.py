"""Where the mean of the micro-batches' losses differs from one process's loss on the whole batch, told from a torch
loss that ``loss_fn`` is and the targets, and the warning that says so."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__: list[str] = []

# The functional losses that count their targets, with their defaults (torch's).
_COUNTING_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
_DEFAULTS = {"reduction": "mean", "ignore_index": -100, "weight": None}


class AverageCheck:
    """The last stage's look at the first steps' targets: a warning, once, where the step's mean of the micro-batches'
    losses differs from one process's loss on the whole batch, which is silent otherwise. The first steps only, since
    it reads the targets' counts back from the device; a padded batch shows in the first few."""

    STEPS = 3

    def __init__(self, loss_fn: Callable, rank: int):
        self.loss_fn = loss_fn
        self.rank = rank
        self.steps_left = self.STEPS

    def see(self, micro_batch_targets: Sequence[tuple]) -> None:
        if self.steps_left == 0:
            return
        self.steps_left -= 1
        reason = uneven_average(self.loss_fn, micro_batch_targets)
        if reason is not None:
            self.steps_left = 0
            # Pointed at the caller's line: above this call are the executor's run, the Pipeline's step, the caller.
            warnings.warn(f"pipecomm: pipeline rank {self.rank}: {reason}. Give loss_fn the batch's count as a "
                          "target and sum over the micro-batch (docs/using.md, 'The loss of a step')", stacklevel=4)


def uneven_average(loss_fn: Callable, micro_batch_targets: Sequence[tuple]) -> str | None:
    """Why the step's loss, the mean of the micro-batches' ``loss_fn`` values, is not ``loss_fn`` on the whole batch,
    where a torch loss says: one that sums over its micro-batch, or a mean over the targets it counts (those not
    ``ignore_index``, each weighted by its class's ``weight``) whose count differs between micro-batches. For a
    ``loss_fn`` of the caller's own, whose reduction cannot be read, given the class targets alone, those holding
    torch's ignore_index (-100, a padded language-model batch) in different numbers per micro-batch are named as what
    would differ if it averages over them. None where they agree or nothing can be told."""
    if len(micro_batch_targets) < 2:
        return None
    settings = _settings_of(loss_fn)
    if settings is None:
        if len(micro_batch_targets[0]) != 1:
            return None  # more than the labels (the batch's count, say): loss_fn may well weigh them itself
        counts = _counted(micro_batch_targets, _DEFAULTS["ignore_index"], None)
        if counts is None or len(set(counts)) == 1:
            return None
        return (f"the class targets hold torch's ignore_index, -100, in different numbers across the micro-batches "
                f"(the others come to {_listed(counts)}): if loss_fn averages over the targets it does not ignore, as "
                "cross_entropy does, the step's mean of their means weighs them equally, so the loss and the gradients "
                "differ from one process's on the whole batch")
    name, reduction, ignore_index, weight = settings
    if reduction == "sum":
        return (f"loss_fn ({name}) sums over its micro-batch and the step averages the {len(micro_batch_targets)} "
                f"micro-batches' losses, so the loss and the gradients are 1/{len(micro_batch_targets)} of one "
                "process's on the whole batch")
    if reduction != "mean" or ignore_index is None:
        return None
    counts = _counted(micro_batch_targets, ignore_index, weight)
    if counts is None or len(set(counts)) == 1:
        return None
    what = "targets not ignore_index" if weight is None else "class weights of the targets not ignore_index"
    return (f"loss_fn ({name}) is a mean over the {what}, which come to {_listed(counts)} in the micro-batches: the "
            "step's mean of their means weighs them equally, so the loss and the gradients differ from one process's "
            "on the whole batch")


def _counted(micro_batch_targets: Sequence[tuple], ignore_index: int, weight: torch.Tensor | None) -> list | None:
    """Per micro-batch, how many of its first target's class indices are not ``ignore_index`` (with ``weight``, their
    classes' weights summed); None where that target holds no class indices (class probabilities, or none)."""
    counts = []
    for targets in micro_batch_targets:
        target = targets[0] if targets else None
        if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
            return None
        counted = target != ignore_index
        counts.append(counted.sum() if weight is None else weight.to(target.device)[target[counted]].sum())
    return torch.stack(counts).tolist()


def _settings_of(loss_fn: Callable) -> tuple[str, str, int | None, torch.Tensor | None] | None:
    """(name, reduction, ignore_index, class weights) of a torch loss module or function (or a functools.partial of
    one), ignore_index None for a loss that counts no targets; None for anything else."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return type(loss_fn).__name__, loss_fn.reduction, loss_fn.ignore_index, loss_fn.weight
    if isinstance(loss_fn, nn.modules.loss._Loss):  # a mean over elements: equal in micro-batches of equal size
        return type(loss_fn).__name__, loss_fn.reduction, None, None
    keywords = {}
    if isinstance(loss_fn, functools.partial) and not loss_fn.args:
        keywords, loss_fn = loss_fn.keywords, loss_fn.func
    if loss_fn not in _COUNTING_FUNCTIONS:
        return None
    settings = {**_DEFAULTS, **keywords}
    return (f"torch.nn.functional.{_COUNTING_FUNCTIONS[loss_fn]}", settings["reduction"], settings["ignore_index"],
            settings["weight"])


def _listed(counts: list) -> str:
    shown = [f"{count:g}" if isinstance(count, float) else str(count) for count in counts[:8]]
    return ", ".join(shown) + (", ..." if len(counts) > 8 else "")
