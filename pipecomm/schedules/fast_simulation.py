"""Step time and busy time of a schedule, numba-jitted over its array encoding: simulation's twin where sends never block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from pipecomm.schedules.jit import compiled
from pipecomm.schedules.schedule import COMPUTE_KINDS, Kind, Schedule
from pipecomm.schedules.simulation import DEFAULT_COSTS
from pipecomm.schedules.timing import CODES, finish_times

__all__ = ["Encoded", "encode", "kind_costs", "step_and_busy_times"]


class Encoded(NamedTuple):
    """A schedule as arrays: one row (kind code, stage, micro-batch) per action, rank r's rows at offsets[r]:offsets[r + 1]."""

    actions: np.ndarray
    offsets: np.ndarray
    num_stages: int
    micro_batches: int
    stages_per_rank: int


def encode(schedule: Schedule) -> Encoded:
    # One flat list: numpy converts it twice as fast as a list of row tuples, and the planner encodes ~50 schedules.
    flat = [field for program in schedule.actions for action in program
            for field in (CODES[action.kind], action.stage, action.micro_batch)]
    offsets = np.cumsum([0] + [len(program) for program in schedule.actions]).astype(np.int64)
    return Encoded(np.array(flat, dtype=np.int64).reshape(-1, 3), offsets, schedule.num_stages, schedule.micro_batches,
                   schedule.stages_per_rank)


def step_and_busy_times(schedule: Schedule | Encoded, costs: Mapping[str, float] | None = None,
                        comm_time: float = 0.0) -> tuple[float, np.ndarray]:
    """``simulate(schedule, costs, comm_time).step_time`` and ``.busy_time`` (sends never block: buffer_slots=None).

    Same conventions as ``simulate``: costs per kind (missing kinds keep DEFAULT_COSTS) of one rank's
    share, compute divided by the stages per rank. A search that times one schedule on many costs
    passes it ``encode``d once. Raises ValueError on a deadlock.
    """
    encoded = schedule if isinstance(schedule, Encoded) else encode(schedule)
    durations = kind_costs(costs, encoded.stages_per_rank)
    num_ranks = encoded.offsets.shape[0] - 1
    finish = np.zeros(num_ranks)
    stuck_rank = compiled(finish_times)(encoded.actions, encoded.offsets[:-1], encoded.offsets[1:], durations,
                                        float(comm_time), encoded.num_stages, encoded.micro_batches, False, finish)
    if stuck_rank >= 0:
        raise ValueError(f"deadlock: rank {stuck_rank} waits forever (simulate() names the actions)")
    kinds = encoded.actions[:, 0]
    compute = np.isin(kinds, [CODES[kind] for kind in COMPUTE_KINDS])
    ranks = np.repeat(np.arange(num_ranks), np.diff(encoded.offsets))
    busy = np.bincount(ranks[compute], weights=durations[kinds[compute]], minlength=num_ranks)
    return float(finish.max()), busy


def kind_costs(costs: Mapping[str, float] | None, stages_per_rank: int) -> np.ndarray:
    """The duration of each kind code: ``costs`` over DEFAULT_COSTS, compute divided by the stages per rank."""
    table = {**DEFAULT_COSTS, **(costs or {})}
    share = 1.0 / stages_per_rank  # as simulate() scales them, so that both give the same times
    return np.array([table[kind] * (share if kind in COMPUTE_KINDS else 1.0) for kind in Kind])
