"""Step time and busy time of a schedule, numba-jitted over its array encoding: simulation's twin where sends never block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from pipecomm.schedules.jit import compiled
from pipecomm.schedules.schedule import COMPUTE_KINDS, Kind, Schedule
from pipecomm.schedules.simulation import DEFAULT_COSTS

__all__ = ["Encoded", "encode", "kind_costs", "step_and_busy_times"]

# The encoding's kind codes: each kind's place in Kind, as plain ints, which numba compiles in as constants.
CODES = {kind: code for code, kind in enumerate(Kind)}
F_CODE = CODES[Kind.F]
B_CODE = CODES[Kind.B]
I_CODE = CODES[Kind.I]
W_CODE = CODES[Kind.W]
SEND_F_CODE = CODES[Kind.SEND_F]
RECV_F_CODE = CODES[Kind.RECV_F]
SEND_B_CODE = CODES[Kind.SEND_B]
RECV_B_CODE = CODES[Kind.RECV_B]


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


def finish_times(actions, starts, ends, durations, comm_time, num_stages, micro_batches, passes_only, finish):
    """Writes when each rank finishes to ``finish``; returns a rank that waits forever (a deadlock), or -1.

    Rank r runs its rows ``actions[starts[r]:ends[r]]`` (kind code, stage, micro-batch) in order, each taking
    ``durations[kind]``; a receive waits for its send's delivery, ``comm_time`` after the send. Without blocking sends
    the times follow from the dependencies alone, so ranks can advance in turn, each as far as it can: what
    ``simulation.execute`` finds event by event with ``buffer_slots=None``. ``passes_only`` rows are compute passes
    whose transfers are those ``with_communication`` places around each, taking none of the rank's time.
    """
    num_ranks = starts.shape[0]
    last_stage = num_stages - 1
    # delivery[0, s, m]: when stage s's output of micro-batch m can be received; delivery[1, s, m]: its input grad.
    delivery = np.full((2, num_stages, micro_batches), -1.0)
    position = starts.copy()
    finish[:] = 0.0
    progress = True
    while progress:
        progress = False
        for rank in range(num_ranks):
            while position[rank] < ends[rank]:
                kind, stage, micro_batch = actions[position[rank]]
                forward = kind == F_CODE or kind == RECV_F_CODE or kind == SEND_F_CODE
                if passes_only:
                    # An F receives its input and sends its output, an I or B the gradients, but at the pipeline's ends.
                    transfers = kind == F_CODE or kind == B_CODE or kind == I_CODE
                    receives = transfers and stage != (0 if forward else last_stage)
                    sends = transfers and stage != (last_stage if forward else 0)
                else:
                    receives = kind == RECV_F_CODE or kind == RECV_B_CODE
                    sends = kind == SEND_F_CODE or kind == SEND_B_CODE
                if receives:
                    ready = delivery[0, stage - 1, micro_batch] if forward else delivery[1, stage + 1, micro_batch]
                    if ready < 0:
                        break
                    finish[rank] = max(finish[rank], ready)
                finish[rank] += durations[kind]
                if sends:
                    delivery[0 if forward else 1, stage, micro_batch] = finish[rank] + comm_time
                position[rank] += 1
                progress = True
    for rank in range(num_ranks):
        if position[rank] < ends[rank]:
            return rank
    return -1
