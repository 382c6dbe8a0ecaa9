"""Pipeline orders built by list scheduling on a timed model: a free rank runs the most urgent pass that is ready."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipecomm.schedules.jit import compiled

__all__: list[str] = []

Pass = tuple[str, int, int]  # (kind, stage, micro-batch); kind is F, I or W
PASS_KINDS = ("F", "I", "W")  # and their codes in array-encoded orders: 0, 1, 2


def build_orders(placement: Sequence[int], micro_batches: int, costs: Mapping[str, float],
                 memory_cap: float, *, weights_before_forwards: bool = False, deepest_gradient_first: bool = False,
                 first_stage_lead: Sequence[int] | None = None, weights_yield_in_cool_down: bool = False,
                 jit: bool = True) -> list[list[Pass]]:
    """Each rank's order of F, I and W passes, as the zero-bubble paper's greedy scheduler builds them.

    ``placement[s]`` is the rank of stage s. Time runs on the costs (``F``, ``I``, ``W``: one pass
    of one stage, transfers free). Whenever a rank is free it runs, in this priority: the I of the
    oldest micro-batch whose output gradient has arrived (the critical path), then the F of the
    oldest ready input (on a rank of several stages, the deepest's: a shallower one is always further
    ahead) if the activation fits under ``memory_cap``, then the oldest pending W; otherwise it
    waits for the next pass to end anywhere. ``weights_before_forwards`` runs pending Ws before Fs,
    which frees memory sooner; ``deepest_gradient_first`` picks the ready I of the deepest stage before
    the oldest micro-batch. ``first_stage_lead[r]`` bounds how many micro-batches rank r's first
    stage may run ahead of its last in forwards (ranks holding several stages): memory that the first
    stage's early forwards would hold stays free for the last stage's. ``weights_yield_in_cool_down``: once a rank
    has run all its forwards, it starts a W only if no input gradient that one of its Is will pass on (stage > 0)
    arrives before the W would end; else it waits for that gradient. The greedy W would delay the I, and in the
    cool-down such delays add up along the last micro-batch's chain of Is down to rank 0, which ends the step; but
    holding Ws back can leave a rank idle that had them to run, so neither rule wins everywhere. An activation counts
    1/v on a rank holding v stages and is held from its F until its W. Runs numba-jitted where numba is installed,
    unless ``jit`` is False (a single small build: numba's first use in a process costs about a second).
    """
    build = compiled(_build_arrays) if jit else _build_arrays
    if build is _build_arrays:  # in Python the dictionaries' version is the faster
        return _build_orders_python(placement, micro_batches, costs, memory_cap, weights_before_forwards,
                                    deepest_gradient_first, first_stage_lead, weights_yield_in_cool_down)
    num_ranks = max(placement) + 1
    leads = np.zeros(num_ranks, dtype=np.int64) if first_stage_lead is None else np.array(first_stage_lead, np.int64)
    order, lengths, stuck = build(np.array(placement, dtype=np.int64), micro_batches,
                                  np.array([costs[kind] for kind in PASS_KINDS], dtype=np.float64), float(memory_cap),
                                  weights_before_forwards, deepest_gradient_first, first_stage_lead is not None, leads,
                                  weights_yield_in_cool_down)
    if stuck.any():
        raise _stuck(memory_cap, [rank for rank in range(num_ranks) if stuck[rank]])
    return [[(PASS_KINDS[kind], stage, micro_batch) for kind, stage, micro_batch in rows[:length]]
            for rows, length in zip(order.tolist(), lengths.tolist())]


def v_first_stage_lead(num_ranks: int, base: int, slope: int = 1) -> list[int]:
    """``first_stage_lead`` for the V: rank r's stage r may lead its stage 2p - 1 - r by base + slope (p - 1 - r)
    micro-batches, so that its memory is there when the far side of the V sends their inputs back."""
    return [base + slope * (num_ranks - 1 - rank) for rank in range(num_ranks)]


def _stuck(memory_cap: float, ranks: list[int]) -> ValueError:
    return ValueError(f"build_orders: no rank can go on: memory_cap={memory_cap:g} holds no further activation "
                      f"on ranks {ranks} and no gradient will come")


def _build_orders_python(placement: Sequence[int], micro_batches: int, costs: Mapping[str, float], memory_cap: float,
                         weights_before_forwards: bool, deepest_gradient_first: bool,
                         first_stage_lead: Sequence[int] | None, weights_yield_in_cool_down: bool = False
                         ) -> list[list[Pass]]:
    """``build_orders`` on dictionaries and lists: the reference that ``_build_arrays`` follows step by step."""
    num_stages = len(placement)
    num_ranks = max(placement) + 1
    held = [[stage for stage in range(num_stages) if placement[stage] == rank] for rank in range(num_ranks)]
    share = [1.0 / len(held[placement[stage]]) for stage in range(num_stages)]
    # When each (stage, micro-batch)'s input and output gradient are there; set as the passes that make them are placed.
    input_at: dict[tuple[int, int], float] = {(0, micro_batch): 0.0 for micro_batch in range(micro_batches)}
    gradient_at: dict[tuple[int, int], float] = {}
    next_forward = [0] * num_stages  # each stage forwards its micro-batches in order
    waiting_input_grads: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]  # (micro-batch, stage), F done
    pending_weights: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    memory = [0.0] * num_ranks
    free_at = [0.0] * num_ranks
    orders: list[list[Pass]] = [[] for _ in range(num_ranks)]
    remaining = [3 * micro_batches * len(stages) for stages in held]

    def place(rank: int, now: float, kind: str, stage: int, micro_batch: int) -> None:
        waiting.clear()
        end = now + costs[kind]
        orders[rank].append((kind, stage, micro_batch))
        free_at[rank] = end
        remaining[rank] -= 1
        if kind == "F":
            memory[rank] += share[stage]
            next_forward[stage] += 1
            waiting_input_grads[rank].append((micro_batch, stage))
            if stage + 1 < num_stages:
                input_at[(stage + 1, micro_batch)] = end
            else:
                gradient_at[(stage, micro_batch)] = end
        elif kind == "I":
            waiting_input_grads[rank].remove((micro_batch, stage))
            pending_weights[rank].append((stage, micro_batch))
            if stage > 0:
                gradient_at[(stage - 1, micro_batch)] = end
        else:
            pending_weights[rank].remove((stage, micro_batch))
            memory[rank] -= share[stage]

    def leads_too_far(rank: int, stage: int) -> bool:
        first, last = held[rank][0], held[rank][-1]
        return (first_stage_lead is not None and stage == first != last
                and next_forward[first] - next_forward[last] >= first_stage_lead[rank])

    def gradient_due(rank: int, until: float) -> bool:
        """Whether the rank has run all its forwards and an input gradient that an I passes on arrives before until."""
        if any(next_forward[stage] < micro_batches for stage in held[rank]):
            return False
        return any(stage > 0 and gradient_at.get((stage, micro_batch), float("inf")) < until - 1e-9
                   for micro_batch, stage in waiting_input_grads[rank])

    # Ranks with nothing to do and no known time to look again: they wait for the next pass placed anywhere.
    waiting: set[int] = set()
    while any(remaining):
        candidates = [r for r in range(num_ranks) if remaining[r] and r not in waiting]
        if not candidates:
            raise _stuck(memory_cap, sorted(waiting))
        rank = min(candidates, key=lambda r: (free_at[r], r))
        now = free_at[rank]
        ready_grads = sorted(key for key in waiting_input_grads[rank]
                             if gradient_at.get((key[1], key[0]), float("inf")) <= now)
        if ready_grads:
            micro_batch, stage = min(ready_grads, key=(lambda key: (-key[1], key[0])) if deepest_gradient_first
                                     else (lambda key: (key[0], -key[1])))
            place(rank, now, "I", stage, micro_batch)
            continue
        # A W that would keep an arriving gradient's I waiting (weights_yield_in_cool_down) waits itself.
        weight_ready = bool(pending_weights[rank]) and not (weights_yield_in_cool_down
                                                            and gradient_due(rank, now + costs["W"]))
        if weights_before_forwards and weight_ready:
            place(rank, now, "W", *pending_weights[rank][0])
            continue
        ready_inputs = [(next_forward[stage], stage) for stage in held[rank]
                        if next_forward[stage] < micro_batches and not leads_too_far(rank, stage)
                        and input_at.get((stage, next_forward[stage]), float("inf")) <= now
                        and memory[rank] + share[stage] <= memory_cap + 1e-9]
        if ready_inputs:
            micro_batch, stage = min(ready_inputs)
            place(rank, now, "F", stage, micro_batch)
            continue
        if weight_ready:
            place(rank, now, "W", *pending_weights[rank][0])
            continue
        later = [free_at[r] for r in range(num_ranks) if free_at[r] > now]
        later += [t for t in (*input_at.values(), *gradient_at.values()) if t > now]
        if later:
            free_at[rank] = min(later)
        else:
            waiting.add(rank)
    return orders


def _build_arrays(placement, micro_batches, costs, memory_cap, weights_before_forwards, deepest_gradient_first,
                  bounded_lead, leads, weights_yield_in_cool_down):
    """``_build_orders_python`` over arrays, for numba: the same choices in the same order, ties broken alike.

    ``costs`` is indexed by kind code, ``leads`` holds ``first_stage_lead`` if ``bounded_lead``. Returns each rank's
    passes as rows (kind code, stage, micro-batch), their counts, and the ranks left waiting if no rank can go on
    (all False once every pass is placed).
    """
    num_stages = placement.shape[0]
    num_ranks = placement.max() + 1
    held_count = np.zeros(num_ranks, dtype=np.int64)
    for stage in range(num_stages):
        held_count[placement[stage]] += 1
    held = np.zeros((num_ranks, held_count.max()), dtype=np.int64)  # each rank's stages, shallowest first
    filled = np.zeros(num_ranks, dtype=np.int64)
    for stage in range(num_stages):
        rank = placement[stage]
        held[rank, filled[rank]] = stage
        filled[rank] += 1
    share = np.empty(num_stages)
    for stage in range(num_stages):
        share[stage] = 1.0 / held_count[placement[stage]]
    # Unset times are infinite, as the reference's missing keys: never ready, never a time to look again.
    input_at = np.full((num_stages, micro_batches), np.inf)
    input_at[0, :] = 0.0
    gradient_at = np.full((num_stages, micro_batches), np.inf)
    next_forward = np.zeros(num_stages, dtype=np.int64)
    forwarded = np.zeros((num_stages, micro_batches), dtype=np.bool_)  # F placed and I not yet
    # Each rank's pending Ws in the order their Is were placed: the reference always takes the oldest.
    pending = np.zeros((num_ranks, held.shape[1] * micro_batches, 2), dtype=np.int64)
    pending_head = np.zeros(num_ranks, dtype=np.int64)
    pending_tail = np.zeros(num_ranks, dtype=np.int64)
    memory = np.zeros(num_ranks)
    free_at = np.zeros(num_ranks)
    order = np.zeros((num_ranks, 3 * micro_batches * held.shape[1], 3), dtype=np.int64)
    lengths = np.zeros(num_ranks, dtype=np.int64)
    remaining = 3 * micro_batches * held_count
    waiting = np.zeros(num_ranks, dtype=np.bool_)

    def place(rank, now, kind, stage, micro_batch):
        waiting[:] = False
        end = now + costs[kind]
        order[rank, lengths[rank], 0] = kind
        order[rank, lengths[rank], 1] = stage
        order[rank, lengths[rank], 2] = micro_batch
        lengths[rank] += 1
        free_at[rank] = end
        remaining[rank] -= 1
        if kind == 0:
            memory[rank] += share[stage]
            next_forward[stage] += 1
            forwarded[stage, micro_batch] = True
            if stage + 1 < num_stages:
                input_at[stage + 1, micro_batch] = end
            else:
                gradient_at[stage, micro_batch] = end
        elif kind == 1:
            forwarded[stage, micro_batch] = False
            pending[rank, pending_tail[rank], 0] = stage
            pending[rank, pending_tail[rank], 1] = micro_batch
            pending_tail[rank] += 1
            if stage > 0:
                gradient_at[stage - 1, micro_batch] = end
        else:
            pending_head[rank] += 1
            memory[rank] -= share[stage]

    while remaining.sum() > 0:
        rank = -1
        for other in range(num_ranks):
            if remaining[other] > 0 and not waiting[other] and (rank < 0 or free_at[other] < free_at[rank]):
                rank = other
        if rank < 0:
            return order, lengths, waiting
        now = free_at[rank]
        count = held_count[rank]
        grad_stage = -1
        grad_micro_batch = -1
        for index in range(count):
            stage = held[rank, index]
            for micro_batch in range(micro_batches):
                if not forwarded[stage, micro_batch] or gradient_at[stage, micro_batch] > now:
                    continue
                if grad_stage < 0:
                    better = True
                elif deepest_gradient_first:
                    better = stage > grad_stage or (stage == grad_stage and micro_batch < grad_micro_batch)
                else:
                    better = micro_batch < grad_micro_batch or (micro_batch == grad_micro_batch and stage > grad_stage)
                if better:
                    grad_stage = stage
                    grad_micro_batch = micro_batch
        if grad_stage >= 0:
            place(rank, now, 1, grad_stage, grad_micro_batch)
            continue
        has_weight = pending_head[rank] < pending_tail[rank]
        if has_weight and weights_yield_in_cool_down:
            cooling = True
            for index in range(count):
                if next_forward[held[rank, index]] < micro_batches:
                    cooling = False
            if cooling:  # a W that would keep an arriving gradient's I waiting waits itself
                for index in range(count):
                    stage = held[rank, index]
                    for micro_batch in range(micro_batches):
                        if (stage > 0 and forwarded[stage, micro_batch]
                                and gradient_at[stage, micro_batch] < now + costs[2] - 1e-9):
                            has_weight = False
        if weights_before_forwards and has_weight:
            place(rank, now, 2, pending[rank, pending_head[rank], 0], pending[rank, pending_head[rank], 1])
            continue
        first = held[rank, 0]
        last = held[rank, count - 1]
        forward_stage = -1
        for index in range(count):
            stage = held[rank, index]
            micro_batch = next_forward[stage]
            if micro_batch >= micro_batches or input_at[stage, micro_batch] > now:
                continue
            if bounded_lead and stage == first and first != last and (
                    next_forward[first] - next_forward[last] >= leads[rank]):
                continue
            if memory[rank] + share[stage] > memory_cap + 1e-9:
                continue
            if forward_stage < 0 or micro_batch < next_forward[forward_stage]:
                forward_stage = stage
        if forward_stage >= 0:
            place(rank, now, 0, forward_stage, next_forward[forward_stage])
            continue
        if has_weight:
            place(rank, now, 2, pending[rank, pending_head[rank], 0], pending[rank, pending_head[rank], 1])
            continue
        later = np.inf
        for other in range(num_ranks):
            if now < free_at[other] and free_at[other] < later:
                later = free_at[other]
        for stage in range(num_stages):
            for micro_batch in range(micro_batches):
                if now < input_at[stage, micro_batch] and input_at[stage, micro_batch] < later:
                    later = input_at[stage, micro_batch]
                if now < gradient_at[stage, micro_batch] and gradient_at[stage, micro_batch] < later:
                    later = gradient_at[stage, micro_batch]
        if later < np.inf:
            free_at[rank] = later
        else:
            waiting[rank] = True
    return order, lengths, waiting
