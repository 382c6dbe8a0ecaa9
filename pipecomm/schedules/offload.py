"""Activation offload planned from the schedule: which micro-batches' saved activations go to host memory while they
wait, when each comes back, and the peak activation memory that leaves.

A rank's micro-batch waits, between its forward and the backward that reads its activations, for as long as the
schedule says: in 1F1B the first stage's oldest waits about 2(p - 1) passes; in a zero-bubble schedule the inputs of
the W pass wait again between I and W. A copy engine can move them to host memory meanwhile and another bring them
back, without slowing the compute, when the wait holds both copies. The plan takes the simulated timeline of the
schedule, keeps the waits that hold both copies (each direction one copy at a time, as one copy engine runs them)
and, of those, the ones the rank's peak needs away, starts each copy back as late as it can and still be done when
the pass that reads it starts, and gives the runtime the action before which to start it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipecomm.schedules.kinds import Kind
from pipecomm.schedules.schedule import Action, Schedule

__all__ = ["OffloadPlan", "check_plan", "plan_offload"]

# What waits: (stage, micro-batch, the pass that saved it): "F" the forward's saved activations, read by B or I; "I"
# the W pass's inputs, kept from the I pass.
Wait = tuple[int, int, str]


@dataclass(frozen=True)
class OffloadPlan:
    """Per rank: the waits (``Wait``) that go to host memory when the pass that saved them ends; for each, the index in
    the rank's actions before which its copy back starts; and the peak activation memory with and without offload,
    in units of one rank's share of the model (as ``simulate``'s ``peak_memory``)."""

    offloaded: tuple[frozenset[Wait], ...]
    reload_before: tuple[Mapping[Wait, int], ...]
    peak_memory: tuple[float, ...]
    peak_memory_without: tuple[float, ...]

    def reloads_at(self, rank: int) -> dict[int, list[Wait]]:
        """Action index -> the waits whose copy back starts right before that action, on ``rank``."""
        starts: dict[int, list[Wait]] = {}
        for wait, index in sorted(self.reload_before[rank].items(), key=lambda item: item[1]):
            starts.setdefault(index, []).append(wait)
        return starts


def plan_offload(schedule: Schedule, timeline: tuple[tuple[tuple[float, float, Action], ...], ...],
                 offload_time: float, reload_time: float) -> OffloadPlan:
    """The plan for ``schedule`` whose compute ran as ``timeline`` (``simulate(...).timeline``: per rank, (start, end,
    action) of each compute pass), where copying one micro-batch's activations of one rank's share of the model to
    host memory takes ``offload_time`` and back ``reload_time`` (on a schedule with v stages per rank, a stage's
    share holds 1/v of that and copies in 1/v of the time). The W pass's inputs count as a whole share here, as the
    memory model holds a micro-batch's share until its W."""
    if offload_time < 0 or reload_time < 0:
        raise ValueError(f"plan_offload: copy times must be >= 0, got offload_time={offload_time}, "
                         f"reload_time={reload_time}")
    share = 1.0 / schedule.stages_per_rank
    offloaded, reload_before, peaks, peaks_without = [], [], [], []
    for rank, passes in enumerate(timeline):
        held, waits = _held_and_waits(passes)
        chosen = _lowering_the_peak(held, share, _fit_copies(waits, offload_time * share, reload_time * share))
        offloaded.append(frozenset(chosen))
        positions = {action: index for index, action in enumerate(schedule.actions[rank])}
        reload_before.append({wait: _index_before(positions, passes, reload_start)
                              for wait, (_, reload_start) in chosen.items()})
        peaks.append(_peak(held, share, chosen.values()))
        peaks_without.append(_peak(held, share, ()))
    return OffloadPlan(tuple(offloaded), tuple(reload_before), tuple(peaks), tuple(peaks_without))


@dataclass(frozen=True)
class _Span:
    start: float  # when what waits is complete: the end of the pass that saved it
    end: float  # when the pass that reads it starts


