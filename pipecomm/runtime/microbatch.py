"""Splitting a batch (any pytree) into micro-batches along its batch dimension (dim 0 unless the Pipeline says another),
and joining outputs back, with clear errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from pipecomm.runtime import boundary

__all__ = ["Batch", "any_requires_grad", "batch_size", "join", "split", "split_step"]


def split(batch: Any, micro_batches: int, what: str, device: torch.device | None = None, *,
          uneven: bool = False, dim: int = 0) -> list:
    """Splits every tensor leaf of ``batch`` into ``micro_batches`` chunks along ``dim``: one ``batch``-shaped structure
    each.

    Non-tensor leaves (and None) are passed unchanged to every micro-batch. Every tensor leaf must
    have the same size along ``dim``, the batch size. For training it must be divisible by
    ``micro_batches``: an uneven split would weight micro-batches differently in the mean loss, so
    it is a ValueError rather than a silent difference from single-process training. With
    ``uneven=True`` (inference) any batch works: it makes min(batch size, ``micro_batches``) chunks
    whose sizes differ by at most one.
    """
    flat = boundary.flatten(batch)
    size = batch_size(batch, what, dim)
    if size is not None and not uneven and size % micro_batches:
        raise ValueError(f"{_name(batch, flat.tensors[0], what)} has batch size {size}, which is not divisible by "
                         f"micro_batches={micro_batches}")
    if uneven and size is not None:
        if size == 0:
            raise ValueError(f"{what or 'inputs'}: the batch is empty")
        micro_batches = min(micro_batches, size)
    if device is not None:
        flat = flat._replace(tensors=[tensor.to(device, non_blocking=True) for tensor in flat.tensors])
    chunks = [tensor.tensor_split(micro_batches, dim=dim) for tensor in flat.tensors]
    return [boundary.unflatten([parts[index] for parts in chunks], flat.layout) for index in range(micro_batches)]


def split_step(inputs: tuple, kwargs: dict, target: Any, micro_batches: int, device: torch.device, *, first: bool,
               last: bool, dim: int = 0) -> tuple[list | None, list | None, int | None, int | None]:
    """A training step's arguments split where this rank reads them: the first stage's inputs and keyword arguments,
    the last stage's targets (a tuple: several); and the batch size of each (None where not read)."""
    split_inputs = split_targets = batch = target_batch = None
    if first:
        if not inputs and not kwargs:
            raise ValueError("step: the first stage needs the batch inputs")
        split_inputs, batch = _split_sized(Batch(inputs, kwargs), micro_batches, "", device, dim)
    if last:
        if target is None:
            raise ValueError("step: the last stage needs target=")
        targets = target if isinstance(target, tuple) else (target,)
        split_targets, target_batch = _split_sized(targets, micro_batches, "target", device, dim)
    return split_inputs, split_targets, batch, target_batch


def _split_sized(batch: Any, micro_batches: int, what: str, device: torch.device,
                 dim: int) -> tuple[list, int | None]:
    """A training batch's micro-batches and its batch size: at once for plain tensors, else through ``split``."""
    plain = _split_plain(batch, micro_batches, device, dim)
    if plain is not None:
        return plain
    size = batch_size(batch, what, dim)
    return split(batch, micro_batches, what, device, dim=dim), size


def _split_plain(batch: Any, micro_batches: int, device: torch.device, dim: int) -> tuple[list, int] | None:
    """``split`` of the usual training batch, a ``Batch`` of tensor arguments or a tuple of tensor targets, without
    pytree passes (under half its time); None for anything else (other leaves, nesting, 0-d tensors, sizes that
    differ or do not divide), which ``split`` handles or names in its error."""
    parts = _plain_parts(batch)
    if parts is None:
        return None
    positional, keyword, tensors = parts
    if any(tensor.dim() <= dim for tensor in tensors):
        return None
    size = tensors[0].shape[dim]
    if size % micro_batches or any(tensor.shape[dim] != size for tensor in tensors):
        return None
    if device is not None:
        tensors = [tensor.to(device, non_blocking=True) for tensor in tensors]
    chunked = zip(*(tensor.tensor_split(micro_batches, dim=dim) for tensor in tensors))
    if keyword is None:
        return list(chunked), size
    count, keys = len(positional), list(keyword)
    return [Batch(chunks[:count], dict(zip(keys, chunks[count:]))) for chunks in chunked], size


def _plain_parts(batch: Any) -> tuple[tuple, dict | None, list[torch.Tensor]] | None:
    """The usual training batch taken apart without a pytree pass: a ``Batch`` of tensor arguments (its positional
    ones, its keyword ones, all its tensors) or a tuple of tensor targets (keyword None); None for anything else."""
    if type(batch) is Batch:
        positional, keyword = batch.inputs, batch.kwargs
        if type(positional) is not tuple or type(keyword) is not dict:
            return None
        tensors = [*positional, *keyword.values()]
    elif type(batch) is tuple:
        positional, keyword, tensors = batch, None, list(batch)
    else:
        return None
    if not tensors or any(type(tensor) is not torch.Tensor for tensor in tensors):
        return None
    return positional, keyword, tensors


