"""The timing kernel shared by simulation's fast twin, the local search and zb-h2's generator: when each rank
finishes its array-encoded actions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipecomm.schedules.jit import compiled
from pipecomm.schedules.kinds import Kind

__all__: list[str] = []

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


def pass_orders_step_time(orders: Sequence[Sequence[tuple[str, int, int]]], num_stages: int, micro_batches: int,
                          costs: Mapping[str, float], *, jit: bool = True) -> float:
    """The step of each rank's compute passes (kind, stage, micro-batch), each with the transfers that
    ``with_communication`` places around it, which take no time: ``step_and_busy_times`` of their schedule at
    comm_time 0 with ``costs`` as each pass's own duration (not divided by the stages per rank). Unless ``jit``, the
    kernel runs interpreted: a few milliseconds for a small schedule, against numba's second to load it."""
    rows = np.array([(CODES[kind], stage, micro_batch) for order in orders for kind, stage, micro_batch in order],
                    dtype=np.int64).reshape(-1, 3)
    ends = np.cumsum([len(order) for order in orders]).astype(np.int64)
    starts = ends - np.array([len(order) for order in orders], dtype=np.int64)
    durations = np.array([float(costs.get(kind, 0.0)) for kind in Kind])
    finish = np.zeros(len(orders))
    kernel = compiled(finish_times) if jit else finish_times
    stuck_rank = kernel(rows, starts, ends, durations, 0.0, num_stages, micro_batches, True, finish)
    if stuck_rank >= 0:
        raise ValueError(f"deadlock: rank {stuck_rank} waits forever")
    return float(finish.max())


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
