"""CUDA-graph capture of a stage's forward and backward: one graph launch per action instead of one launch per kernel.

A small model's stage is bound by the host launching its kernels one by one. With static shapes,
each stage's forward (with the loss, on the last stage) and backward are captured once and then
replayed. A graph's activations live in its own memory, so a stage gets one pair of graphs per
micro-batch it can hold in flight (the schedule says how many), used round-robin.

Each slot's forward has a memory pool of its own, since its activations must outlive other slots' replays. The
slots' whole backwards (not split into I and W) share one pool: a backward leaves nothing there that outlives it but
its input gradients, which are copied out before any other replay, so its working memory is the stage's once, not
once per slot. Split backwards stay in their slot's pool: I leaves the layers' output gradients there for W.

Where the parameters' gradients go to ``.grad``, the captured backward adds them in place into
``graph_gradients``' accumulators, so that no slot's pool holds a set of gradients; with ``main_grad`` buffers it
returns them for the caller to add.

A replay reads what the capture saw: the tensors' addresses and every Python value the forward read then. So a
capture can be checked (``checked=True``: each slot's first replay against an eager run of the same micro-batch, the
same random numbers, gradients probed with the same noise), and ``changed_since_capture`` names what the graphs can no
longer see (parameters moved or frozen, modules switched between train and eval, autocast turned on or off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.runtime import boundary
from pipecomm.runtime.capture_state import CaptureState
from pipecomm.runtime.checks import gradient_hook
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.graph_gradients import GradientAccumulators
from pipecomm.schedules.schedule import Schedule
from pipecomm.runtime.split_backward import DeferredGrad, Deferral, WeightGradStore, check_reported, weight_grad
from pipecomm.runtime.stage_runner import run_backward

__all__: list[str] = []

_WARMUP_ITERATIONS = 2  # eager runs on a side stream before capture, so lazy initialisation stays out of the graph
# A replay checked against eager may differ by the atomics' order in some backward kernels (attention's, index_add's):
# largest difference allowed, relative to the eager tensor's largest entry. Stale values from a capture differ by far
# more.
_CHECK_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
_CHECK_TOLERANCE_DEFAULT = 1e-3


class GraphCheckError(RuntimeError):
    """A captured graph's first replay differed from an eager run of the same micro-batch."""


def in_flight_slots(schedule: Schedule, rank: int, stage: int) -> int:
    """How many micro-batches ``stage`` holds between its forward and its last backward pass (B, or W where the
    backward is split) at most; checks that each kind of pass runs the micro-batches in forward order."""
    order = [action.micro_batch for action in schedule.actions[rank] if action.stage == stage and action.kind == "F"]
    for kind in ("B", "I", "W"):
        runs = [action.micro_batch for action in schedule.actions[rank] if action.stage == stage and action.kind == kind]
        if runs and runs != order:
            raise ValueError(f"cuda_graphs: schedule {schedule.name!r} runs stage {stage}'s {kind} passes out of "
                             "forward order, which round-robin graph slots cannot follow")
    held = most = 0
    for action in schedule.actions[rank]:
        if action.stage == stage and action.kind in ("F", "B", "W"):
            held += 1 if action.kind == "F" else -1
            most = max(most, held)
    return most


class _Slot:
    """One captured forward and its backward (one graph, or I and W) and the static tensors they read and write."""

    def __init__(self, inputs: boundary.Flat, targets: boundary.Flat, outputs: list, grad_outputs: list,
                 forward: torch.cuda.CUDAGraph, backward: torch.cuda.CUDAGraph, input_grads: list, param_grads: list,
                 weights: torch.cuda.CUDAGraph | None = None, weight_grads: list | None = None):
        self.inputs, self.targets, self.outputs = inputs, targets, outputs
        self.grad_outputs, self.forward, self.backward = grad_outputs, forward, backward
        self.input_grads, self.param_grads = input_grads, param_grads
        self.weights, self.weight_grads = weights, weight_grads


