"""A local search over a schedule's pass orders: single passes moved within their rank's order, timed by timing's kernel."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipecomm.schedules.jit import compiled
from pipecomm.schedules.list_scheduling import PASS_KINDS
from pipecomm.schedules.schedule import Action, Kind, Schedule, with_communication
from pipecomm.schedules.timing import CODES, F_CODE, I_CODE, W_CODE, finish_times
from pipecomm.schedules.validation import validate

__all__ = ["search_order"]

# Moves tried, how far a pass moves, the start of the threshold (a share of the step) under which a worse order is
# kept, and the weight of the ranks' spread of finish times in the score. Tuned at p = 8, m = 16 and 32 on issue 18's
# costs: more moves gained < 0.1 %.
_SEARCH_MOVES = 200_000
_SEARCH_WINDOW = 16
_SEARCH_THRESHOLD = 1e-4
_SEARCH_SPREAD = 5e-3


def search_order(schedule: Schedule, step_time: float, costs: Mapping[str, float], memory_limit: float) -> Schedule:
    """``schedule``, or the faster order the local search finds from it if the runtime can run that one too."""
    search = compiled(_search_python, finish_times)
    if search is _search_python or step_time <= 0:
        return schedule  # at Python speed the search would take minutes
    order, lengths = _encode_passes(schedule)
    memory_cap = int(memory_limit * schedule.num_ranks * schedule.stages_per_rank + 1e-9)
    found = search(order, lengths, _pass_durations(costs, schedule.stages_per_rank), schedule.num_stages,
                   schedule.micro_batches, memory_cap, _SEARCH_MOVES, _SEARCH_WINDOW, _SEARCH_THRESHOLD * step_time,
                   _SEARCH_SPREAD)
    if found >= step_time - 1e-9:
        return schedule
    kinds = tuple(Kind)
    actions = tuple(with_communication([Action(kinds[kind], stage, micro_batch) for kind, stage, micro_batch
                                        in order[rank, :lengths[rank]]], schedule.num_stages)
                    for rank in range(schedule.num_ranks))
    name = schedule.name if schedule.name.startswith("planned") else f"planned ({schedule.name}-like)"
    searched = Schedule(name, schedule.num_ranks, schedule.num_stages, schedule.micro_batches, actions,
                        schedule.placement)
    try:  # the search keeps the channels' order but not their slots
        validate(searched)
    except ValueError:
        return schedule
    return searched


def _pass_durations(costs: Mapping[str, float], stages_per_rank: int) -> np.ndarray:
    """The duration of each kind code in the search: F, I and W of one stage, transfers free."""
    return np.array([costs[kind] / stages_per_rank if kind in PASS_KINDS else 0.0 for kind in Kind])


def _encode_passes(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's compute passes as rows (kind code, stage, micro-batch), a B as its I then its W; and their counts."""
    programs = [[(CODES[kind], action.stage, action.micro_batch) for action in program if action.is_compute
                 for kind in ((Kind.I, Kind.W) if action.kind == Kind.B else (action.kind,))]
                for program in schedule.actions]
    order = np.zeros((len(programs), max(len(program) for program in programs), 3), dtype=np.int64)
    for rank, program in enumerate(programs):
        order[rank, :len(program)] = program
    return order, np.array([len(program) for program in programs], dtype=np.int64)


def _search_python(order, lengths, durations, num_stages, micro_batches, memory_cap, moves, window, threshold, spread):
    """Threshold accepting over the ranks' pass orders: leaves the fastest order found in ``order``, returns its step.

    ``order[r, k]`` is rank r's k-th pass (kind code, stage, micro-batch), ``lengths[r]`` how many it has, ``durations``
    each kind code's. A move takes one pass of one rank up to ``window`` places up or down. It is kept if the
    order still runs (a same-rank pass it depends on stays before it, and the Fs and Is of a stage keep their order,
    so that every channel receives in the order it sends), the rank's activations held from F to W never exceed
    ``memory_cap``, and the score (the step, plus ``spread`` times the mean square of the ranks' finish times over
    the step, which rewards the other ranks finishing early) grows by less than ``threshold``, which shrinks to
    zero over the ``moves``. Steps are timed as ``step_and_busy_times`` times the order with its transfers, free.
    Deterministic: the moves come from a Park-Miller generator, the same in Python and numba.
    """
    num_ranks = order.shape[0]
    # The orders as finish_times reads them: rank r's rows from r * order.shape[1], a view that sees every move.
    rows = order.reshape((num_ranks * order.shape[1], 3))
    starts = np.arange(num_ranks) * order.shape[1]
    ends = starts + lengths

    def runs(clock):
        """Whether the order runs, each rank's finish written to ``clock``."""
        return finish_times(rows, starts, ends, durations, 0.0, num_stages, micro_batches, True, clock) < 0

    def score(clock):
        step = clock.max()
        return step + spread * (clock * clock).sum() / (num_ranks * step)

    def must_precede(kind, stage, later_kind, later_stage):
        """Whether a pass must stay before a later one of the same micro-batch on its rank."""
        if kind == F_CODE:
            return (later_kind == F_CODE and later_stage == stage + 1) or (later_kind == I_CODE and later_stage == stage)
        if kind == I_CODE:
            return (later_kind == I_CODE and later_stage == stage - 1) or (later_kind == W_CODE and later_stage == stage)
        return False

    def movable(rank, source, target):
        kind, stage, micro_batch = order[rank, source]
        low, high = (source + 1, target) if source < target else (target, source - 1)
        for index in range(low, high + 1):
            other_kind, other_stage, other_micro_batch = order[rank, index]
            if other_kind == kind and other_stage == stage and kind != W_CODE:
                return False
            if other_micro_batch == micro_batch and (
                    must_precede(kind, stage, other_kind, other_stage) if source < target
                    else must_precede(other_kind, other_stage, kind, stage)):
                return False
        return True

    def fits(rank):
        live = 0
        for index in range(lengths[rank]):
            if order[rank, index, 0] == F_CODE:
                live += 1
                if live > memory_cap:
                    return False
            elif order[rank, index, 0] == W_CODE:
                live -= 1
        return True

    clock = np.zeros(num_ranks)
    runs(clock)
    current = score(clock)
    best_step = clock.max()
    best = order.copy()
    saved = np.empty_like(order[0])
    state = 1
    for move in range(moves):
        state = state * 48271 % 2147483647
        rank = state % num_ranks
        state = state * 48271 % 2147483647
        source = state % lengths[rank]
        state = state * 48271 % 2147483647
        shift = state % (2 * window) - window
        target = source + shift + (1 if shift >= 0 else 0)
        if target < 0 or target >= lengths[rank] or not movable(rank, source, target):
            continue
        saved[:] = order[rank]
        if source < target:
            order[rank, source:target] = saved[source + 1:target + 1]
        else:
            order[rank, target + 1:source + 1] = saved[target:source]
        order[rank, target] = saved[source]
        if fits(rank) and runs(clock):
            candidate = score(clock)
            if candidate <= current + threshold * (1.0 - move / moves):
                current = candidate
                if clock.max() < best_step - 1e-9:
                    best_step = clock.max()
                    best[:] = order
                continue
        order[rank] = saved
    order[:] = best
    return best_step
