"""Step time and busy time of a schedule, numba-jitted over its array encoding, for searches that simulate thousands."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from pipecomm.schedules.jit import compiled
from pipecomm.schedules.schedule import COMMUNICATION_KINDS, COMPUTE_KINDS, Schedule
from pipecomm.schedules.simulation import DEFAULT_COSTS

__all__ = ["Encoded", "encode", "kind_costs", "step_and_busy_times"]

_KINDS = COMPUTE_KINDS + COMMUNICATION_KINDS  # codes: F B I W SEND_F RECV_F SEND_B RECV_B = 0 .. 7
_CODE = {kind: code for code, kind in enumerate(_KINDS)}


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
            for field in (_CODE[action.kind], action.stage, action.micro_batch)]
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
    finish, busy, stuck_rank = compiled(_run_python)(encoded.actions, encoded.offsets,
                                                     kind_costs(costs, encoded.stages_per_rank), float(comm_time),
                                                     encoded.num_stages, encoded.micro_batches)
    if stuck_rank >= 0:
        raise ValueError(f"deadlock: rank {stuck_rank} waits forever (simulate() names the actions)")
    return float(finish.max()), busy


def kind_costs(costs: Mapping[str, float] | None, stages_per_rank: int) -> np.ndarray:
    """The duration of each kind code: ``costs`` over DEFAULT_COSTS, compute divided by the stages per rank."""
    table = {**DEFAULT_COSTS, **(costs or {})}
    share = 1.0 / stages_per_rank  # as simulate() scales them, so that both give the same times
    return np.array([table[kind] * (share if kind in COMPUTE_KINDS else 1.0) for kind in _KINDS])


def _run_python(actions, offsets, kind_costs, comm_time, num_stages, micro_batches):
    """Every rank runs its list in order; a receive waits for its send's delivery. Without blocking sends the
    times follow from the dependencies alone, so ranks can advance in turn, each as far as it can."""
    num_ranks = offsets.shape[0] - 1
    # delivery[0, s, m]: when stage s's output of micro-batch m can be received; delivery[1, s, m]: its input grad.
    delivery = np.full((2, num_stages, micro_batches), -1.0)
    position = offsets[:-1].copy()
    clock = np.zeros(num_ranks)
    busy = np.zeros(num_ranks)
    progress = True
    while progress:
        progress = False
        for rank in range(num_ranks):
            while position[rank] < offsets[rank + 1]:
                kind, stage, micro_batch = actions[position[rank]]
                cost = kind_costs[kind]
                if kind == 4 or kind == 6:  # SEND_F, SEND_B
                    delivery[(kind - 4) // 2, stage, micro_batch] = clock[rank] + cost + comm_time
                    clock[rank] += cost
                elif kind == 5 or kind == 7:  # RECV_F from stage - 1, RECV_B from stage + 1
                    ready = delivery[0, stage - 1, micro_batch] if kind == 5 else delivery[1, stage + 1, micro_batch]
                    if ready < 0:
                        break
                    clock[rank] = max(clock[rank], ready) + cost
                else:
                    clock[rank] += cost
                    busy[rank] += cost
                position[rank] += 1
                progress = True
    for rank in range(num_ranks):
        if position[rank] < offsets[rank + 1]:
            return clock, busy, rank
    return clock, busy, -1
