"""pytest-benchmark: the schedule simulator in Python (schedule.simulate) against its numba twin, zb-v at p = 8, m = 64;
and plan_schedule at p = 8, m = 16 and 32."""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from pipecomm.fast_simulation import encode, step_and_busy_times
from pipecomm.planner import plan_schedule
from pipecomm.schedule import make_schedule, simulate

COSTS = {"F": 2.95, "I": 4.85, "W": 2.25}
SCHEDULE = make_schedule("zb-v", num_ranks=8, micro_batches=64)  # v = 2


def test_python_simulator(benchmark: BenchmarkFixture) -> None:
    result = benchmark.pedantic(simulate, args=(SCHEDULE, COSTS), rounds=5, iterations=1)
    benchmark.extra_info["step_time"] = result.step_time


def test_numba_simulator(benchmark: BenchmarkFixture) -> None:
    encoded = encode(SCHEDULE)
    step_and_busy_times(encoded, COSTS)  # compiles (or loads numba's cache) before timing
    step_time, _ = benchmark.pedantic(step_and_busy_times, args=(encoded, COSTS), rounds=200, iterations=1)
    benchmark.extra_info["step_time"] = step_time


@pytest.mark.parametrize("micro_batches", [16, 32])
def test_plan_schedule(benchmark: BenchmarkFixture, micro_batches: int) -> None:
    plan_schedule(2, 4, COSTS)  # compiles (or loads numba's cache) before timing
    plan = benchmark.pedantic(plan_schedule, args=(8, micro_batches, COSTS), rounds=3, iterations=1)
    benchmark.extra_info["name"] = plan.name
