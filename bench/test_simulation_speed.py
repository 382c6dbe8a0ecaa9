"""pytest-benchmark: the simulator and the list scheduler in Python against their numba twins, and plan_schedule."""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from pipecomm.schedules.fast_simulation import encode, step_and_busy_times
from pipecomm.schedules.list_scheduling import _build_orders_python, build_orders
from pipecomm.schedules.planner import plan_schedule
from pipecomm.schedules.schedule import make_schedule, v_placement
from pipecomm.schedules.simulation import simulate

COSTS = {"F": 2.95, "I": 4.85, "W": 2.25}
SCHEDULE = make_schedule("zb-v", num_ranks=8, micro_batches=64)  # v = 2
# One of the planner's list-scheduling variants at p = 8, m = 32: the V at 1f1b's memory, the planner's costs per stage.
BUILD_ARGS = (v_placement(8), 32, {kind: cost / 2 for kind, cost in COSTS.items()}, 8.0)
BUILD_VARIANT = {"weights_before_forwards": False, "deepest_gradient_first": False,
                 "first_stage_lead": None}


def test_python_simulator(benchmark: BenchmarkFixture) -> None:
    result = benchmark.pedantic(simulate, args=(SCHEDULE, COSTS), rounds=5, iterations=1)
    benchmark.extra_info["step_time"] = result.step_time


def test_numba_simulator(benchmark: BenchmarkFixture) -> None:
    encoded = encode(SCHEDULE)
    step_and_busy_times(encoded, COSTS)  # compiles (or loads numba's cache) before timing
    step_time, _ = benchmark.pedantic(step_and_busy_times, args=(encoded, COSTS), rounds=200, iterations=1)
    benchmark.extra_info["step_time"] = step_time


def test_python_list_scheduler(benchmark: BenchmarkFixture) -> None:
    orders = benchmark.pedantic(_build_orders_python, args=BUILD_ARGS, kwargs=BUILD_VARIANT, rounds=5, iterations=1)
    assert sum(map(len, orders)) == 3 * 32 * 16


def test_numba_list_scheduler(benchmark: BenchmarkFixture) -> None:
    expected = _build_orders_python(*BUILD_ARGS, **BUILD_VARIANT)
    assert build_orders(*BUILD_ARGS, **BUILD_VARIANT) == expected  # and compiles (or loads numba's cache) before timing
    orders = benchmark.pedantic(build_orders, args=BUILD_ARGS, kwargs=BUILD_VARIANT, rounds=50, iterations=1)
    assert orders == expected


@pytest.mark.parametrize("micro_batches", [16, 32])
def test_plan_schedule(benchmark: BenchmarkFixture, micro_batches: int) -> None:
    plan_schedule(2, 4, COSTS)  # compiles (or loads numba's cache) before timing
    plan = benchmark.pedantic(plan_schedule, args=(8, micro_batches, COSTS), rounds=3, iterations=1)
    benchmark.extra_info["name"] = plan.name