def _held_and_waits(passes: tuple[tuple[float, float, Action], ...]) -> tuple[list[tuple[float, float]], dict[Wait, _Span]]:
    """Each micro-batch's share on the device from its forward's start to its last backward pass's end, and its
    waits: from F's end to the start of B or I, and from I's end to W's start."""
    found: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
    for start, end, action in passes:
        found.setdefault((action.stage, action.micro_batch), {})[action.kind] = (start, end)
    held, waits = [], {}
    for (stage, micro_batch), spans in found.items():
        backward = spans.get(Kind.B) or spans.get(Kind.I)
        if Kind.F not in spans or backward is None:
            continue
        held.append((spans[Kind.F][0], (spans.get(Kind.W) or backward)[1]))
        waits[(stage, micro_batch, "F")] = _Span(spans[Kind.F][1], backward[0])
        if Kind.I in spans and Kind.W in spans:
            waits[(stage, micro_batch, "I")] = _Span(spans[Kind.I][1], spans[Kind.W][0])
    return held, waits


def _fit_copies(waits: dict[Wait, _Span], offload_time: float, reload_time: float) -> dict[Wait, tuple[float, float]]:
    """The waits that hold both copies, one copy at a time in each direction: each copy out starts when its wait does
    (or the previous copy out ends), each copy back as late as it can end by its wait's end with the later copies
    back after it. Returns each one's copy out end and copy back start."""
    offload_ends: dict[Wait, float] = {}
    engine_free = float("-inf")
    for wait in sorted(waits, key=lambda wait: waits[wait].start):
        end = max(waits[wait].start, engine_free) + offload_time
        if end + reload_time <= waits[wait].end:
            offload_ends[wait] = end
            engine_free = end
    chosen: dict[Wait, tuple[float, float]] = {}
    next_start = float("inf")
    for wait in sorted(offload_ends, key=lambda wait: waits[wait].end, reverse=True):
        start = min(waits[wait].end, next_start) - reload_time
        if start < offload_ends[wait]:
            continue  # the copies back after it leave it no room: it stays on the device
        chosen[wait] = (offload_ends[wait], start)
        next_start = start
    return chosen


def _lowering_the_peak(held: list[tuple[float, float]], share: float,
                       chosen: dict[Wait, tuple[float, float]]) -> dict[Wait, tuple[float, float]]:
    """``chosen`` without the copies the peak does not need: a copy away while the device is below its peak anyway
    frees nothing that counts and costs the link's time and the compute's interference. The shortest times away go
    first; dropping a copy only raises the memory, so one pass leaves each kept copy needed. Dropping one raises the
    memory by ``share`` while it would have been away, so it goes if the most held over that time, plus ``share``,
    stays within the peak: a range query, so that long schedules (m in the hundreds) plan in O(n log n)."""
    times = sorted({time for span in held for time in span} | {time for span in chosen.values() for time in span})
    slot = {time: index for index, time in enumerate(times)}
    levels = _levels(held, share, chosen.values(), times)
    peak = max(levels, default=0.0)
    profile = _RangeMax(levels)
    kept = dict(chosen)
    for wait in sorted(chosen, key=lambda wait: (chosen[wait][1] - chosen[wait][0], wait)):
        gone, back = slot[chosen[wait][0]], slot[chosen[wait][1]]
        if gone >= back or profile.max(gone, back) + share <= peak + 1e-9:
            del kept[wait]
            profile.add(gone, back, share)
    return kept


def _levels(held: list[tuple[float, float]], share: float, away: Iterable[tuple[float, float]],
            times: list[float]) -> list[float]:
    """The activations on the device from each of ``times`` to the next: all that ends or goes away at a time is
    counted with what starts or comes back then, so a pass that ends as another starts does not hold both."""
    change = dict.fromkeys(times, 0.0)
    for start, end in held:
        change[start] += share
        change[end] -= share
    for gone, back in away:
        change[gone] -= share
        change[back] += share
    levels, live = [], 0.0
    for time in times:
        live += change[time]
        levels.append(live)
    return levels


