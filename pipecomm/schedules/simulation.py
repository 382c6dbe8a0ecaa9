"""Timing a schedule, the reference: every rank's actions run event by event under the runtime's blocking rules."""

from __future__ import annotations

import collections
import heapq
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pipecomm.schedules.offload import plan_offload
from pipecomm.schedules.schedule import CHANNEL_NAMES, Action, Kind, Schedule, channel_kind, counterpart
from pipecomm.schedules.structure import check_structure

__all__ = ["DEFAULT_COSTS", "SimulationResult", "peak_memory", "simulate"]


DEFAULT_COSTS: Mapping[str, float] = types.MappingProxyType(
    {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "SEND_F": 0.0, "RECV_F": 0.0, "SEND_B": 0.0, "RECV_B": 0.0}
)


@dataclass(frozen=True)
class SimulationResult:
    """Timing of one training step. Only compute (F, B, I, W) counts as busy; waiting and transfers are bubble."""

    step_time: float
    bubble_fraction: float  # 1 - total compute time / (num_ranks * step_time)
    busy_time: tuple[float, ...]  # per rank
    # Per rank, the most (stage, micro-batch) pairs whose F has run and whose B (or W) has not.
    peak_activations: tuple[int, ...]
    # The same in units of one rank's share of the model (a 1f1b stage's activations of one micro-batch): a
    # pair counts 1/v on a schedule with v stages per rank. 1f1b's rank 0 peaks at num_ranks.
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]  # per rank: (start, end, action) of compute
    # With offload_times: per rank, the peak_memory left by the activation offload plan_offload makes for this timeline.
    peak_memory_offloaded: tuple[float, ...] | None = None


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | Callable[[Action], float] | None = None,
    comm_time: float = 0.0,
    *,
    buffer_slots: int | None = None,
    offload_times: tuple[float, float] | None = None,
) -> SimulationResult:
    """Runs the schedule event by event, with the blocking rules of ``validate``.

    ``costs`` maps an action kind to its duration (kinds left out keep ``DEFAULT_COSTS``: F=1, B=2,
    I=1, W=1, transfers 0) or is a function of the whole action, called for transfers too. A compute
    cost is that of one rank's share of the model (what a 1f1b stage computes): on a schedule with v
    stages per rank each pass takes 1/v of it, so that every schedule of one model compares. A message
    can be received ``comm_time`` after its SEND completes. ``buffer_slots=None`` never blocks a SEND.
    With ``offload_times`` (copying one micro-batch's activations of one rank's share to host memory and back),
    the result also gives each rank's peak with activation offload (``plan_offload``'s plan for this timeline).
    Raises ValueError for a malformed schedule and for a deadlock, as ``validate`` does.
    """
    if comm_time < 0:
        raise ValueError(f"simulate: comm_time must be >= 0, got {comm_time}")
    if buffer_slots is not None and buffer_slots < 1:
        raise ValueError(f"simulate: buffer_slots must be >= 1 or None, got {buffer_slots}")
    check_structure(schedule)
    duration = _duration_function(costs)
    share = 1.0 / schedule.stages_per_rank

    def scaled(action: Action) -> float:
        return duration(action) * share if action.is_compute else duration(action)

    timeline, finish_times = execute(schedule, scaled, comm_time, buffer_slots)
    step_time = max(finish_times)
    busy_time = tuple(sum(end - start for start, end, _ in rank_timeline) for rank_timeline in timeline)
    # A schedule of zero-cost actions takes no time and so wastes none.
    bubble_fraction = 1.0 - sum(busy_time) / (schedule.num_ranks * step_time) if step_time > 0 else 0.0
    peaks = tuple(_peak_activations(program) for program in schedule.actions)
    compute = tuple(tuple(rank_timeline) for rank_timeline in timeline)
    offloaded = plan_offload(schedule, compute, *offload_times).peak_memory if offload_times is not None else None
    return SimulationResult(
        step_time=step_time,
        bubble_fraction=bubble_fraction,
        busy_time=busy_time,
        peak_activations=peaks,
        peak_memory=peak_memory(schedule),
        timeline=compute,
        peak_memory_offloaded=offloaded,
    )


def peak_memory(schedule: Schedule) -> tuple[float, ...]:
    """Per rank, the most activations held at once, in units of one rank's share of the model (1f1b's rank 0: num_ranks)."""
    return tuple(_peak_activations(program) / schedule.stages_per_rank for program in schedule.actions)