def any_requires_grad(batch: Any) -> bool:
    """Whether a tensor of ``batch`` requires grad: at once for plain tensor arguments or targets, else by pytree."""
    parts = _plain_parts(batch)
    tensors = parts[2] if parts is not None else boundary.flatten(batch).tensors
    return any(tensor.requires_grad for tensor in tensors)


def batch_size(batch: Any, what: str, dim: int = 0) -> int | None:
    """The size along ``dim`` that every tensor leaf of ``batch`` shares (None without tensors); a ValueError if they
    differ."""
    size = first = None
    for tensor in boundary.flatten(batch).tensors:
        if tensor.dim() == 0:
            raise ValueError(f"{_name(batch, tensor, what)} is a 0-d tensor; micro-batches are split along dim {dim} "
                             "(a Python number, such as int(tensor), goes to every micro-batch as it is)")
        if tensor.dim() <= dim:
            raise ValueError(f"{_name(batch, tensor, what)} has {tensor.dim()} dimensions; micro-batches are split "
                             f"along dim {dim} (the Pipeline's batch_dim) of every tensor of the batch")
        if size is None:
            size, first = tensor.shape[dim], tensor
        elif tensor.shape[dim] != size:
            raise ValueError(f"{_name(batch, tensor, what)} has batch size {tensor.shape[dim]} but "
                             f"{_name(batch, first, what)} has {size}; every tensor of a batch is split into "
                             f"micro-batches along dim {dim}, so their sizes there must agree")
    return size


def check_received_batch(micro_batches: int, expected: int | None, rank: int) -> None:
    """The first stage's split of the batch, as a message carries it, against this rank's schedule."""
    if micro_batches != expected:
        raise ValueError(f"the first stage split the batch into {micro_batches} micro-batches but the Pipeline on "
                         f"rank {rank} has micro_batches={expected}")


def check_target_batch(batch_size: int | None, target_batch: int | None) -> None:
    """The last stage's targets against the inputs' batch size: another size would broadcast silently in many losses."""
    if None not in (batch_size, target_batch) and batch_size != target_batch:
        raise ValueError(f"step: target has batch size {target_batch} but the inputs have {batch_size}")


def join(outputs: Sequence[Any], dim: int = 0, batch_size: int | None = None) -> Any:
    """The micro-batches' output structures as one: tensor leaves concatenated along ``dim``, 0-d ones stacked.

    Non-tensor leaves must be equal across micro-batches, and so must the structures. Given the whole ``batch_size``
    (split as ``split`` splits it), a tensor leaf whose size along ``dim`` is not its micro-batch's (a model's own
    statistic, a codebook's norms) is taken once where it is the same in every micro-batch, as ``model(x)`` returns it,
    and refused otherwise, rather than concatenated into a size that depends on the micro-batch count.
    """
    flats = [boundary.flatten(output) for output in outputs]
    layout = flats[0].layout
    for micro_batch, flat in enumerate(flats[1:], start=1):
        mismatch = boundary.layout_mismatch(flat.layout, layout)
        if mismatch:
            raise ValueError(f"the output of micro-batch {micro_batch} does not match micro-batch 0's, so the "
                             f"micro-batches cannot be joined: {mismatch}")
    sizes = None
    if batch_size is not None:
        whole, extra = divmod(batch_size, len(outputs))
        sizes = [whole + 1] * extra + [whole] * (len(outputs) - extra)
    tensors = []
    for index, parts in enumerate(zip(*(flat.tensors for flat in flats))):
        along = dim if parts[0].dim() > dim else 0
        if not parts[0].dim():
            tensors.append(torch.stack(parts))
        elif sizes is None or [part.shape[along] for part in parts] == sizes:
            others = {part.shape[:along] + part.shape[along + 1:] for part in parts}
            if len(others) > 1:
                raise ValueError(f"forward: output tensor {index} has shapes {[tuple(part.shape) for part in parts]} in "
                                 f"the micro-batches of sizes {sizes or [part.shape[along] for part in parts]}: more "
                                 "than its batch dimension follows the micro-batch's size, as a matrix over a batch's "
                                 "samples does (a contrastive model's logits), which the micro-batches compute apart "
                                 "and cannot be joined into the whole batch's; compute it from per-sample outputs")
            tensors.append(torch.cat(parts, dim=along))
        elif all(torch.equal(part, parts[0]) for part in parts[1:]):
            tensors.append(parts[0])
        else:
            raise ValueError(f"forward: output tensor {index} has sizes {[part.shape[along] for part in parts]} along "
                             f"dim {along} in the micro-batches of sizes {sizes}, and differs between them: it is no "
                             "batch to concatenate, nor one value to return once")
    return boundary.unflatten(tensors, layout)


def _name(batch: Any, tensor: torch.Tensor, what: str) -> str:
    """``what`` and the key path of a tensor leaf of ``batch``, e.g. target[0] or (for a ``Batch``) kwargs['attention_mask']."""
    path = next(path for path, leaf in pytree.tree_flatten_with_path(batch)[0] if leaf is tensor)
    return (what + pytree.keystr(path)).lstrip(".")


class Batch(NamedTuple):
    """The first stage's arguments: named so that errors say ``inputs[0]`` or ``kwargs['mask']``."""

    inputs: tuple
    kwargs: dict
