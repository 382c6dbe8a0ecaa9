"""Pipeline orders built by list scheduling on a timed model: a free rank runs the most urgent pass that is ready."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__: list[str] = []

Pass = tuple[str, int, int]  # (kind, stage, micro-batch); kind is F, I or W


def build_orders(placement: Sequence[int], micro_batches: int, costs: Mapping[str, float],
                 memory_cap: float, *, deepest_forward_first: bool = True,
                 weights_before_forwards: bool = False, deepest_gradient_first: bool = False,
                 first_stage_lead: Sequence[int] | None = None) -> list[list[Pass]]:
    """Each rank's order of F, I and W passes, as the zero-bubble paper's greedy scheduler builds them.

    ``placement[s]`` is the rank of stage s. Time runs on the costs (``F``, ``I``, ``W``: one pass
    of one stage, transfers free). Whenever a rank is free it runs, in this priority: the I of the
    oldest micro-batch whose output gradient has arrived (the critical path), then the F of the
    oldest ready input (of the deepest stage first, or with ``deepest_forward_first=False`` the
    shallowest) if the activation fits under ``memory_cap``, then the oldest pending W; otherwise it
    waits for the next pass to end anywhere. ``weights_before_forwards`` runs pending Ws before Fs,
    which frees memory sooner; ``deepest_gradient_first`` picks the ready I of the deepest stage before
    the oldest micro-batch. ``first_stage_lead[r]`` bounds how many micro-batches rank r's first
    stage may run ahead of its last in forwards (ranks holding several stages): memory that the first
    stage's early forwards would hold stays free for the last stage's. An activation counts 1/v on a rank holding v stages and is held from
    its F until its W.
    """
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

    # Ranks with nothing to do and no known time to look again: they wait for the next pass placed anywhere.
    waiting: set[int] = set()
    while any(remaining):
        candidates = [r for r in range(num_ranks) if remaining[r] and r not in waiting]
        if not candidates:
            raise ValueError(f"build_orders: no rank can go on: memory_cap={memory_cap:g} holds no further activation "
                             f"on ranks {sorted(waiting)} and no gradient will come")
        rank = min(candidates, key=lambda r: (free_at[r], r))
        now = free_at[rank]
        ready_grads = sorted(key for key in waiting_input_grads[rank]
                             if gradient_at.get((key[1], key[0]), float("inf")) <= now)
        if ready_grads:
            micro_batch, stage = min(ready_grads, key=(lambda key: (-key[1], key[0])) if deepest_gradient_first
                                     else (lambda key: (key[0], -key[1])))
            place(rank, now, "I", stage, micro_batch)
            continue
        if weights_before_forwards and pending_weights[rank]:
            place(rank, now, "W", *pending_weights[rank][0])
            continue
        direction = -1 if deepest_forward_first else 1
        ready_inputs = [(next_forward[stage], direction * stage) for stage in held[rank]
                        if next_forward[stage] < micro_batches and not leads_too_far(rank, stage)
                        and input_at.get((stage, next_forward[stage]), float("inf")) <= now
                        and memory[rank] + share[stage] <= memory_cap + 1e-9]
        if ready_inputs:
            micro_batch, signed_stage = min(ready_inputs)
            place(rank, now, "F", direction * signed_stage, micro_batch)
            continue
        if pending_weights[rank]:
            place(rank, now, "W", *pending_weights[rank][0])
            continue
        later = [free_at[r] for r in range(num_ranks) if free_at[r] > now]
        later += [t for t in (*input_at.values(), *gradient_at.values()) if t > now]
        if later:
            free_at[rank] = min(later)
        else:
            waiting.add(rank)
    return orders