def _duration_function(costs: Mapping[str, float] | Callable[[Action], float] | None) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS)
    if costs is not None:
        unknown = sorted(set(costs) - set(table))
        if unknown:
            known = ", ".join(table)
            raise ValueError(f"simulate: unknown action kinds in costs: {', '.join(unknown)}; known: {known}")
        table.update(costs)
    return lambda action: table[action.kind]


def execute(
    schedule: Schedule,
    duration: Callable[[Action], float],
    comm_time: float,
    buffer_slots: int | None,
) -> tuple[list[list[tuple[float, float, Action]]], list[float]]:
    """Runs every rank's list in order, in global time order; returns the compute timeline and each rank's finish.

    A message occupies a slot of its channel from the start of its SEND until its RECV completes.
    """
    programs = schedule.actions
    num_ranks = schedule.num_ranks

    def peer_rank(transfer: Action) -> int:
        return schedule.stage_rank(counterpart(transfer).stage)

    next_index = [0] * num_ranks
    running: list[Action | None] = [None] * num_ranks
    finish_times = [0.0] * num_ranks
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(num_ranks)]
    deliveries: dict[Action, float] = {}  # SEND -> when its message can be received
    # (source, target, "act" or "grad"): the runtime opens an activation and a gradient channel per pair of ranks.
    messages_in_channel: collections.Counter[tuple[int, int, str]] = collections.Counter()
    blocked_senders: dict[tuple[int, int, str], int] = {}  # channel -> the rank waiting for a free slot
    blocked_receivers: dict[Action, int] = {}  # SEND not yet run -> the rank waiting for its message

    # Ties in time go to the earlier-scheduled event, so runs are deterministic.
    tie_breaker = itertools.count()
    events = [(0.0, next(tie_breaker), rank) for rank in range(num_ranks)]

    def wake(rank: int, time: float) -> None:
        heapq.heappush(events, (time, next(tie_breaker), rank))

    while events:
        now, _, rank = heapq.heappop(events)
        completed, running[rank] = running[rank], None
        if completed is not None:
            finish_times[rank] = now
            if completed.kind.startswith("RECV"):
                channel = (peer_rank(completed), rank, channel_kind(completed))
                messages_in_channel[channel] -= 1
                if channel in blocked_senders:
                    wake(blocked_senders.pop(channel), now)
        if next_index[rank] == len(programs[rank]):
            continue
        action = programs[rank][next_index[rank]]
        cost = duration(action)
        if cost < 0:
            raise ValueError(f"simulate: the cost of {action} is negative: {cost}")
        if action.kind.startswith("SEND"):
            channel = (rank, peer_rank(action), channel_kind(action))
            # A rank's messages to itself (adjacent stages it holds) wait in an unbounded loopback queue.
            if buffer_slots is not None and channel[1] != rank and messages_in_channel[channel] >= buffer_slots:
                blocked_senders[channel] = rank
                continue
            messages_in_channel[channel] += 1
            deliveries[action] = now + cost + comm_time
            if action in blocked_receivers:
                wake(blocked_receivers.pop(action), now)
            end = now + cost
        elif action.kind.startswith("RECV"):
            send = counterpart(action)
            if send not in deliveries:
                blocked_receivers[send] = rank
                continue
            end = max(now, deliveries[send]) + cost
        else:
            end = now + cost
            timeline[rank].append((now, end, action))
        next_index[rank] += 1
        running[rank] = action
        wake(rank, end)

    stuck = [rank for rank in range(num_ranks) if next_index[rank] < len(programs[rank])]
    if stuck:
        waits = []
        for rank in stuck:
            action = programs[rank][next_index[rank]]
            if action.kind.startswith("RECV"):
                waits.append(f"rank {rank} waits at {action} for {counterpart(action)} from rank {peer_rank(action)}")
            else:
                kind = channel_kind(action)
                held = messages_in_channel[(rank, peer_rank(action), kind)]
                waits.append(
                    f"rank {rank} waits at {action}: its {CHANNEL_NAMES[kind]} channel to rank {peer_rank(action)} "
                    f"holds {held} unreceived message(s)"
                )
        raise ValueError("deadlock: " + ", ".join(waits))
    return timeline, finish_times


# An activation is held from its F until the pass that last reads it: B, or W when B is split.
_ACTIVATIONS_HELD = {Kind.F: 1, Kind.B: -1, Kind.W: -1}


def _peak_activations(program: tuple[Action, ...]) -> int:
    live = peak = 0
    for action in program:
        live += _ACTIVATIONS_HELD.get(action.kind, 0)
        if live > peak:
            peak = live
    return peak
