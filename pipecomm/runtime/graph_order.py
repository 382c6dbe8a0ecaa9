"""The order a rank's CUDA graphs are captured and replayed in: each stage's passes from the schedule, and the group
of stages captured together, whose replays must keep the order their captures met the allocator in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []

_PASSES = ("F", "B", "I", "W")


def rank_passes(schedule: Schedule, rank: int) -> tuple[tuple[int, str, int], ...]:
    """The compute passes of ``rank`` in the schedule's order, as (stage, kind, micro-batch): the order its graphs
    captured together keep."""
    return tuple((action.stage, action.kind, action.micro_batch) for action in schedule.actions[rank]
                 if action.kind in _PASSES)


def stage_passes(schedule: Schedule, rank: int, stage: int) -> tuple[tuple[str, int], ...]:
    """The stage's compute passes on ``rank`` in the schedule's order, as (kind, micro-batch): what its graphs are.
    Raises where a stage's backwards are whole for some micro-batches and split for others."""
    passes = tuple((kind, micro_batch) for one, kind, micro_batch in rank_passes(schedule, rank) if one == stage)
    kinds = {kind for kind, _ in passes}
    if "B" in kinds and "I" in kinds:
        raise ValueError(f"cuda_graphs: schedule {schedule.name!r} runs stage {stage}'s backward whole for some "
                         "micro-batches and split for others, which its graphs do not follow")
    return passes


def in_flight(passes: Sequence[tuple[str, int]]) -> int:
    """The most micro-batches ``passes`` hold at once, from a forward to the last pass of its backward (B, or W)."""
    held = most = 0
    for kind, _ in passes:
        if kind in ("F", "B", "W"):
            held += 1 if kind == "F" else -1
            most = max(most, held)
    return most


class GraphGroup:
    """Stages whose graphs were captured together: one memory pool, and ``order`` (stage, kind, micro-batch), the order
    the captures met the allocator in, which their replays keep within a step across the stages."""

    def __init__(self, order: Sequence[tuple[int, str, int]]):
        self.order = tuple(order)
        self._position = {step: index for index, step in enumerate(self.order)}
        self._next = 0  # the earliest position in ``order`` the next replay may take in this step

    def new_step(self) -> None:
        """A step begins: its replays start from the first pass again."""
        self._next = 0

    def launch(self, stage: int, kind: str, micro_batch: int, graph: torch.cuda.CUDAGraph | None) -> None:
        position = self._position.get((stage, kind, micro_batch))
        if graph is None or position is None or position < self._next:
            why = ("was not captured" if graph is None or position is None else
                   "comes out of the order its graphs were captured in, and would write over memory a later pass reads")
            several = len({step[0] for step in self.order}) > 1
            order = " ".join(f"{k}{m}" + (f"(stage {s})" if several else "") for s, k, m in self.order)
            raise RuntimeError(f"cuda_graphs: stage {stage}'s {kind} pass of micro-batch {micro_batch} {why}; "
                               f"the captured order: {order}")
        self._next = position + 1
        graph.replay()
