"""What a rank's graphed stages share: the accumulators their backwards add into, and their captures, made together.

Two stages on one rank (zb-v's, an interleaved schedule's) hold their activations on one device: eager, what one frees
the other reuses, and the rank's peak is what both hold at its worst moment. Captured apart, each stage's graphs would
get a pool of their own, sized at that stage's own peak, and the pools would add up. So the stages that are to be
captured wait for one another: each keeps a micro-batch to capture on (from the step it was watched in, or its first
forward), and the first forward of a step that finds every waiting stage with one captures them all, in the order the
rank runs their passes, into one pool (``GraphedStage.capture``). A stage waiting runs eagerly, and so does the rest of
its step: a capture must not meet the autograd graphs of eager micro-batches in flight, whose parameters' gradient
accumulation autograd would run on the stream they ran on, outside the capture's.
"""

from __future__ import annotations

from pipecomm.runtime import boundary
from pipecomm.runtime.cuda_graphs import GraphedStage
from pipecomm.runtime.graph_order import rank_passes
from pipecomm.runtime.graph_gradients import GradientAccumulators
from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []

Sample = tuple[boundary.Flat, boundary.Flat]  # a micro-batch's inputs and targets, taken apart


class RankGraphs:
    """A rank's gradient accumulators and the graphed stages waiting to be captured, with their micro-batches."""

    def __init__(self, schedule: Schedule, rank: int):
        self.rank = rank
        self.accumulators = GradientAccumulators()  # what the rank's graphed backwards add into
        self.order = rank_passes(schedule, rank)
        self._waiting: dict[int, GraphedStage] = {}  # by stage
        self._samples: dict[int, Sample] = {}  # by stage, of waiting ones
        self._failed: dict[int, tuple[GraphedStage, BaseException]] = {}  # by stage: a capture that failed, and why
        self._waited_in_step = False  # a waiting stage ran a forward eagerly in this step

    def new_step(self) -> None:
        """A step begins: nothing ran eagerly in it yet."""
        self._waited_in_step = False

    def adopt(self, schedule: Schedule) -> None:
        """Captures from now on follow ``schedule``'s order (its stages' runners drop their graphs)."""
        self.order = rank_passes(schedule, self.rank)

    def join(self, graphed: GraphedStage, sample: Sample | None = None) -> None:
        """``graphed`` waits to be captured, on ``sample`` (copies) if given, else on its first forward's."""
        self._waiting[graphed.stage] = graphed
        if sample is not None:
            self._samples[graphed.stage] = sample

    def leave(self, graphed: GraphedStage) -> Sample | None:
        """``graphed`` is let go: it waits no more, and its failure is forgotten; returns the micro-batch it kept to
        capture on, if any."""
        sample = None
        if self._waiting.get(graphed.stage) is graphed:
            del self._waiting[graphed.stage]
            sample = self._samples.pop(graphed.stage, None)
        if self._failed.get(graphed.stage, (None,))[0] is graphed:
            del self._failed[graphed.stage]
        return sample

    def ready(self, graphed: GraphedStage, inputs: boundary.Flat, targets: boundary.Flat, held: bool) -> bool:
        """Whether ``graphed`` (joined) has its graphs, at a forward of its stage on ``inputs`` and ``targets``: if
        every other waiting stage has a micro-batch, none ran eagerly in this step and the captures are not ``held``
        (a step measured for the schedule), all are captured now; if not, a copy of this one is kept for a later step,
        and the forward runs eagerly. Raises a failed capture's error, at this forward and at the first of each other
        stage captured with it."""
        if graphed.captured:
            return True
        stage = graphed.stage
        failed = self._failed.get(stage)
        if failed is not None and failed[0] is graphed:
            raise failed[1]
        self._waiting.setdefault(stage, graphed)
        if held or self._waited_in_step or any(other not in self._samples for other in self._waiting if other != stage):
            self._samples.setdefault(stage, sample_of(inputs, targets))
            self._waited_in_step = True
            return False
        samples = {**self._samples, stage: self._samples.get(stage, (inputs, targets))}
        members = [self._waiting[one] for one in sorted(self._waiting)]
        self._waiting.clear()
        self._samples.clear()
        try:
            type(graphed).capture(members, samples, self.order)
        except BaseException as error:
            for member in members:
                self._failed[member.stage] = (member, error)
            raise
        return True


def sample_of(inputs: boundary.Flat, targets: boundary.Flat) -> Sample:
    """A micro-batch kept to capture on: copies (a received buffer may be reused by then), without autograd history
    but requiring grad where the tensors do, which the graphs' signature holds."""
    return tuple(boundary.detached_copy(flat, keep_requires_grad=True) for flat in (inputs, targets))