class _RangeMax:
    """Values under range additions and range maxima, each in O(log n): a segment tree whose nodes keep the
    largest value below them and the additions that covered them whole."""

    def __init__(self, values: list[float]):
        self._size = 1 << max(0, len(values) - 1).bit_length()  # a power of two: leaf i is node size + i
        self._max = [float("-inf")] * (2 * self._size)
        self._added = [0.0] * (2 * self._size)
        self._max[self._size:self._size + len(values)] = values
        for node in range(self._size - 1, 0, -1):
            self._max[node] = max(self._max[2 * node], self._max[2 * node + 1])

    def add(self, first: int, stop: int, amount: float) -> None:
        """Adds ``amount`` to the values at ``first`` .. ``stop - 1``."""
        self._visit(first, stop, amount, 1, 0, self._size)

    def max(self, first: int, stop: int) -> float:
        """The largest of the values at ``first`` .. ``stop - 1``."""
        return self._visit(first, stop, 0.0, 1, 0, self._size)

    def _visit(self, first: int, stop: int, amount: float, node: int, low: int, high: int) -> float:
        """Adds ``amount`` over the range within ``node`` (covering ``low`` .. ``high - 1``); returns the range's
        largest value there, the additions above ``node`` not counted."""
        if stop <= low or high <= first:
            return float("-inf")
        if first <= low and high <= stop:
            self._max[node] += amount
            self._added[node] += amount
            return self._max[node]
        middle = (low + high) // 2
        found = max(self._visit(first, stop, amount, 2 * node, low, middle),
                    self._visit(first, stop, amount, 2 * node + 1, middle, high))
        self._max[node] = max(self._max[2 * node], self._max[2 * node + 1]) + self._added[node]
        return found + self._added[node]


def _index_before(positions: Mapping[Action, int], passes: tuple[tuple[float, float, Action], ...], time: float) -> int:
    """The index (``positions``: action -> its index in the rank's actions) of the compute action running at ``time``
    (or the last to start before it): a copy started right before it starts no later than ``time``. ``passes`` run
    in order of their start."""
    started = bisect.bisect_right(passes, time, key=lambda span: span[0])
    return positions[passes[started - 1][2]] if started else 0


def _peak(held: list[tuple[float, float]], share: float, away: Iterable[tuple[float, float]]) -> float:
    """The most activations on the device at once: each micro-batch's share while ``held``, but for the times
    ``away`` (from a copy out's end to the copy back's start)."""
    away = list(away)
    times = sorted({time for span in held for time in span} | {time for span in away for time in span})
    return max(_levels(held, share, away, times), default=0.0)


def check_plan(plan: OffloadPlan, schedule: Schedule) -> None:
    """A ValueError unless ``plan`` fits ``schedule``: each rank's waits are of its own passes, and each copy back
    starts after the pass that saved the wait and by the pass that reads it."""
    if len(plan.offloaded) != schedule.num_ranks or len(plan.reload_before) != schedule.num_ranks:
        raise ValueError(f"the offload plan is for {len(plan.offloaded)} ranks, the schedule {schedule.name!r} has "
                         f"{schedule.num_ranks}")
    for rank, actions in enumerate(schedule.actions):
        positions = {(action.stage, action.micro_batch, action.kind): index for index, action in enumerate(actions)}
        for wait in plan.offloaded[rank]:
            stage, micro_batch, saved_by = wait
            readers = [positions[(stage, micro_batch, kind)] for kind in (("B", "I") if saved_by == "F" else ("W",))
                       if (stage, micro_batch, kind) in positions]
            index = plan.reload_before[rank].get(wait)
            if (stage, micro_batch, saved_by) not in positions or not readers or index is None:
                raise ValueError(f"the offload plan's wait {wait} on rank {rank} is not one of schedule "
                                 f"{schedule.name!r}'s (stage, micro-batch, F or I) on that rank, or has no copy back")
            if not positions[(stage, micro_batch, saved_by)] < index <= min(readers):
                raise ValueError(f"the offload plan starts the copy back of {wait} on rank {rank} before action "
                                 f"{index}, not after the pass that saved it and by the one that reads it")
