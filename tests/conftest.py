"""Shared pytest fixtures: a cpu/cuda `device` twin for every test, per-test RNG seeding, the `cuda` mark."""

from __future__ import annotations

import pytest
import torch

from ranks import NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON, needs_cuda


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", metavar="I/N", default=None,
                     help="run every N-th collected test from the I-th on (1-based): N such runs side by side run the "
                          "suite once")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every CUDA twin `cuda`, so a GPU machine runs exactly them with `pytest -m cuda`; keeps one shard."""
    for item in items:
        if any(mark.name == "skipif" and mark.kwargs.get("reason") in (NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON) for mark in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)
    if config.getoption("--shard"):
        index, count = _parse_shard(config.getoption("--shard"))
        # Round robin, not by file: neighbouring tests cost alike, so the shards take about the same time.
        kept = items[index - 1::count]
        config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index - 1])
        items[:] = kept


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N, like 1/2, not {text!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {text}: I must be between 1 and N")
    return index, count


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)], ids=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed_rng() -> None:
    # Each test draws from a fresh, fixed stream so a failure reproduces when run alone.
    torch.manual_seed(0)
