"""A stage that replays CUDA graphs: from the first step (``cuda_graphs=True``), or, by default on GPUs, adopted where
they pay and a checked capture agrees with eager, with eager runs wherever the graphs cannot serve.

``cuda_graphs="auto"`` (the default) runs a stage eagerly while it watches the micro-batches' structure, shapes and
dtypes and times its passes (``PassTimer``). After two steps alike it captures at the third, unless the host launched a
pass in under ``_HOST_SHARE`` of its GPU span (the GPU bounds the stage: graphs would save nothing and cost their
memory pool), or unless the capture would take more than ``_MEMORY_SHARE`` of the device memory left (the pool holds
what the stage holds at its peak in a step, beside the eager warm-up's); every captured pass's first replay must equal
an eager run of the same micro-batch. The rank's stages that are to capture are captured together, into one pool
(``rank_graphs``), on a micro-batch each kept from the watched step. The step after the capture is a trial: the graphs
stay only if a replayed pass took the GPU under ``_KEEP_BELOW`` of an eager one. Then every micro-batch that fits
replays and any other (a short last batch) runs eagerly; a step that none fits, twice in a row, or a change the graphs
cannot see (``GraphedStage.changed_since_capture``) drops the graphs, and the watch starts again. A failed capture or
check, shapes that never hold still, or more captures than ``_CAPTURES`` leave the stage eager for good, with a
one-line warning saying why.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from pipecomm.runtime import boundary
from pipecomm.runtime.checks import gradient_hook
from pipecomm.runtime.cuda_graphs import GraphedStage, signature, signature_difference
from pipecomm.runtime.graph_order import in_flight, stage_passes
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.landing_loan import LandingLoan
from pipecomm.runtime.rank_graphs import RankGraphs, Sample, sample_of
from pipecomm.runtime.split_backward import WeightGradStore
from pipecomm.runtime.stage_runner import EagerStage, MicroBatch, leaves_beside_said
from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []

_STEPS_ALIKE = 2  # steps of one signature before a capture
_CAPTURES = 3  # captures a stage may make; each costs two warm-ups, the captures and the checks
_SIGNATURE_CHANGES = 3  # changes of signature while watching, before the stage gives up on graphs
_KEEP_BELOW = 0.9  # graphs stay if a replayed pass takes less than this share of an eager one on the GPU
_HOST_SHARE = 0.5  # no capture where the host launches an eager pass in less than this share of its GPU span
_MEMORY_SHARE = 0.8  # no capture that would take more than this share of the device memory left


class ShapeWatch:
    """Whether a stage's micro-batches keep one ``signature`` (structure, non-tensor leaves, each tensor's shape,
    dtype, device and requires_grad: what a capture will serve) over consecutive steps."""

    def __init__(self) -> None:
        self.steps_alike = 0
        self.changes = 0
        self._last: tuple | None = None
        self._step: tuple | None = None  # this step's signature; None before its first micro-batch
        self._mixed = False  # this step's micro-batches differ among themselves

    def see(self, args: tuple, kwargs: dict, targets: tuple, servable: bool = True) -> None:
        """A micro-batch of this step; one the graphs could not serve (``servable`` False) makes no step alike."""
        seen = signature(boundary.flatten((args, kwargs)), boundary.flatten(targets))
        if self._step is None:
            self._step = seen
        elif signature_difference(seen, self._step):
            self._mixed = True
        self._mixed |= not servable

    def step_done(self) -> None:
        step = None if self._mixed else self._step
        if step is not None and self._last is not None and not signature_difference(step, self._last):
            self.steps_alike += 1
        else:
            self.changes += self._last is not None
            self.steps_alike = 1 if step is not None else 0
        self._last, self._step, self._mixed = step, None, False


class PassTimer:
    """GPU and host time of a stage's passes over one step, from CUDA events and the host clock around each. Eager, a
    pass's GPU span is the host's launches and the kernels together; replayed, the kernels' alone: their ratio is what
    graphs save. A host done launching in well under the GPU span means the GPU bounds the stage. Also the most device
    memory a pass left allocated: a forward's saved activations and outputs, which the graphs' pool would hold."""

    def __init__(self) -> None:
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self.largest_growth = 0  # bytes

    @staticmethod
    def start() -> tuple[torch.cuda.Event, float, int]:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter(), torch.cuda.memory_allocated()

    def stop(self, started: tuple[torch.cuda.Event, float, int]) -> None:
        end, now, allocated = self.start()
        self._spans.append((started[0], end, now - started[1]))
        self.largest_growth = max(self.largest_growth, allocated - started[2])

    def per_pass_ms(self) -> tuple[float, float] | None:
        """The mean GPU span and host time of a pass, once the GPU has reached the last event; None if none ran."""
        if not self._spans:
            return None
        self._spans[-1][1].synchronize()
        count = len(self._spans)
        return (sum(begin.elapsed_time(end) for begin, end, _ in self._spans) / count,
                sum(host for _, _, host in self._spans) * 1e3 / count)


class GraphRunner(EagerStage):
    """A stage whose micro-batches replay ``GraphedStage``'s graphs where they can; it infers eagerly.

    ``automatic`` (``cuda_graphs="auto"``): graphs adopted and dropped as the module docstring says. Otherwise
    (``cuda_graphs=True``) captured at the first forward, unchecked, and any misfit or change is an error.
    """

    def __init__(self, module: nn.Module, sink: GradientSink, index: int, scaled_loss: Callable | None,
                 weight_grad_store: WeightGradStore | None, rank: int, passes: tuple, automatic: bool,
                 rank_graphs: RankGraphs):
        super().__init__(module, sink, index, scaled_loss, weight_grad_store, rank)
        self.passes = passes  # the stage's, in the schedule's order (``stage_passes``)
        self.automatic = automatic
        self.rank_graphs = rank_graphs  # what this stage's graphs share with the rank's other stages'
        self.accumulators = rank_graphs.accumulators
        self.graphed: GraphedStage | None = None if automatic else self._graphs(None)
        self.off: str | None = None  # automatic: why this stage runs eagerly for good
        self.held = False  # no capture while held (``StageExecutor.hold_graphs``)
        self._watch = ShapeWatch()
        self._timer = PassTimer()  # the passes of a watched step, or of the trial step after a capture
        self._eager_ms: float | None = None  # a watched step's GPU time per pass
        self._captured_at_start = False  # of this step: graphs captured in it make the next step a trial
        self._trial = False  # the graphs were captured in the last step: this one decides whether they stay
        self._captures = 0
        self._replayed: set[int] = set()  # this step's micro-batches that replay the graphs
        self._steps_unfit = 0  # consecutive steps none of whose micro-batches fit the graphs
        self._sample: Sample | None = None  # automatic: a copy of a watched step's first micro-batch, to capture on
        # The graphs' output and input-gradient landing buffers, sent as they are (not on the last stage, nor the
        # input gradients on the first: those are not sent).
        self._outputs_loan, self._input_grads_loan = _loans()

    def _graphs(self, sample: Sample | None) -> GraphedStage:
        """Graphs to capture, with the rank's other stages waiting (``RankGraphs``), on ``sample`` if given."""
        graphed = GraphedStage(self.module, self.sink, self.passes, self.index, self.scaled_loss,
                               self.weight_grad_store, checked=self.automatic, accumulators=self.accumulators)
        self.rank_graphs.join(graphed, sample)
        return graphed

    @property
    def state(self) -> str:
        """"replaying" (graphs captured), "to capture" (at the next forward), "watching" (eager, its shapes watched),
        or "eager: " and why, for good (the GPU bounds the stage, or graphs failed it)."""
        if self.off:
            return f"eager: {self.off}"
        if self.graphed is None:
            return "watching"
        return "replaying" if self.graphed.captured else "to capture"

    def skips_post_accumulate_hooks(self) -> str | None:
        # "auto" does not capture a stage with gradient hooks, and drops its graphs when one is added.
        return "cuda_graphs=True's replays" if not self.automatic else super().skips_post_accumulate_hooks()

    # -- adoption -------------------------------------------------------------------------------

    def adopt_schedule(self, schedule: Schedule, weight_grad_store: WeightGradStore | None) -> None:
        super().adopt_schedule(schedule, weight_grad_store)
        self.rank_graphs.adopt(schedule)
        if not self.automatic:
            # cuda_graphs=True, before its capture only: a zb-h2 or zb-v asked for by name runs its first step
            # eagerly (held), timed, and is rebuilt for the measured costs. The graphs to capture follow the new
            # order, on the micro-batch the old ones kept.
            if self.graphed.captured:
                raise RuntimeError(f"cuda_graphs=True: stage {self.index}'s schedule changed after its capture")
            self.passes = stage_passes(schedule, self.rank, self.index)
            self.graphed = self._graphs(self.rank_graphs.leave(self.graphed))
            return
        self.drop_graphs()
        try:
            self.passes = stage_passes(schedule, self.rank, self.index)
        except ValueError as error:
            self._give_up(str(error))

    def start(self, training: bool) -> None:
        super().start(training)
        self._replayed.clear()
        self._sample = None
        self._outputs_loan.new_step()
        self._input_grads_loan.new_step()
        graphed = self.graphed
        self._captured_at_start = graphed is not None and graphed.captured
        self.rank_graphs.new_step()
        if training and graphed is not None and graphed.captured:
            graphed.new_step()
            change = graphed.changed_since_capture()
            if change and not self.automatic:
                raise ValueError(f"cuda_graphs: {change}, which their replays would not see; build a new Pipeline, "
                                 'or leave cuda_graphs="auto", which captures again')
            if change:
                self.drop_graphs()
            else:
                self.accumulators.bind(graphed.accumulated)  # where zero_grad() or the caller left .grad

    def step_done(self) -> None:
        if not self.automatic or self.off:
            return
        timer, self._timer = self._timer, PassTimer()
        if self.graphed is None:
            self._watch.step_done()
            if self._watch.changes >= _SIGNATURE_CHANGES:
                self._give_up(f"its inputs' shapes changed {self._watch.changes} times from step to step, and CUDA "
                              "graphs need static ones")
            elif self._watch.steps_alike >= _STEPS_ALIKE and not self.held:
                if self._captures == _CAPTURES:
                    self._give_up(f"its graphs were captured {_CAPTURES} times and dropped again (shapes or "
                                  "parameters keep changing)")
                else:
                    self._captures += 1
                    measured = timer.per_pass_ms()
                    self._eager_ms = measured[0] if measured else None
                    reason = self._not_worth_capturing(measured, timer.largest_growth)
                    if reason:
                        self.drop_graphs()
                        self.off = reason
                    else:
                        self.graphed = self._graphs(self._sample)
        elif self.graphed.captured:
            if self._trial:
                self._trial = False
                measured = timer.per_pass_ms() if self._replayed else None
                replayed = measured[0] if measured else None
                if replayed is not None and self._eager_ms and replayed > _KEEP_BELOW * self._eager_ms:
                    self.drop_graphs()
                    self.off = (f"replaying its CUDA graphs took the GPU {replayed:.3g} ms a pass against "
                                f"{self._eager_ms:.3g} ms eager: the GPU, not the host, bounds it")  # nothing failed
                    return
            self._trial = not self._captured_at_start  # captured in this step (maybe at another stage's forward)
            self._steps_unfit = 0 if self._replayed else self._steps_unfit + 1
            if self._steps_unfit == 2:
                self.drop_graphs()

    def _not_worth_capturing(self, measured: tuple[float, float] | None, forward_growth: int) -> str | None:
        """Why a watched stage stays eager (nothing failed), or None: the GPU bounds it, a parameter has a gradient
        hook (Python a replay would not run), or its graphs would not fit. A capture takes about what the stage holds
        at its peak in a step (a forward's keep per micro-batch in flight), once more for the eager warm-up, and a set
        of gradients (twice where the backward returns them: a landing set and the check's copy)."""
        if measured and measured[1] < _HOST_SHARE * measured[0]:
            return (f"the host launches a pass in {measured[1]:.3g} ms and the GPU runs it in {measured[0]:.3g}: the "
                    "GPU bounds it, graphs would cost memory for nothing")
        hook = gradient_hook(self.module)
        if hook:
            return f"its {hook}, which a replay would not run"
        gradients = sum(p.numel() * p.element_size() for p in self.sink.params if p.requires_grad)
        held = in_flight(self.passes)
        needed = (held + 1) * forward_growth + gradients * (1 if self.sink.autograd_accumulates else 2)
        left = _free_bytes(self.sink.params)
        if needed > _MEMORY_SHARE * left:
            return (f"its CUDA graphs would need about {needed / 1e9:.3g} GB (micro-batches in flight at most: {held}) "
                    f"and the device has {left / 1e9:.3g} GB left")
        return None

    def drop_graphs(self, reclaim: bool = True) -> bool:
        """The graphs let go, and their memory with ``reclaim`` (without, the caller reclaims once for several stages:
        ``reclaim_graph_memory``); the watch starts again. Returns whether there were graphs to let go."""
        attempted = self.graphed is not None
        if attempted:
            self.rank_graphs.leave(self.graphed)
        self.graphed = None
        if attempted:
            self.accumulators.release(self.index)
            if reclaim:
                reclaim_graph_memory()
        self._steps_unfit = 0
        self._watch, self._timer, self._trial = ShapeWatch(), PassTimer(), False
        self._outputs_loan, self._input_grads_loan = _loans()  # the next graphs' buffers are new
        return attempted

    def _give_up(self, reason: str) -> None:
        self.drop_graphs()
        self.off = reason
        warnings.warn(f"pipecomm: pipeline rank {self.rank}, stage {self.index} runs eagerly from now on: {reason}",
                      stacklevel=2)

    # -- actions --------------------------------------------------------------------------------

    def forward(self, micro_batch: int, args: tuple, kwargs: dict, received: list[torch.Tensor],
                targets: tuple, callers: list[torch.Tensor]) -> torch.Tensor | None:
        if callers and not self.automatic:
            raise ValueError(f"cuda_graphs=True: stage {self.index}, micro-batch {micro_batch}: "
                             f"{len(callers)} of the caller's input or target tensors require grad, and their "
                             "gradients go on into the caller's autograd graph, which no CUDA graph reaches; pass "
                             "them without requires_grad, or use cuda_graphs='auto' (such micro-batches then run "
                             "eagerly) or False")
        graphed, timing = self.graphed, self._timing
        started = self._timer.start() if timing else None
        if graphed is None or callers:  # the caller's tensors that require grad: eagerly, as no graph reaches them
            if timing and graphed is None:  # watching
                self._watch.see(args, kwargs, targets, servable=not callers)
                if (self._sample is None and not callers and self._watch.steps_alike >= _STEPS_ALIKE - 1
                        and not self.held):
                    # A capture may follow this step: a micro-batch to capture on.
                    self._sample = sample_of(boundary.flatten((args, kwargs)), boundary.flatten(targets))
            loss = super().forward(micro_batch, args, kwargs, received, targets, callers)
            beside = len(self.record(micro_batch).callers) - len(callers)
            if beside and not self.off:
                reason = leaves_beside_said(beside)
                if not self.automatic:
                    raise ValueError(f"cuda_graphs=True: stage {self.index}: {reason}; use cuda_graphs='auto' or "
                                     "False")
                self._give_up(reason)
        else:
            loss = self._graphed_forward(graphed, micro_batch, args, kwargs, received, targets)
        if timing:
            self._timer.stop(started)
        return loss

    def _graphed_forward(self, graphed: GraphedStage, micro_batch: int, args: tuple, kwargs: dict,
                         received: list[torch.Tensor], targets: tuple) -> torch.Tensor | None:
        inputs, target_leaves = boundary.flatten((args, kwargs)), boundary.flatten(targets)
        if not graphed.captured:
            try:
                ready = self.rank_graphs.ready(graphed, inputs, target_leaves, self.held)  # captures, checks
            except Exception as error:  # noqa: BLE001 - whatever failed, the eager run below raises it if the model's
                if not self.automatic:
                    raise
                message = str(error).strip().splitlines()
                self._give_up(f"capturing its CUDA graphs failed ({type(error).__name__}: "
                              f"{message[0] if message else 'no message'})")
                return super().forward(micro_batch, args, kwargs, received, targets, [])
            if not ready:  # held, or waiting for another stage of the rank to have a micro-batch to capture on
                return super().forward(micro_batch, args, kwargs, received, targets, [])
        sent = self.scaled_loss is None  # the outputs, sent from the landing buffers; else the loss, copied
        if not self.automatic:
            self._outputs_loan.before_write()
            return self._replayed_forward(micro_batch, graphed.replay(micro_batch, inputs, target_leaves, sent))
        if graphed.mismatch(inputs, target_leaves):
            return super().forward(micro_batch, args, kwargs, received, targets, [])
        self._outputs_loan.before_write()
        return self._replayed_forward(micro_batch, graphed.replay_fitting(micro_batch, inputs, target_leaves, sent))

    def _replayed_forward(self, micro_batch: int, outputs: tuple) -> torch.Tensor | None:
        self._replayed.add(micro_batch)
        held = self.record(micro_batch)
        held.outputs = boundary.Flat(list(outputs), self.graphed.output_layout)
        if self.scaled_loss is None:
            self._outputs_loan.lend(held)
            return None
        return outputs[0].detach()

    def outputs_sent(self, micro_batch: int, read_event: Callable[[], torch.cuda.Event | None]) -> None:
        super().outputs_sent(micro_batch, read_event)
        self._outputs_loan.sent(self.micro_batches[micro_batch], read_event)

    def input_grads_sent(self, micro_batch: int, read_event: Callable[[], torch.cuda.Event | None]) -> None:
        self._input_grads_loan.sent(self.micro_batches[micro_batch], read_event)

    @property
    def _timing(self) -> bool:
        """Whether this step's passes are timed: a watched one's, or the trial's after a capture."""
        return self.automatic and not self.off and (self.graphed is None or self._trial)

    def _timed(self, run: Callable[[int], None], micro_batch: int) -> None:
        if not self._timing:
            run(micro_batch)
            return
        started = self._timer.start()
        run(micro_batch)
        self._timer.stop(started)

    def backward(self, micro_batch: int) -> None:
        self._timed(self._backward_pass, micro_batch)

    def backward_input(self, micro_batch: int) -> None:
        if micro_batch in self._replayed:
            self._timed(self._backward_pass, micro_batch)  # the micro-batch's I graph
        else:
            self._timed(super().backward_input, micro_batch)

    def backward_weight(self, micro_batch: int) -> None:
        self._timed(self._weight_pass, micro_batch)

    def _backward_pass(self, micro_batch: int) -> None:
        if micro_batch not in self._replayed:
            super().backward(micro_batch)
            return
        held = self.micro_batches[micro_batch]
        self._input_grads_loan.before_write()
        input_grads, param_grads = self.graphed.backward(micro_batch, held.output_grads)
        held.outputs = held.output_grads = None
        held.inputs = []
        if self.index > 0:
            held.input_grads = tuple(input_grads)
            self._input_grads_loan.lend(held)
        if param_grads is not None:  # else the graph added them into the accumulators
            self.sink.add(param_grads)

    def _weight_pass(self, micro_batch: int) -> None:
        if micro_batch not in self._replayed:
            super().backward_weight(micro_batch)
            return
        self.micro_batches.pop(micro_batch, None)
        weight_grads = self.graphed.backward_weights(micro_batch)
        if weight_grads is not None:
            self.sink.add(weight_grads)


