"""Which collective backend carries a process group's CUDA tensors."""

from __future__ import annotations

import torch.distributed as dist

__all__: list[str] = []


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether CUDA tensors cross ``group`` (the default one if None) over NCCL: its backend is "nccl" or a
    per-device mix such as "cpu:gloo,cuda:nccl"."""
    return "nccl" in str(dist.get_backend(group))
