"""schedule="auto": the first steps run a default schedule and time F, I and W; then every rank plans alike and switches."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Iterable

from pipecomm.schedules.schedule import Action, Schedule, looped_placement, make_schedule, v_placement

__all__ = ["starting_schedule"]

WARMUP_STEPS = 1  # not timed: allocator warm-up, lazy initialisation
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
        self.steps = 0
        self._durations: dict[tuple[str, int], list[float]] = collections.defaultdict(list)

    def add_step(self, spans: Callable[[], Iterable[tuple[float, float, Action]]]) -> bool:
        """Notes one finished step's compute (start, end, action) spans, read only after the warm-up steps (reading
        device times waits for the GPU); True once enough steps were measured."""
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return False
        for start, end, action in spans():
            self._durations[(action.kind, action.stage)].append(end - start)
        return self.steps >= WARMUP_STEPS + MEASURED_STEPS

    def costs(self) -> list[float]:
        """[F, I, W]: per kind, the sum over this rank's stages of the median pass time, in seconds."""
        return [sum(statistics.median(times) for (kind, _), times in self._durations.items() if kind == wanted)
                for wanted in ("F", "I", "W")]
