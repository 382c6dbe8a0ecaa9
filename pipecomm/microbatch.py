"""Splitting a batch into micro-batches along dim 0, and joining outputs back, with clear errors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["join", "split"]


def split(values: Sequence, micro_batches: int, what: str, device: torch.device | None = None) -> list[tuple]:
    """Splits every tensor in ``values`` into ``micro_batches`` equal chunks along dim 0.

    Non-tensor values (and None) are passed unchanged to every micro-batch. The batch size must be
    divisible by ``micro_batches``: an uneven split would weight micro-batches differently in the
    mean loss, so it is a ValueError rather than a silent difference from single-process training.
    """
    chunks_per_value = []
    for index, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            chunks_per_value.append([value] * micro_batches)
            continue
        if value.dim() == 0:
            raise ValueError(f"{what}[{index}] is a 0-d tensor; micro-batches are split along dim 0")
        batch = value.shape[0]
        if batch % micro_batches:
            raise ValueError(
                f"{what}[{index}] has batch size {batch}, which is not divisible by micro_batches={micro_batches}"
            )
        if device is not None:
            value = value.to(device, non_blocking=True)
        chunks_per_value.append(list(value.chunk(micro_batches, dim=0)))
    return [tuple(chunks[index] for chunks in chunks_per_value) for index in range(micro_batches)]


def join(outputs: Sequence[tuple]) -> tuple:
    """Concatenates per-micro-batch output tuples along dim 0 (None entries stay None)."""
    return tuple(
        None if parts[0] is None else torch.cat(parts, dim=0) for parts in zip(*outputs)
    )
