"""CUDA-graph capture of a stage's passes: one graph per micro-batch and pass, replayed in the schedule's order.

A small model's stage is bound by the host launching its kernels one by one. With static shapes, each pass the stage
runs in a step (its forward, with the loss on the last stage, and its backward, or the backward's I and W parts) is
captured once per micro-batch, in the order the schedule runs them on this rank, into one memory pool, and replayed in
that order every step. Each capture meets the allocator as eager would at that point of the step, so the pool holds
what eager holds at its peak: a micro-batch's activations are freed at its backward (at its I, but for W's operands)
and later passes reuse them. A rank's stages (zb-v's two) are captured together, their passes interleaved as the rank
runs them, into one pool (``GraphedStage.capture``; ``rank_graphs`` gathers them): the pool then holds the rank's
peak, not each stage's own added up. That is also why the order is enforced (``graph_order.GraphGroup``): a replay
out of it would write over memory that a later pass reads. Skipping passes (a micro-batch run eagerly) is safe: a
skipped pass writes nothing. How one pass is captured (the pool in expandable segments, one capture stream per thread,
Python's collector paused) is ``graph_capture``'s.

Tensors cross a graph's edge through one set of landing buffers per stage (inputs, targets, outputs, output gradients,
input gradients), copied into before a replay and out of after it; inside the graph a micro-batch's inputs are copied
into the pool, where its backward finds them.

Where the parameters' gradients go to ``.grad``, the captured backward adds them in place into ``graph_gradients``'
accumulators; with ``main_grad`` buffers it writes them into landing buffers, for the caller to add.

A replay reads what the capture saw: the tensors' addresses and every Python value the forward read then. So a
capture can be checked (``checked=True``: every captured pass replayed on the capture's micro-batch against an eager
run of it, with the same random numbers and the same probe gradients), and ``changed_since_capture`` names what the
graphs can no longer see (parameters moved or frozen, modules switched between train and eval, autocast turned on or
off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.runtime import boundary
from pipecomm.runtime.capture_state import CaptureState
from pipecomm.runtime.checks import gradient_hook
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.graph_capture import ExpandableSegments, capture_into, capture_stream, forget_capture_stream
from pipecomm.runtime.graph_check import GraphCheckError, detached, largest_difference, largest_entry, off_zero, signed
from pipecomm.runtime.graph_gradients import GradientAccumulators
from pipecomm.runtime.graph_order import GraphGroup
from pipecomm.runtime.graph_random import ForwardRandomStates
from pipecomm.runtime.split_backward import DeferredGrad, Deferral, WeightGradStore, check_reported, weight_grad
from pipecomm.runtime.stage_runner import (free_data, held_only_by_themselves, leaves_beside, leaves_beside_said,
                                           run_backward)

__all__: list[str] = []

_WARMUP_ITERATIONS = 2  # eager runs on a side stream before capture, so lazy initialisation stays out of the graphs
_STATE_OF = {"F": 0, "B": 1, "I": 1, "W": 2}  # which of a reference run's random states a pass began at


@dataclass
class _Captured:
    """What a micro-batch's captured forward leaves for its backward's capture (tensors in the pool)."""

    inputs: list[torch.Tensor]  # the micro-batch's copies of the inputs, leaves
    outputs: list[torch.Tensor]
    deferrals: list[Deferral] | None
    deferred: list[DeferredGrad] = field(default_factory=list)  # I's operands for W


@dataclass
class _Reference:
    """An eager run of the capture's micro-batch, for the check: its results and the random states its passes began
    at (forward, backward or I, W)."""

    outputs: list
    input_grads: list
    param_grads: list | None  # returned ones (B or I), where there are no accumulators
    weight_grads: list | None  # returned ones of W
    largest: dict[int, torch.Tensor]  # with accumulators: each non-empty one's largest entry, by parameter id
    parts: dict[int, set[str]]  # with accumulators: which passes add into each parameter's ("input", "weight")
    states: list[torch.Tensor]


class GraphedStage:
    """A stage module whose passes replay CUDA graphs, one per micro-batch and pass of ``passes``
    (``graph_order.stage_passes``), captured at the first forward (or with the rank's other stages, ``capture``) and
    replayed in that order.

    Split backwards (I passes; the stage's Linear layers defer to ``weight_grad_store``) are captured as the eager
    executor splits them: I (input gradients and every parameter's gradient but the deferred Linear weight GEMMs') and
    W (those GEMMs, from the layer's input and output gradient that I left in the pool).

    With ``accumulators`` (used where the ``sink`` accumulates in ``.grad``), the backward graphs add the parameters'
    gradients into them; otherwise they return the gradients, for the caller to add.
    """

    def __init__(self, module: nn.Module, sink: GradientSink, passes: Sequence[tuple[str, int]], stage: int,
                 loss: Callable | None, weight_grad_store: WeightGradStore | None = None, checked: bool = False,
                 accumulators: GradientAccumulators | None = None):
        self.module = module
        self.sink = sink
        self.params = sink.params
        self.accumulators = accumulators if sink.autograd_accumulates else None
        self.accumulated: list[nn.Parameter] = []  # the parameters whose gradients the graphs add into accumulators
        self.stage = stage
        self.passes = tuple(passes)
        self.split = any(kind == "I" for kind, _ in self.passes)
        if len(set(self.passes)) < len(self.passes) or (self.split and weight_grad_store is None):
            raise ValueError(f"cuda_graphs: stage {stage}'s passes {self.passes} repeat one, or split a backward "
                             "without a weight-gradient store")
        self.loss = loss  # (output, *targets) -> scaled loss, on the last stage
        self.store = weight_grad_store if self.split else None
        self.checked = checked
        self.output_layout: boundary.Layout | None = None  # the output structure without its tensors, from the capture
        self._seen: CaptureState | None = None  # what the replays read beside their inputs, as the capture saw it
        self._signature: tuple = ()  # of the micro-batch the graphs were captured for (``signature``)
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._group: GraphGroup | None = None  # the stages captured with this one, this one included
        # Landing buffers, one set per stage.
        self._inputs: boundary.Flat | None = None
        self._targets: boundary.Flat | None = None
        self._differentiable: list[bool] = []  # per input tensor: whether its copy requires grad
        self._outputs: list[torch.Tensor] = []
        self._output_requires_grad: list[bool] = []
        self._grad_outputs: list[torch.Tensor] = []  # one per output that requires grad
        self._input_grads: list[torch.Tensor | None] = []  # per input tensor
        self._param_grads: list[torch.Tensor | None] = []  # per parameter, without accumulators
        self._returned: dict[str, list[bool]] = {}  # per backward kind: the parameters it returns gradients of
        self._random = ForwardRandomStates(None, stage)  # each capture's: none drawn before one

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def new_step(self) -> None:
        """A step begins: its replays start from the first pass again."""
        if self._group:
            self._group.new_step()

    def forward(self, micro_batch: int, args: tuple, targets: tuple, kwargs: dict | None = None) -> tuple:
        """Replays the micro-batch's forward on copies of the inputs (any pytrees); returns copies of the output's
        tensors (the 1-tuple of the loss on the last stage), requiring grad where the captured outputs do.
        ``output_layout`` makes them the output structure again. Captures at the first call."""
        return self.replay(micro_batch, boundary.flatten((args, kwargs or {})), boundary.flatten(targets))

    def replay(self, micro_batch: int, inputs: boundary.Flat, targets: boundary.Flat, landing: bool = False) -> tuple:
        """``forward`` on inputs and targets already taken apart (``replay_fitting`` says what ``landing`` does)."""
        if not self._graphs:
            type(self).capture([self], {self.stage: (inputs, targets)}, [(self.stage, *step) for step in self.passes])
        mismatch = self.mismatch(inputs, targets)
        if mismatch:
            raise ValueError(f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {mismatch}; CUDA graphs "
                             "need static shapes")
        return self.replay_fitting(micro_batch, inputs, targets, landing)

    def replay_fitting(self, micro_batch: int, inputs: boundary.Flat, targets: boundary.Flat,
                       landing: bool = False) -> tuple:
        """``replay`` of a micro-batch known to fit the captured graphs (``mismatch`` said None). With ``landing``, the
        output landing buffers themselves instead of copies, as leaves: valid until the stage's next forward replay."""
        _copy_in(self._inputs, inputs)
        _copy_in(self._targets, targets)
        self._launch("F", micro_batch)
        return tuple((t.detach() if landing else t.clone()).requires_grad_(wanted)
                     for t, wanted in zip(self._outputs, self._output_requires_grad))

    def mismatch(self, inputs: boundary.Flat, targets: boundary.Flat) -> str | None:
        """How a micro-batch's inputs or targets differ from those the graphs were captured with, or None."""
        return signature_difference(signature(inputs, targets), self._signature)

    def changed_since_capture(self) -> str | None:
        """What changed since the capture that the replays would miss (``CaptureState``), said in one line; None if
        nothing did."""
        changed = self._seen.changed() if self._seen else []
        if not changed:
            return None
        return f"stage {self.stage}'s {', '.join(changed)} changed since the CUDA graphs were captured"

    def backward(self, micro_batch: int, grads: tuple | None) -> tuple[list, list | None]:
        """Replays the micro-batch's backward (or its I) for the outputs' ``grads`` (None: the loss's own, 1); returns
        (input grads, parameter grads): the landing buffers, one entry per input tensor and per stage parameter (None
        where there is no gradient); the parameter grads are None where the graphs add them into accumulators. Valid
        until the stage's next backward replay."""
        if grads is None:
            for landing in self._grad_outputs:
                landing.fill_(1.0)
        else:
            landings = iter(self._grad_outputs)
            for wanted, grad in zip(self._output_requires_grad, grads):
                if wanted:
                    landing = next(landings)
                    landing.copy_(grad) if grad is not None else landing.zero_()
        kind = "I" if self.split else "B"
        self._launch(kind, micro_batch)
        return self._input_grads, self._returned_grads(kind)

    def backward_weights(self, micro_batch: int) -> list | None:
        """Replays the micro-batch's W (after its I): the deferred weights' gradients, one entry per stage parameter
        (None where the graphs add them into accumulators)."""
        self._launch("W", micro_batch)
        return self._returned_grads("W")

    def _launch(self, kind: str, micro_batch: int) -> None:
        self._random.replayed(kind, micro_batch, self._group.launch, self.stage, kind, micro_batch,
                              self._graphs.get((kind, micro_batch)))

    def _returned_grads(self, kind: str) -> list | None:
        if self.accumulators:
            return None
        return [grad if returned else None for grad, returned in zip(self._param_grads, self._returned[kind])]

    # -- capture -------------------------------------------------------------------------------

    def _run(self, inputs: boundary.Flat, targets: boundary.Flat, deferrals: list | None) -> list[torch.Tensor]:
        """The stage (and loss) on ``inputs``; with ``deferrals``, the Linear layers record theirs there."""
        if self.store:
            self.store.recording = deferrals
        try:
            args, kwargs = boundary.unflatten(inputs.tensors, inputs.layout)
            output = self.module(*args, **kwargs)
        finally:
            if self.store:
                self.store.recording = None
        made = boundary.flatten(output).tensors
        beside = leaves_beside(made, inputs.tensors, self.module, self.store)
        if self.loss is not None:
            output = self.loss(output, *boundary.unflatten(targets.tensors, targets.layout))
            beside += leaves_beside([output], [*made, *inputs.tensors, *targets.tensors], self.module, self.store)
        if beside:
            raise ValueError(f"cuda_graphs: stage {self.stage}: {leaves_beside_said(len(beside))}")
        flat = boundary.flatten(output)
        if self.loss is None and any(isinstance(tensor, DTensor) for tensor in flat.tensors):
            raise TypeError(f"cuda_graphs: stage {self.stage}'s output holds a DTensor, which a graph's static outputs "
                            "cannot hand over as its local shard; keep use_local_output=True in the last layer's plan")
        self.output_layout = flat.layout
        return flat.tensors

    @classmethod
    def capture(cls, members: Sequence[GraphedStage], samples: dict[int, tuple[boundary.Flat, boundary.Flat]],
                order: Sequence[tuple[int, str, int]]) -> None:
        """Captures the passes of ``members`` (stages of one rank) together, on a micro-batch each (``samples``, by
        stage: inputs and targets taken apart), in ``order`` (the rank's (stage, kind, micro-batch), the members' own
        in the order they run) into one pool: what one stage holds while another's pass runs is then the pool's, as it
        is eager's, and one stage's freed activations serve another's. Warm-up runs first, then every capture, then,
        with ``checked``, each member's replays against its last warm-up. The modules' buffers (batch norm's running
        statistics) and the device's random state are restored afterwards: these extra runs are no training step's.
        On failure the current stream is restored and no member keeps a graph. A parameter's gradient hook is refused:
        a replay would run its kernels as captured, not the hook."""
        stages = {member.stage for member in members}
        order = tuple(step for step in order if step[0] in stages)
        for member in members:
            member._prepare(*samples[member.stage])
            if [(kind, micro_batch) for stage, kind, micro_batch in order if stage == member.stage] != list(
                    member.passes):
                raise ValueError(f"cuda_graphs: stage {member.stage}'s passes {member.passes} are not those of the "
                                 "rank's order given for the capture")
        device = samples[members[0].stage][0].tensors[0].device
        autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )
        buffers = [(buffer, buffer.detach().clone()) for member in members for buffer in member.module.buffers()]
        stream, random_state = torch.cuda.current_stream(device), torch.cuda.get_rng_state(device)
        warmed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by stage, ``_warmed_shared``
        try:
            with contextlib.ExitStack() as capturing:
                for member in members:
                    if member.accumulators:
                        capturing.enter_context(member.accumulators.capturing(member.params))
                try:
                    # Warmed up on the stream the captures use, cuBLAS's workspace for it stays out of the pool.
                    side = capture_stream(device)
                    references, shared = {}, _shared(members)
                    for member in members:
                        references[member.stage] = member._warm_up(autocast, device, side, shared)
                        warmed[member.stage] = member._warmed_shared(shared)
                    for member in members:
                        member._random = ForwardRandomStates(device, member.stage)
                    cls._capture_passes(members, order, autocast, side, device)
                    for member in members:
                        member._random.check_captured()
                    for member in members:
                        if member.checked:
                            for tensor, value in warmed[member.stage]:
                                tensor.copy_(value)  # a later member's warm-up added into it too
                            member._check_replays(references[member.stage], device)
                except BaseException:
                    for member in members:
                        if member.accumulators:
                            member.accumulators.release(member.stage)
                    raise
        except BaseException:
            for member in members:
                member._graphs, member.accumulated = {}, []
            torch.cuda.set_stream(stream)  # a failed capture leaves its own stream current
            # Its capture stream is not used again: whatever broke the capture may have left it in a state of its own.
            forget_capture_stream(device)
            _release_random_state(device, random_state)
            raise
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
        torch.cuda.set_rng_state(random_state, device)
        group = GraphGroup(order)
        for member in members:
            member._group = group
            member.record_state()

    def _prepare(self, inputs: boundary.Flat, targets: boundary.Flat) -> None:
        """The landing buffers of the inputs and targets, from a micro-batch's; refuses a gradient hook."""
        hook = gradient_hook(self.module)
        if hook:
            raise ValueError(f"cuda_graphs: stage {self.stage}'s {hook}, which a replay would not run; remove it, or "
                             'leave cuda_graphs="auto", which runs such a stage eagerly')
        self._signature = signature(inputs, targets)
        self._inputs, self._targets = boundary.detached_copy(inputs), boundary.detached_copy(targets)
        self._differentiable = [self.stage > 0 and tensor.requires_grad for tensor in inputs.tensors]

    def record_state(self) -> None:
        """What ``changed_since_capture`` compares against: the stage's state now."""
        self._seen = CaptureState(self.module)

    def _leaves(self) -> list[torch.Tensor]:
        """A micro-batch's copies of the landing inputs, requiring grad where received ones do (in a capture: in the
        pool, where the micro-batch's backward reads them)."""
        return [tensor.clone().requires_grad_(wanted) for tensor, wanted in zip(self._inputs.tensors,
                                                                                self._differentiable)]

    def _warm_up(self, autocast, device, side: torch.cuda.Stream, shared: set[int]) -> _Reference | None:
        """Eager runs on a side stream, then the landing buffers shaped by them; with ``checked``, the last run's
        results (outputs, input and parameter gradients, W's) for the probe gradients, and the random states its passes
        began at. With accumulators, the first run (into empty ``.grad``s, ``shared`` parameters' too, which another
        stage's warm-up may have given one) shows which parameters get gradients, and from which pass; those get
        accumulators, zeroed before each later run."""
        if self.accumulators:
            for param in self.params:
                if id(param) in shared:
                    param.grad = None
        caller = torch.cuda.current_stream(device)
        side.wait_stream(caller)
        input_part: set[int] = set()
        with torch.cuda.stream(side), autocast:
            for iteration in range(_WARMUP_ITERATIONS):
                if self.accumulators and iteration == 1:
                    self.accumulated = self.accumulators.adopt_reached(self.stage, self.params)
                    for tensor in self.accumulators.tensors(self.accumulated):
                        # Made on this stream, used on the caller's: freed, it waits for the caller's work.
                        tensor.record_stream(caller)
                elif self.accumulators and iteration > 1:
                    self.accumulators.zero(self.accumulated)
                states = [torch.cuda.get_rng_state(device)]
                leaves = self._leaves()
                deferrals = [] if self.split else None
                outputs = self._run(boundary.Flat(leaves, self._inputs.layout), self._targets, deferrals)
                states.append(torch.cuda.get_rng_state(device))
                differentiable = [t for t in outputs if t.requires_grad]
                grads, deferred = self._input_pass(outputs, self._probe(differentiable), leaves, deferrals)
                if iteration == 0:
                    input_part = {id(p) for p in self.params if p.grad is not None}
                states.append(torch.cuda.get_rng_state(device))
                weight_grads = self._weight_pass(deferred) if self.split else None
            input_grads, param_grads = self._align(grads, leaves)
        caller.wait_stream(side)
        self._outputs = [torch.empty_like(t) for t in outputs]
        self._output_requires_grad = [t.requires_grad for t in outputs]
        self._grad_outputs = [torch.empty_like(t) for t in differentiable]
        self._input_grads = [None if grad is None else torch.empty_like(grad) for grad in input_grads]
        if not self.accumulators:
            returned = [early if early is not None else late
                        for early, late in zip(param_grads, weight_grads or [None] * len(param_grads))]
            self._param_grads = [None if grad is None else torch.empty_like(grad) for grad in returned]
        if not self.checked:
            return None
        largest, parts = {}, {}
        if self.accumulators:
            weight_part = {id(weight) for weight, _, _ in deferred}
            for param, tensor in zip(self.accumulated, self.accumulators.tensors(self.accumulated)):
                parts[id(param)] = ({"input"} if id(param) in input_part else set()) | (
                    {"weight"} if id(param) in weight_part else set())
                if tensor.numel():
                    largest[id(param)] = largest_entry(tensor)
        return _Reference(detached(outputs), detached(input_grads),
                          None if self.accumulators else detached(param_grads),
                          None if self.accumulators else detached(weight_grads or []), largest, parts, states)

    def _warmed_shared(self, shared: set[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """With ``checked`` and accumulators, each accumulator of a ``shared`` parameter and a copy of what this stage's
        warm-up left in it, which its check starts from; another stage's warm-up adds into it too."""
        if not (self.checked and self.accumulators):
            return []
        return [(tensor, tensor.clone()) for param, tensor in zip(self.accumulated,
                                                                  self.accumulators.tensors(self.accumulated))
                if id(param) in shared]

    @staticmethod
    def _capture_passes(members: Sequence[GraphedStage], order: tuple[tuple[int, str, int], ...], autocast,
                        stream: torch.cuda.Stream, device: torch.device) -> None:
        """Each pass of ``order`` captured in turn into one pool; what a pass leaves for a later one of its stage stays
        alive in ``held`` until that one's capture, and no longer, as eager would hold it."""
        pool, segments = torch.cuda.graph_pool_handle(), ExpandableSegments(device)
        by_stage = {member.stage: member for member in members}
        held: dict[int, dict[int, _Captured]] = {member.stage: {} for member in members}
        with autocast:
            for stage, kind, micro_batch in order:
                member, kept = by_stage[stage], held[stage]
                graph = torch.cuda.CUDAGraph()
                with segments:
                    capture_into(graph, member._pass(kind, micro_batch, kept), pool, stream, empty_ok=kind == "W")
                member._graphs[(kind, micro_batch)] = graph
                if kind == "F":
                    # Sent on through the landing buffers: their memory goes back to the pool, as eager frees it.
                    free_data(held_only_by_themselves(kept[micro_batch].outputs))

    def _pass(self, kind: str, micro_batch: int, held: dict[int, _Captured]) -> Callable[[], None]:
        """The pass of ``kind`` for ``micro_batch``, to capture: a forward leaves what its backward reads in ``held``,
        an I (which W reads after it) and W take it from there. Each notes whether it drew random numbers."""
        def run() -> None:
            if kind == "F":
                held[micro_batch] = self._captured_forward()
            elif kind == "W":
                self._captured_weight_pass(held.pop(micro_batch))
            else:
                self._captured_input_pass(kind, held[micro_batch] if kind == "I" else held.pop(micro_batch))
            self._random.note_capture(kind, micro_batch)
        return run

    def _captured_forward(self) -> _Captured:
        leaves = self._leaves()
        targets = boundary.detached_copy(self._targets)
        deferrals = [] if self.split else None
        outputs = self._run(boundary.Flat(leaves, self._inputs.layout), targets, deferrals)
        for landing, output in zip(self._outputs, outputs):
            landing.copy_(output.detach())
        return _Captured(leaves, outputs, deferrals)

    def _captured_input_pass(self, kind: str, captured: _Captured) -> None:
        # W may read one after the next I has been copied in: an I pass keeps its own copy.
        grad_outputs = [landing.clone() for landing in self._grad_outputs] if kind == "I" else self._grad_outputs
        grads, captured.deferred = self._input_pass(captured.outputs, grad_outputs, captured.inputs,
                                                    captured.deferrals)
        input_grads, param_grads = self._align(grads, captured.inputs)
        _copy_found(self._input_grads, input_grads, f"stage {self.stage}'s input gradients")
        if not self.accumulators:
            self._returned[kind] = [grad is not None for grad in param_grads]
            _copy_found(self._param_grads, param_grads, f"stage {self.stage}'s parameter gradients")
        captured.inputs, captured.outputs = [], []

    def _captured_weight_pass(self, captured: _Captured) -> None:
        weight_grads = self._weight_pass(captured.deferred)
        if not self.accumulators:
            self._returned["W"] = [grad is not None for grad in weight_grads]
            _copy_found(self._param_grads, weight_grads, f"stage {self.stage}'s deferred weight gradients")

    def _probe(self, differentiable: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the differentiable outputs a warm-up and a checked replay both use: the loss's own (1), or
        the same noise for every output of a stage sent on (ones would hide a transposed or mixed-up gradient)."""
        if self.loss is not None:
            return [torch.ones_like(t) for t in differentiable]
        generator = torch.Generator(differentiable[0].device).manual_seed(0) if differentiable else None
        return [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator) for t in differentiable]

    def _check_replays(self, reference: _Reference, device: torch.device) -> None:
        """Every captured pass replayed in order on the capture's micro-batch, each from the random state its eager
        twin started at, equals that run: outputs and input gradients at once, returned parameter gradients likewise.

        Accumulators hold the eager run's parameter gradients R, and no copy of them is made: a backward is linear in
        its output gradient, so micro-batches take the probe negated and not by turns (-, +, -, ...) and each
        accumulator must be about zero, relative to R's largest entry, whenever every pass adding into it has added
        one more negated than not. A second round of replays, as far as needed, checks what the first one's last
        passes added."""
        signs: dict[int, float] = {}  # each micro-batch's, for its backward's passes
        backwards = 0  # backward (or I) replays so far, both rounds
        probes = self._probe([t for t, wanted in zip(self._outputs, self._output_requires_grad) if wanted])
        sums = {"input": 0, "weight": 0}  # the signs added so far by the passes adding into each part
        to_cover = set(reference.largest)  # parameters whose accumulators no check has covered since the first round
        for round_ in range(2 if self.accumulators else 1):
            for position, (kind, micro_batch) in enumerate(self.passes):
                torch.cuda.set_rng_state(reference.states[_STATE_OF[kind]], device)
                if kind in ("B", "I"):
                    signs[micro_batch] = -1.0 if backwards % 2 == 0 else 1.0
                    backwards += 1
                    for landing, probe in zip(self._grad_outputs, probes):
                        torch.mul(probe, signs[micro_batch], out=landing)
                self._random.replayed(kind, micro_batch, self._graphs[(kind, micro_batch)].replay)
                difference = self._replay_difference(kind, signs.get(micro_batch), reference) if round_ == 0 else None
                if difference:
                    raise GraphCheckError(f"stage {self.stage}: the first replay of the {kind} pass of micro-batch "
                                          f"{micro_batch} differs from an eager run of the same micro-batch: "
                                          f"{difference}")
                if not self.accumulators or kind == "F":
                    continue
                where = f"{kind} pass of micro-batch {micro_batch} (round {round_ + 1})"
                checked = self._check_accumulated("weight" if kind == "W" else "input", signs[micro_batch], sums,
                                                  reference, where)
                if round_ == 1 or position == len(self.passes) - 1:
                    to_cover.difference_update(checked)
                    if not to_cover:
                        return
        if to_cover:
            raise GraphCheckError(f"stage {self.stage}: the schedule's order left {len(to_cover)} parameter gradients "
                                  "of the CUDA graphs unchecked")

    def _check_accumulated(self, part: str, sign: float, sums: dict[str, int], reference: _Reference,
                           where: str) -> set[int]:
        """After a replayed pass that added ``sign`` times its gradients into ``part``: the accumulators of the
        parameters each of whose parts has added one more negated than not must be about zero; returns their ids."""
        sums[part] += int(sign)
        ready = [p for p in self.accumulated if id(p) in reference.largest and part in reference.parts[id(p)]
                 and all(sums[one] == -1 for one in reference.parts[id(p)])]
        difference = off_zero(self.accumulators.tensors(ready), [reference.largest[id(p)] for p in ready])
        if difference:
            raise GraphCheckError(f"stage {self.stage}: the parameter gradients the replays added up to the {where} "
                                  f"differ from an eager run's (the probe negated and not by turns): {difference}")
        return set(map(id, ready))

    def _replay_difference(self, kind: str, sign: float | None, reference: _Reference) -> str | None:
        """How the landing buffers after a checked replay of a ``kind`` pass differ from the eager run (the gradients
        times ``sign``), or None."""
        if kind == "F":
            return largest_difference([("output", self._outputs, reference.outputs)])
        if kind == "W":
            if self.accumulators:
                return None
            return largest_difference([("deferred weight gradient", signed(self._returned_grads("W"), sign),
                                         reference.weight_grads)])
        compared = [("input gradient", signed(self._input_grads, sign), reference.input_grads)]
        if not self.accumulators:
            compared.append(("parameter gradient", signed(self._returned_grads(kind), sign), reference.param_grads))
        return largest_difference(compared)

    def _input_pass(self, outputs: list, grad_outputs: list, inputs: list,
                    deferrals: list[Deferral] | None) -> tuple[tuple, list[DeferredGrad]]:
        """The backward (or, with ``deferrals``, its I part): gradients of the inputs that require grad and of the
        trainable parameters (None for those added into accumulators), and what the deferring Linear layers leave to
        W. Through the autograd engine as the eager stage goes, since the outputs' memory may be freed already. With
        accumulators the inputs' gradients come through their ``.grad``, which autograd sets anew."""
        wanted_inputs = [t for t in inputs if t.requires_grad]
        params = [p for p in self.params if p.requires_grad]
        differentiable = [t for t in outputs if t.requires_grad]
        if not differentiable or not (wanted_inputs or params):
            return (None,) * (len(wanted_inputs) + len(params)), []
        deferred: list[DeferredGrad] = []
        if self.store:
            self.store.collecting = deferred
        try:
            if self.accumulators:
                for tensor in wanted_inputs:
                    tensor.grad = None
                run_backward(differentiable, grad_outputs, wanted_inputs + params, keep_graph=False, accumulate=True)
                grads = tuple(tensor.grad for tensor in wanted_inputs) + (None,) * len(params)
            else:
                grads = run_backward(differentiable, grad_outputs, wanted_inputs + params, keep_graph=False)
        finally:
            if self.store:
                self.store.collecting = None
        check_reported(deferrals or (), differentiable, f"cuda_graphs: stage {self.stage}, capture of the I pass")
        return grads, deferred

    def _weight_pass(self, deferred: list[DeferredGrad]) -> list | None:
        """The deferred weights' gradients, one entry per stage parameter; a layer run twice adds both. With
        accumulators, added into them as the eager W does (None)."""
        if self.accumulators:
            self.sink.add_weight_grads(deferred)
            return None
        by_weight: dict[int, torch.Tensor] = {}
        for weight, x, grad in deferred:
            part = weight_grad(grad, x).to(weight.dtype)
            by_weight[id(weight)] = by_weight[id(weight)] + part if id(weight) in by_weight else part
        return [by_weight.get(id(p)) for p in self.params]

    def _align(self, grads: tuple, inputs: list) -> tuple[list, list]:
        """The I pass's results as one entry per input tensor and one per stage parameter (None: no gradient)."""
        produced = iter(grads)
        input_grads = [next(produced) if t.requires_grad else None for t in inputs]
        return input_grads, [next(produced) if p.requires_grad else None for p in self.params]


def _shared(members: Sequence[GraphedStage]) -> set[int]:
    """The ids of the trainable parameters more than one of ``members`` holds (a tied embedding): their accumulators
    take gradients from several stages' graphs."""
    seen: set[int] = set()
    shared: set[int] = set()
    for member in members:
        mine = {id(param) for param in member.params if param.requires_grad}
        shared |= seen & mine
        seen |= mine
    return shared


def _release_random_state(device: torch.device, state: torch.Tensor) -> None:
    """The device's default generator as it was before a capture that failed: a capture that ends in an error leaves
    the generator's state marked as capturing, and every later random op would raise. A new state replaces it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(torch.Generator(device=torch.device("cuda", index)).graphsafe_get_state())
    torch.cuda.set_rng_state(state, device)


def signature(inputs: boundary.Flat, targets: boundary.Flat) -> tuple:
    """What a micro-batch must share with the one graphs were captured for, inputs then targets: the structure with
    its non-tensor leaves, and each tensor's shape, dtype, device and requires_grad."""
    return tuple((flat.layout, tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in flat.tensors))
                 for flat in (inputs, targets))


def signature_difference(one: tuple, captured: tuple) -> str | None:
    """How signature ``one`` differs from the ``captured`` one, said; None if it does not."""
    for what, (layout, tensors), (captured_layout, captured_tensors) in zip(("input", "target"), one, captured):
        difference = boundary.layout_mismatch(layout, captured_layout)
        if difference:
            return f"the {what}s differ from those the graphs were captured with: {difference}"
        for index, (tensor, captured_tensor) in enumerate(zip(tensors, captured_tensors)):
            if tensor != captured_tensor:
                return (f"{what} tensor {index} is {_described(tensor)}, but the graphs were captured for "
                        f"{_described(captured_tensor)}")
    return None


def _described(tensor: tuple) -> str:
    shape, dtype, device, requires_grad = tensor
    return f"{tuple(shape)} {dtype} on {device}{', requiring grad' if requires_grad else ''}"


def _copy_in(landing: boundary.Flat, values: boundary.Flat) -> None:
    for target, value in zip(landing.tensors, values.tensors):
        target.copy_(value.detach())


def _copy_found(landings: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None], what: str) -> None:
    """Inside a capture: each gradient into its landing buffer, which the warm-up made where it found one."""
    for index, (landing, grad) in enumerate(zip(landings, grads)):
        if grad is None:
            continue
        if landing is None:
            raise RuntimeError(f"cuda_graphs: {what}: entry {index} has a gradient in the capture and had none in "
                               "the warm-up before it")
        landing.copy_(grad)
