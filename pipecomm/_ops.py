"""Typed wrappers over the native torch.ops.pipecomm ops, and their fake kernels."""

from collections.abc import Sequence

import torch

from pipecomm import _C  # importing it registers the ops

__all__: list[str] = []

PACK_ALIGNMENT = _C.PACK_ALIGNMENT  # the native kernels' rule (csrc/pack_alignment.h), never restated here


def accumulate_(accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """In place, ``accumulators[i] += scale * grads[i]`` for whole lists, in one launch per dtype pair.

    Grads are fp32, bf16 or fp16; each accumulator is fp32 or its grad's dtype. The sum is formed
    in fp32 and rounded once.
    """
    if not accumulators and not grads:
        return  # nothing to dispatch on: the dispatcher picks a kernel from the tensors' devices
    if accumulators and accumulators[0].is_cuda and torch.cuda.is_current_stream_capturing():
        # The kernel uploads its table of pointers from pinned host memory, which a CUDA graph's replays would read
        # again after the host allocator handed it out anew: in a capture, torch's own kernels, one rounding each too.
        torch._foreach_add_(list(accumulators), list(grads), alpha=scale)
        return
    torch.ops.pipecomm.accumulate_.default(list(accumulators), list(grads), scale)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gathers tensors of any dtypes and shapes into one 1-D uint8 buffer (16-byte aligned offsets)."""
    if not tensors:
        # The dispatcher picks a kernel from the tensors' devices, so an empty list cannot reach one.
        raise ValueError("pack: needs at least one tensor")
    return torch.ops.pipecomm.pack.default(list(tensors))


def unpack_(buffer: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Scatters a buffer made by :func:`pack` into preallocated contiguous tensors."""
    torch.ops.pipecomm.unpack_.default(buffer, list(outs))


def packed_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Size of :func:`pack`'s buffer for these tensors: each one padded to 16 bytes."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def _aligned(nbytes):
    return (nbytes + PACK_ALIGNMENT - 1) // PACK_ALIGNMENT * PACK_ALIGNMENT


@torch.library.register_fake("pipecomm::accumulate_")
def _accumulate_fake(accumulators, grads, scale=1.0):
    return None


@torch.library.register_fake("pipecomm::pack")
def _pack_fake(tensors):
    return tensors[0].new_empty((packed_nbytes(tensors),), dtype=torch.uint8)


@torch.library.register_fake("pipecomm::unpack_")
def _unpack_fake(buffer, outs):
    return None
