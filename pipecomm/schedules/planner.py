"""The fastest schedule under a memory limit: named and list-scheduled candidates, the fastest then locally searched."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

from pipecomm.schedules.fast_simulation import step_and_busy_times
from pipecomm.schedules.list_scheduling import PASS_KINDS, build_orders, v_first_stage_lead
from pipecomm.schedules.local_search import search_order
from pipecomm.schedules.schedule import (
    Action,
    Schedule,
    looped_placement,
    make_schedule,
    v_placement,
    with_communication,
)
from pipecomm.schedules.simulation import peak_memory, simulate
from pipecomm.schedules.validation import validate

__all__ = ["plan_schedule"]


def plan_schedule(num_ranks: int, micro_batches: int, costs: Mapping[str, float], *,
                  memory_limit: float = 1.0, placement: Sequence[int] | None = None,
                  offload_times: tuple[float, float] | None = None) -> Schedule:
    """The schedule with the shortest simulated step among those whose peak activation memory fits.

    ``costs`` gives F, I and W (B, if given, is ignored: it is I + W) of one micro-batch through one
    rank's share of the model, as ``simulate`` takes them. ``memory_limit`` is the fullest rank's
    peak activation memory in units of 1f1b's (which holds num_ranks micro-batches of a stage).
    Candidates: every named schedule that fits, and list-scheduled orders (one stage per rank and the
    V placement; weights as fillers or before forwards;
    the oldest micro-batch's or the deepest stage's gradient first; memory caps from the limit down to
    1f1b's), each simulated on ``costs``. The fastest is then improved by a local search that moves
    single passes within each rank's order (B split into I then W) while the memory fits (skipped
    without numba). ``placement`` (stage -> rank) keeps only schedules that place the stages so, as a
    Pipeline's modules already are. The result is validated and never slower than a named schedule
    that fits (and places alike). With ``offload_times`` (the copy of one micro-batch's activations of one
    rank's share to host memory and back, in the units of ``costs``), a schedule also fits if activation
    offload (``plan_offload`` on its simulated timeline) brings its peak within the limit; such a one is
    returned as built, without the local search, whose moves count memory without offload.
    """
    if num_ranks < 1 or micro_batches < num_ranks:
        raise ValueError(f"plan_schedule: needs num_ranks >= 1 and micro_batches >= num_ranks, got num_ranks="
                         f"{num_ranks}, micro_batches={micro_batches}")
    missing = [kind for kind in PASS_KINDS if kind not in costs]
    if missing or any(costs[kind] < 0 for kind in PASS_KINDS):
        raise ValueError(f"plan_schedule: costs needs F, I and W, each >= 0; got {dict(costs)}")
    if memory_limit < 1.0:
        raise ValueError(f"plan_schedule: memory_limit is in units of 1f1b's peak and must be >= 1, got {memory_limit}")
    pass_costs = {kind: float(costs[kind]) for kind in PASS_KINDS}
    simulation_costs = {**pass_costs, "B": pass_costs["I"] + pass_costs["W"]}
    timed = []
    wanted = None if placement is None else tuple(placement)
    limit = memory_limit * num_ranks + 1e-9
    candidates = _candidates(num_ranks, micro_batches, pass_costs, memory_limit, wanted, offload_times is not None)
    for index, schedule in enumerate(candidates):
        if wanted is not None and schedule.placement != wanted:
            continue
        fits = max(peak_memory(schedule)) <= limit
        if not fits and offload_times is None:
            continue
        timed.append((step_and_busy_times(schedule, simulation_costs)[0], index, fits, schedule))
    # The fastest that the runtime can run: validate() also checks the channels' slots, which the timing ignores.
    # Ties keep the earlier candidate: named schedules come first.
    for step_time, _, fits, schedule in sorted(timed, key=lambda entry: (round(entry[0], 9), entry[1])):
        if not fits:  # offload_times given: simulated (slowly) only for those faster than every fitting one so far
            if max(simulate(schedule, simulation_costs, offload_times=offload_times).peak_memory_offloaded) > limit:
                continue
        try:
            validate(schedule)
        except ValueError:
            continue
        return search_order(schedule, step_time, pass_costs, memory_limit) if fits else schedule
    raise ValueError(f"plan_schedule: no schedule that places stages as {list(wanted or [])} on {num_ranks} ranks "
                     f"fits memory_limit={memory_limit:g}")


def _candidates(num_ranks: int, micro_batches: int, costs: Mapping[str, float], memory_limit: float,
                placement: tuple[int, ...] | None, offload: bool) -> Iterator[Schedule]:
    """The named schedules, and list-scheduled ones built only where they place stages as ``placement`` (any, if None);
    with ``offload``, also those that hold up to zb-h2's memory (twice 1f1b's) before offload."""
    for name in ("1f1b", "zb-h1", "gpipe", "zb-h2", "zb-v"):
        yield make_schedule(name, num_ranks, micro_batches)
    if micro_batches % num_ranks == 0:
        yield make_schedule("interleaved-1f1b", num_ranks, micro_batches, 2)
    families = {"zb-h2": (looped_placement(num_ranks, num_ranks), 1), "zb-v": (v_placement(num_ranks), 2)}
    families = {family: built for family, built in families.items() if placement in (None, built[0])}
    caps = sorted({memory_limit * num_ranks, float(num_ranks), *([2.0 * num_ranks] if offload else [])}, reverse=True)
    variants = [dict(weights_before_forwards=weights_first, deepest_gradient_first=deepest_gradient)
                for weights_first, deepest_gradient in itertools.product((False, True), (False, True))]
    for (family, (layout, chunks)), cap, variant in itertools.product(families.items(), caps, variants):
        yield from _built(family, layout, chunks, micro_batches, costs, cap, **variant)
    if "zb-v" not in families:
        return
    # The V's first stages, held back by each lead the family allows.
    for base, slope, deepest_gradient in itertools.product(range(1, num_ranks + 2), (1, 2), (False, True)):
        lead = v_first_stage_lead(num_ranks, base, slope)
        yield from _built("zb-v", families["zb-v"][0], 2, micro_batches, costs, float(num_ranks),
                          deepest_gradient_first=deepest_gradient, first_stage_lead=lead)


def _built(family: str, placement: tuple[int, ...], chunks: int, micro_batches: int, costs: Mapping[str, float],
           cap: float, **variant) -> Iterator[Schedule]:
    """The list-scheduled schedule of one variant, if the memory cap lets it finish."""
    try:
        orders = build_orders(placement, micro_batches, {kind: cost / chunks for kind, cost in costs.items()}, cap,
                              **variant)
    except ValueError:
        return  # this cap holds too little for this placement
    actions = tuple(with_communication([Action(*compute) for compute in order], len(placement)) for order in orders)
    yield Schedule(f"planned ({family}-like)", max(placement) + 1, len(placement), micro_batches, actions, placement)
