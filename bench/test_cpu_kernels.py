"""pytest-benchmark microbenchmarks of pipecomm's CPU kernels against their plain-PyTorch peers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pytest_benchmark.fixture import BenchmarkFixture
import torch

import pipecomm

ACCUMULATE_TENSORS = 100
ACCUMULATE_TOTAL_NUMEL = 8 * 2**20
PACK_TOTAL_BYTES = 8 * 2**20
PACK_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32]

# A fixed number of short rounds keeps each benchmark well under a couple of seconds on 2 cores.
ROUNDS = 10


def accumulate_lists(grad_dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """~100 fp32 accumulators of uneven sizes totalling ~8M elements, as in a model's parameter list."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(ACCUMULATE_TENSORS, generator=generator) + 0.05
    sizes = (weights / weights.sum() * ACCUMULATE_TOTAL_NUMEL).long().clamp(min=1).tolist()
    accumulators = [torch.randn(size, generator=generator) for size in sizes]
    grads = [torch.randn(size, generator=generator).to(grad_dtype) for size in sizes]
    return accumulators, grads


def pack_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for index, dtype in enumerate(PACK_DTYPES):
        element_size = torch.empty((), dtype=dtype).element_size()
        numel = PACK_TOTAL_BYTES // len(PACK_DTYPES) // element_size - (2 * index + 1)
        tensors.append(torch.randint(0, 2, (numel,), generator=generator).to(dtype))
    return tensors


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def run(benchmark: BenchmarkFixture, fn: Callable[[], object]) -> None:
    benchmark.pedantic(fn, rounds=ROUNDS, iterations=1, warmup_rounds=1)


GRAD_DTYPES = {"bf16->fp32": torch.bfloat16, "fp32->fp32": torch.float32}


@pytest.mark.parametrize("dtype_case", list(GRAD_DTYPES))
@pytest.mark.parametrize("method", ["pipecomm", "foreach"])
def test_accumulate(benchmark: BenchmarkFixture, method: str, dtype_case: str) -> None:
    accumulators, grads = accumulate_lists(GRAD_DTYPES[dtype_case])
    scale = 1e-3  # small so the repeated rounds keep values finite
    benchmark.group = f"accumulate {dtype_case}"
    benchmark.extra_info["bytes"] = sum(a.numel() * (2 * a.element_size() + g.element_size())
                                        for a, g in zip(accumulators, grads))
    if method == "pipecomm":
        run(benchmark, lambda: pipecomm.accumulate_(accumulators, grads, scale))
    else:
        run(benchmark, lambda: torch._foreach_add_(accumulators, grads, alpha=scale))


@pytest.mark.parametrize("method", ["pipecomm", "torch"])
def test_pack(benchmark: BenchmarkFixture, method: str) -> None:
    tensors = pack_tensors()
    benchmark.group = "pack"
    benchmark.extra_info["bytes"] = 2 * sum(t.numel() * t.element_size() for t in tensors)
    if method == "pipecomm":
        run(benchmark, lambda: pipecomm.pack(tensors))
    else:
        run(benchmark, lambda: torch.cat([as_bytes(tensor) for tensor in tensors]))


@pytest.mark.parametrize("method", ["pipecomm", "torch"])
def test_unpack(benchmark: BenchmarkFixture, method: str) -> None:
    tensors = pack_tensors()
    outs = [torch.empty_like(tensor) for tensor in tensors]
    benchmark.group = "unpack"
    benchmark.extra_info["bytes"] = 2 * sum(t.numel() * t.element_size() for t in tensors)
    if method == "pipecomm":
        packed = pipecomm.pack(tensors)
        run(benchmark, lambda: pipecomm.unpack_(packed, outs))
    else:
        dense = torch.cat([as_bytes(tensor) for tensor in tensors])
        out_bytes = [as_bytes(out) for out in outs]
        spans, offset = [], 0
        for out in out_bytes:
            spans.append((offset, offset + out.numel()))
            offset += out.numel()

        def slice_and_copy() -> None:
            for out, (start, end) in zip(out_bytes, spans):
                out.copy_(dense[start:end])

        run(benchmark, slice_and_copy)
