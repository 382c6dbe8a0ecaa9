"""schedule="auto": the first steps run a default schedule and time F, I and W; every rank plans alike, tries the plan
and 1f1b for a few steps each, and keeps whichever ran fastest."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable

from pipecomm.schedules.schedule import Action, Schedule, looped_placement, make_schedule, v_placement

__all__ = ["starting_schedule"]

# Per schedule tried: steps not timed (allocator warm-up, lazy initialisation), then the timed ones.
WARMUP_STEPS = 1
MEASURED_STEPS = 2


def starting_schedule(name: str, num_ranks: int, micro_batches: int, virtual_stages: int | None = None) -> Schedule:
    """The schedule a Pipeline given ``schedule=name`` runs first, in its default placement: the named one, or for
    "auto" the zb-h1 it measures with. Its ``stages_of(rank)`` are the stages a rank builds; ``num_stages``, how many
    the model is split into."""
    return make_schedule("zb-h1" if name == "auto" else name, num_ranks, micro_batches, virtual_stages)


def initial_schedule(num_ranks: int, micro_batches: int, stages: list[int], rank: int) -> Schedule:
    """The schedule "auto" runs while it measures: zb-h1 for one stage per rank, zb-v for two in a V."""
    if len(stages) == 1:
        return starting_schedule("auto", num_ranks, micro_batches)
    if len(stages) == 2 and sorted(stages) == [stage for stage, holder in enumerate(v_placement(num_ranks))
                                               if holder == rank]:
        return make_schedule("zb-v", num_ranks, micro_batches)
    looped = [stage for stage, holder in enumerate(looped_placement(num_ranks, len(stages) * num_ranks))
              if holder == rank]
    raise ValueError(f'Pipeline: schedule="auto" plans one stage per rank, or two placed in a V (rank {rank} holds '
                     f"{rank} and {2 * num_ranks - 1 - rank}); rank {rank} got stages {sorted(stages)}"
                     + (" (the interleaved placement)" if sorted(stages) == looped else ""))


class CostMeter:
    """This rank's F, I and W for one micro-batch through its share of the model, from the measured steps."""

    def __init__(self):
        self._durations: dict[tuple[str, int], list[float]] = collections.defaultdict(list)

    def add_step(self, spans: Iterable[tuple[float, float, Action]]) -> None:
        """Notes one measured step's compute (start, end, action) spans."""
        for start, end, action in spans:
            self._durations[(action.kind, action.stage)].append(end - start)

    def costs(self) -> list[float]:
        """[F, I, W]: per kind, the sum over this rank's stages of the median pass time, in seconds."""
        return [sum(statistics.median(times) for (kind, _), times in self._durations.items() if kind == wanted)
                for wanted in ("F", "I", "W")]


class Trials:
    """The schedules "auto" runs in turn, each for WARMUP_STEPS untimed steps and MEASURED_STEPS timed ones, and the
    step times it measured on them."""

    def __init__(self, first: Schedule):
        self.schedules = [first]
        self.times: list[list[float]] = [[]]
        self.running = 0  # the index of the schedule the steps run now
        self._steps = 0  # taken on it so far

    def count_step(self) -> bool:
        """Counts a step of the running schedule; True if it is one of the timed ones."""
        self._steps += 1
        return self._steps > WARMUP_STEPS

    def record(self, seconds: float) -> bool:
        """The timed step's time; True once the running schedule has all of them."""
        self.times[self.running].append(seconds)
        return len(self.times[self.running]) == MEASURED_STEPS

    def add(self, schedule: Schedule) -> None:
        """A schedule to try later, unless one with the same actions is tried already."""
        if all(schedule.actions != tried.actions for tried in self.schedules):
            self.schedules.append(schedule)
            self.times.append([])

    def advance(self) -> Schedule | None:
        """The next schedule to run, or None once every one ran."""
        if self.running + 1 == len(self.schedules):
            return None
        self.running += 1
        self._steps = 0
        return self.schedules[self.running]

    def medians(self) -> list[float]:
        return [statistics.median(times) for times in self.times]
