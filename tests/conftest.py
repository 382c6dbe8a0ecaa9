"""Shared pytest fixtures: a cpu/cuda `device` twin for every test, per-test RNG seeding, the `cuda` mark."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ranks import NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON, needs_cuda


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", metavar="I/N", default=None,
                     help="run every N-th collected test from the I-th on (1-based): N such runs side by side run the "
                          "suite once")
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's duration (setup, call and teardown, in seconds) to PATH as JSON")


# Each test's duration on CI's machine, which --shard balances by (scripts/run_tests.py --record-durations rewrites it).
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every CUDA twin `cuda`, so a GPU machine runs exactly them with `pytest -m cuda`; keeps one shard."""
    for item in items:
        if any(mark.name == "skipif" and mark.kwargs.get("reason") in (NEEDS_CUDA_REASON, NEEDS_TWO_GPUS_REASON) for mark in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)
    if config.getoption("--shard"):
        index, count = _parse_shard(config.getoption("--shard"))
        durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        shards = balanced_shards([item.nodeid for item in items], count, durations)
        mine = set(shards[index - 1])
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in mine])
        items[:] = [item for item in items if item.nodeid in mine]


def balanced_shards(tests: list[str], count: int, durations: dict[str, float]) -> list[list[str]]:
    """``tests`` in ``count`` shards of about equal time: the longest first, each to the shard with the least so far
    (a test not in ``durations`` counts as their median; without durations, as equal, which deals them round robin)."""
    known = sorted(durations.values())
    default = known[len(known) // 2] if known else 1.0
    totals = [0.0] * count
    shards: list[list[str]] = [[] for _ in range(count)]
    for test in sorted(tests, key=lambda test: -durations.get(test, default)):  # stable: ties keep collection order
        shard = totals.index(min(totals))
        shards[shard].append(test)
        totals[shard] += durations.get(test, default)
    return shards


class _DurationRecorder:
    def __init__(self, path: str):
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        Path(self.path).write_text(json.dumps(self.seconds))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-durations"):
        config.pluginmanager.register(_DurationRecorder(config.getoption("--record-durations")))
    if config.getoption("--shard"):
        # Shards side by side share the cores: what a shard computes in its own process (a bench script's main(), a
        # reference model) on more threads than its share had OpenMP's threads waiting for each other's time slices
        # (recompute_memory's smoke, 2 cores, beside 2 busy processes: 40 s on 2 threads, 8 s on 1). Ranks run on 1.
        _, count = _parse_shard(config.getoption("--shard"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // count))


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