def reclaim_graph_memory() -> None:
    """Dropped graphs' memory back at once: what held them may sit in reference cycles, collected now (and so not
    destroyed inside a later capture: ``graph_capture.capture_into``), and their private pool, which stays cached out
    of other allocations' reach, emptied."""
    gc.collect()
    torch.cuda.empty_cache()


def _loans() -> tuple[LandingLoan, LandingLoan]:
    """Fresh loans of a stage's output and input-gradient landing buffers."""
    return LandingLoan(_copy_outputs), LandingLoan(_copy_input_grads)


def _copy_outputs(held: MicroBatch) -> None:
    held.outputs = boundary.detached_copy(held.outputs, keep_requires_grad=True)


def _copy_input_grads(held: MicroBatch) -> None:
    held.input_grads = tuple(grad.clone() if grad is not None else None for grad in held.input_grads)


def _free_bytes(params: list[nn.Parameter]) -> float:
    """Device memory a capture could still get: the device's free memory and what the caching allocator holds
    unallocated (it releases that when an allocation would fail). Unbounded where there is nothing to measure."""
    if not params or params[0].device.type != "cuda":
        return float("inf")
    device = params[0].device
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def make_runner(module: nn.Module, sink: GradientSink, index: int, scaled_loss: Callable | None,
                weight_grad_store: WeightGradStore | None, rank: int, schedule: Schedule,
                cuda_graphs: bool | str, rank_graphs: RankGraphs) -> EagerStage:
    """The runner of one stage: eager (``cuda_graphs`` False), graphed from the first step (True: a schedule whose
    passes the graphs cannot follow is refused here, before any communication), or adopting graphs when it can
    ("auto")."""
    if cuda_graphs is False:
        return EagerStage(module, sink, index, scaled_loss, weight_grad_store, rank)
    automatic = cuda_graphs == "auto"
    try:
        passes = stage_passes(schedule, rank, index)
    except ValueError:
        if not automatic:
            raise
        return EagerStage(module, sink, index, scaled_loss, weight_grad_store, rank)
    return GraphRunner(module, sink, index, scaled_loss, weight_grad_store, rank, passes, automatic, rank_graphs)