class GraphedStage:
    """A stage module whose forward and backward replay CUDA graphs captured at the first forward.

    With a ``weight_grad_store`` (zero-bubble schedules, whose Linear layers defer to it) the backward is
    captured as two graphs, as the eager executor splits it: I (input gradients and every parameter's
    gradient but the deferred Linear weight GEMMs') and W (those GEMMs, from the layer's input and output
    gradient that I left in the slot).

    With ``accumulators`` (used where the ``sink`` accumulates in ``.grad``), the backward graphs add the parameters'
    gradients into them; otherwise they return the gradients, for the caller to add.
    """

    def __init__(self, module: nn.Module, sink: GradientSink, slots: int, stage: int, loss: Callable | None,
                 weight_grad_store: WeightGradStore | None = None, checked: bool = False,
                 accumulators: GradientAccumulators | None = None):
        self.module = module
        self.sink = sink
        self.params = sink.params
        self.accumulators = accumulators if sink.autograd_accumulates else None
        self.accumulated: list[nn.Parameter] = []  # the parameters whose gradients the graphs add into accumulators
        self.stage = stage
        self.num_slots = slots
        self.loss = loss  # (output, *targets) -> scaled loss, on the last stage
        self.store = weight_grad_store
        self.checked = checked
        self.output_layout: boundary.Layout | None = None  # the output structure without its tensors, from the capture
        self._seen: CaptureState | None = None  # what the replays read beside their inputs, as the capture saw it
        self._signature: tuple = ()  # of the micro-batch the graphs were captured for (``signature``)
        self._slots: list[_Slot] = []
        self._backward_pool: tuple | None = None  # the slots' whole backwards share it

    @property
    def captured(self) -> bool:
        return bool(self._slots)

    def forward(self, micro_batch: int, args: tuple, targets: tuple, kwargs: dict | None = None) -> tuple:
        """Replays the slot's forward on copies of the inputs (any pytrees); returns the output's tensors (the
        1-tuple of the loss on the last stage): the slot's static outputs, detached, requiring grad where the
        captured outputs do. ``output_layout`` makes them the output structure again. Captures at the first call."""
        return self.replay(micro_batch, boundary.flatten((args, kwargs or {})), boundary.flatten(targets))

    def replay(self, micro_batch: int, inputs: boundary.Flat, targets: boundary.Flat) -> tuple:
        """``forward`` on inputs and targets already taken apart."""
        if not self._slots:
            self._capture(inputs, targets)
        mismatch = self.mismatch(inputs, targets)
        if mismatch:
            raise ValueError(f"cuda_graphs: stage {self.stage}, micro-batch {micro_batch}: {mismatch}; CUDA graphs "
                             "need static shapes")
        return self.replay_fitting(micro_batch, inputs, targets)

    def replay_fitting(self, micro_batch: int, inputs: boundary.Flat, targets: boundary.Flat) -> tuple:
        """``replay`` of a micro-batch known to fit the captured graphs (``mismatch`` said None)."""
        slot = self._slots[micro_batch % self.num_slots]
        _copy_in(slot.inputs, inputs)
        _copy_in(slot.targets, targets)
        slot.forward.replay()
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in slot.outputs)

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

    def backward(self, micro_batch: int, grads: tuple | None) -> tuple[list, list]:
        """Replays the slot's backward for the outputs' ``grads`` (None: the loss's own, 1); returns
        the static (input grads, parameter grads), one entry per input tensor and per stage parameter (None
        where there is no gradient); the parameter grads are None where the graphs add them into accumulators. Valid
        until the next backward replay of any slot."""
        slot = self._slots[micro_batch % self.num_slots]
        if grads is None:
            for static in slot.grad_outputs:
                static.fill_(1.0)  # set each time: the capture's check leaves other probes there
        differentiable = iter(slot.grad_outputs)
        for output, grad in zip(slot.outputs, grads or ()):
            if output.requires_grad:
                static = next(differentiable)
                static.copy_(grad) if grad is not None else static.zero_()
        slot.backward.replay()
        return slot.input_grads, slot.param_grads

    def backward_weights(self, micro_batch: int) -> list:
        """Replays the slot's W (after its I): the deferred weights' gradients, one entry per stage parameter (None
        where the graphs add them into accumulators)."""
        slot = self._slots[micro_batch % self.num_slots]
        slot.weights.replay()
        return slot.weight_grads

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
        if self.loss is not None:
            output = self.loss(output, *boundary.unflatten(targets.tensors, targets.layout))
        flat = boundary.flatten(output)
        if self.loss is None and any(isinstance(tensor, DTensor) for tensor in flat.tensors):
            raise TypeError(f"cuda_graphs: stage {self.stage}'s output holds a DTensor, which a graph's static outputs "
                            "cannot hand over as its local shard; keep use_local_output=True in the last layer's plan")
        self.output_layout = flat.layout
        return flat.tensors

    def _capture(self, inputs: boundary.Flat, targets: boundary.Flat) -> None:
        """Warm-up runs, then each slot's capture; with ``checked``, each slot's replay against the last warm-up.
        The module's buffers (batch norm's running statistics) are restored afterwards: these extra runs are no
        training step's. On failure the current stream is restored and no slot is kept. A parameter's gradient hook
        is refused: a replay would run its kernels as captured, not the hook."""
        hook = gradient_hook(self.module)
        if hook:
            raise ValueError(f"cuda_graphs: stage {self.stage}'s {hook}, which a replay would not run; remove it, or "
                             'leave cuda_graphs="auto", which runs such a stage eagerly')
        device = inputs.tensors[0].device
        autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )
        self._signature = signature(inputs, targets)
        buffers = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]
        stream, random_state = torch.cuda.current_stream(device), torch.cuda.get_rng_state(device)
        accumulators = self.accumulators
        try:
            with accumulators.capturing(self.params) if accumulators else contextlib.nullcontext():
                try:
                    reference, warm_up_state = self._warm_up(inputs, targets, autocast, device)
                    for _ in range(self.num_slots):
                        self._slots.append(self._capture_slot(inputs, targets, autocast))
                    if self.checked:
                        self._check_replays(reference, warm_up_state, device)
                except BaseException:
                    if accumulators:
                        accumulators.release(self.stage)
                    raise
        except BaseException:
            self._slots, self.accumulated = [], []
            torch.cuda.set_stream(stream)  # a failed capture leaves its own stream current
            _release_random_state(device, random_state)
            raise
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
        self.record_state()

    def record_state(self) -> None:
        """What ``changed_since_capture`` compares against: the stage's state now."""
        self._seen = CaptureState(self.module)

    def _warm_up(self, inputs: boundary.Flat, targets: boundary.Flat, autocast,
                 device) -> tuple[tuple | None, torch.Tensor]:
        """Eager runs on a side stream; with ``checked``, the last one's results (outputs, input and parameter
        gradients, W's) for the probe gradients, and the random state it started from. With accumulators, the first
        run (into empty ``.grad``s) shows which parameters get gradients; those get accumulators, zeroed before each
        later run."""
        caller, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side), autocast:
            static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
            for iteration in range(_WARMUP_ITERATIONS):
                if self.accumulators and iteration == 1:
                    self.accumulated = self.accumulators.adopt_reached(self.stage, self.params)
                    for tensor in self.accumulators.tensors(self.accumulated):
                        # Made on this stream, used on the caller's: freed, it waits for the caller's work.
                        tensor.record_stream(caller)
                elif self.accumulators and iteration > 1:
                    self.accumulators.zero(self.accumulated)
                random_state = torch.cuda.get_rng_state(device)
                deferrals = [] if self.store else None
                outputs = self._run(static_inputs, static_targets, deferrals)
                grads, deferred = self._input_pass(outputs, self._probe(outputs), static_inputs.tensors, deferrals)
                weight_grads = self._weight_pass(deferred) if self.store else None
            reference = None
            if self.checked:
                input_grads, param_grads = self._align(grads, static_inputs.tensors)
                # With accumulators, the eager parameter gradients stay there for the check; kept here only their
                # largest entries, where returned gradients are copied.
                param_part = (_largest_entries(self.accumulators.tensors(self.accumulated)) if self.accumulators
                              else _detached(param_grads))
                reference = (_detached(outputs), _detached(input_grads), param_part, _detached(weight_grads or []))
        torch.cuda.current_stream(device).wait_stream(side)
        return reference, random_state

    def _capture_slot(self, inputs: boundary.Flat, targets: boundary.Flat, autocast) -> _Slot:
        static_inputs, static_targets = _static_copy(inputs, self.stage > 0), _static_copy(targets, False)
        pool = torch.cuda.graph_pool_handle()
        if self.store is None and self._backward_pool is None:
            self._backward_pool = torch.cuda.graph_pool_handle()
        backward_pool = pool if self.store else self._backward_pool
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        weights = torch.cuda.CUDAGraph() if self.store else None
        deferrals = [] if self.store else None
        with autocast:
            with torch.cuda.graph(forward, pool=pool, capture_error_mode="thread_local"):
                outputs = self._run(static_inputs, static_targets, deferrals)
            grad_outputs = self._probe(outputs)
            with torch.cuda.graph(backward, pool=backward_pool, capture_error_mode="thread_local"):
                grads, deferred = self._input_pass(outputs, grad_outputs, static_inputs.tensors, deferrals)
            weight_grads = None
            if weights is not None:
                with torch.cuda.graph(weights, pool=pool, capture_error_mode="thread_local"):
                    weight_grads = self._weight_pass(deferred)
        input_grads, param_grads = self._align(grads, static_inputs.tensors)
        return _Slot(static_inputs, static_targets, outputs, grad_outputs, forward, backward, input_grads,
                     None if self.accumulators else param_grads, weights, weight_grads)

    def _probe(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the differentiable outputs a warm-up and a checked replay both use: the loss's own (1), or
        the same noise for every output of a stage sent on (ones would hide a transposed or mixed-up gradient)."""
        if self.loss is not None:
            return [torch.ones_like(t) for t in outputs if t.requires_grad]
        generator = torch.Generator(outputs[0].device).manual_seed(0)
        return [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator)
                for t in outputs if t.requires_grad]

    def _check_replays(self, reference: tuple, random_state: torch.Tensor, device: torch.device) -> None:
        """Each slot replayed on the capture's micro-batch, from the random state the eager run started at, equals
        that run: its outputs, input gradients, parameter gradients and W's, to the atomics' noise.

        Accumulators hold the eager run's parameter gradients R, and no copy of them is made: a backward is linear in
        its output gradient, so the first slot replayed with the probe negated leaves R - G0, and each later slot
        replayed with the probe, then the first negated again, adds Gk - G0; each time the accumulators must be zero
        to within the tolerance of R's largest entries."""
        expected_outputs, expected_input_grads, expected_params, _ = reference
        for index, slot in enumerate(self._slots):
            sign = -1.0 if self.accumulators and index == 0 else 1.0
            self._replay_probed(slot, random_state, device, sign)
            input_grads = [grad if grad is None or sign > 0 else -grad for grad in slot.input_grads]
            if self.accumulators:
                replayed = (slot.outputs, input_grads, [], [])
                difference = _largest_difference(replayed, (expected_outputs, expected_input_grads, [], []))
                if not difference and index > 0:
                    self._replay_probed(self._slots[0], random_state, device, -1.0)
                difference = difference or _off_zero(self.accumulators.tensors(self.accumulated), expected_params)
            else:
                replayed = (slot.outputs, input_grads, slot.param_grads, slot.weight_grads or [])
                difference = _largest_difference(replayed, reference)
            if difference:
                raise GraphCheckError(f"stage {self.stage}: the first replay of CUDA graph slot {index} differs from "
                                      f"an eager run of the same micro-batch: {difference}")

    def _replay_probed(self, slot: _Slot, random_state: torch.Tensor, device: torch.device, sign: float) -> None:
        """The slot's passes from ``random_state``, the probe gradients times ``sign`` into its backward."""
        torch.cuda.set_rng_state(random_state, device)
        for static, probe in zip(slot.grad_outputs, self._probe(slot.outputs)):
            static.copy_(probe.mul_(sign))
        slot.forward.replay()
        slot.backward.replay()
        if slot.weights is not None:
            slot.weights.replay()

    def _input_pass(self, outputs: list, grad_outputs: list, inputs: list,
                    deferrals: list[Deferral] | None) -> tuple[tuple, list[DeferredGrad]]:
        """The backward (or, with ``deferrals``, its I part): gradients of the inputs that require grad and of the
        trainable parameters (None for those added into accumulators), and what the deferring Linear layers leave to
        W. With accumulators the inputs' gradients come through their ``.grad``, which autograd sets anew."""
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
                grads = torch.autograd.grad(differentiable, wanted_inputs + params, grad_outputs, allow_unused=True)
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


def _copy_in(static: boundary.Flat, values: boundary.Flat) -> None:
    for target, value in zip(static.tensors, values.tensors):
        target.detach().copy_(value)  # the static input is an autograd leaf


def _detached(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone() for t in tensors]


_RESULTS = ("output", "input gradient", "parameter gradient", "deferred weight gradient")


def _largest_difference(replayed: tuple, reference: tuple) -> str | None:
    """The first replayed tensor off its eager twin by more than the tolerance (relative to the twin's largest
    entry), described; None where every one agrees. One synchronization for all of them."""
    pairs, named = [], []
    for kind, got_list, want_list in zip(_RESULTS, replayed, reference):
        for index, (got, want) in enumerate(zip(got_list, want_list)):
            if (got is None) != (want is None):
                return f"{kind} {index} is {'missing' if got is None else 'present'} in the replay only"
            if got is not None and got.numel():
                pairs.append(torch.stack([(got.float() - want.float()).abs().max(), want.float().abs().max()]))
                named.append((f"{kind} {index}", _CHECK_TOLERANCE.get(want.dtype, _CHECK_TOLERANCE_DEFAULT)))
    if not pairs:
        return None
    for (name, tolerance), (difference, largest) in zip(named, torch.stack(pairs).tolist()):
        if not difference <= tolerance * largest:  # NaN fails too
            return f"{name}: largest difference {difference:.3g} where the largest entry is {largest:.3g}"
    return None


def _largest_entries(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each non-empty tensor's largest absolute entry, a 0-d fp32 tensor (no synchronization)."""
    return [tensor.detach().float().abs().max() for tensor in tensors if tensor.numel()]


def _off_zero(tensors: Sequence[torch.Tensor], largest: Sequence[torch.Tensor]) -> str | None:
    """The first non-empty tensor whose largest entry is over the tolerance relative to ``largest`` (its eager twin's,
    in the same order), described; None where every one is about zero. One synchronization."""
    tensors = [tensor for tensor in tensors if tensor.numel()]
    if not tensors:
        return None
    found = torch.stack(_largest_entries(tensors) + list(largest)).tolist()
    for index, (tensor, got, bound) in enumerate(zip(tensors, found, found[len(tensors):])):
        if not got <= _CHECK_TOLERANCE.get(tensor.dtype, _CHECK_TOLERANCE_DEFAULT) * bound:  # NaN fails too
            return (f"parameter gradient {index}: largest difference {got:.3g} where the largest entry is "
                    f"{bound:.3g}")
    return None


def _static_copy(values: boundary.Flat, differentiable: bool) -> boundary.Flat:
    """Static copies of the tensors; those of a later stage require grad where the received ones do."""
    return values._replace(tensors=[
        tensor.detach().clone().requires_grad_(differentiable and tensor.requires_grad) for tensor in values.tensors
    ])
