"""Shared pytest fixtures: a cpu/cuda `device` twin for every test, per-test RNG seeding, the `cuda` mark."""

from __future__ import annotations

import pytest
import torch

from ranks import NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON, needs_cuda


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every CUDA twin `cuda`, so a GPU machine runs exactly them with `pytest -m cuda`."""
    for item in items:
        if any(mark.name == "skipif" and mark.kwargs.get("reason") in (NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON) for mark in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)], ids=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed_rng() -> None:
    # Each test draws from a fresh, fixed stream so a failure reproduces when run alone.
    torch.manual_seed(0)
