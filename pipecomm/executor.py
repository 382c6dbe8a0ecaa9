"""Runs one rank's schedule: forwards and backwards of its stages, the sends and receives between them, gradient accumulation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm import boundary
from pipecomm._ops import accumulate_
from pipecomm.cuda_graphs import GraphedStage, in_flight_slots
from pipecomm.device_timing import DeviceTimeline
from pipecomm.schedule import Action, Schedule
from pipecomm.split_backward import DeferredGrad, Deferral, WeightGradStore, check_reported, weight_grad
from pipecomm.transport.channel import Channel, ChannelError

__all__: list[str] = []

# accumulate_ kernels exist for these (accumulator, grad) pairs; others fall back to add_.
_NATIVE_PAIRS = {
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                  keep_graph: bool) -> tuple:
    """Gradients of ``outputs`` w.r.t. ``inputs`` without accumulating into ``.grad``.

    Goes to the autograd engine directly, as Megatron does, because the outputs' storage was freed
    after they were sent and torch.autograd.grad would reject their placeholder shapes. An output
    without a gradient (the next stage did not use it) contributes nothing.
    """
    pairs = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad and grad is not None]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    tensors, grad_tensors = zip(*pairs)
    return torch.autograd.Variable._execution_engine.run_backward(
        tensors, grad_tensors, keep_graph, False, tuple(inputs), True, False
    )


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.clone() if tensor is not None else None


class _SavedStorages:
    """The storages of the tensors autograd saves for backward during a forward, seen by saved-tensor hooks (which
    see what torch.compile'd regions save too)."""

    def __init__(self):
        self.pointers: set[int] = set()
        self.complete = True  # False once a saved tensor had no storage to note (a wrapper subclass)

    def observe(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        pointer = _storage_pointer(tensor)
        if pointer is None:
            self.complete = False
        else:
            self.pointers.add(pointer)
        return tensor.detach()  # what autograd keeps must not hold the tensor itself: a saved output would be a cycle

    def unreferenced(self, tensor: torch.Tensor) -> bool:
        pointer = _storage_pointer(tensor)
        return self.complete and pointer is not None and pointer not in self.pointers


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _free_storage(outputs: Sequence[torch.Tensor], saved: _SavedStorages | None) -> None:
    """Drops the data of sent outputs while their autograd nodes live on (Megatron's deallocate_output_tensor).

    ``.data`` swaps the storage of the tensor object itself, so whatever holds that object for the
    backward would read the placeholder: an op that saved it (a multiply, for its other operand's
    gradient) or zb-h1's deferred weight gradient, which keeps a Linear's input (autograd saves that
    input too). So an output is freed only if no tensor autograd saved shares its storage, if autograd
    computed it (a leaf may be a parameter or a received input passed through) and if it is no view
    (its base keeps the memory). Outputs of a forward whose saves were not observed (``saved`` None:
    CUDA graphs) are all kept.
    """
    if saved is None:
        return
    for tensor in outputs:
        if tensor.grad_fn is not None and tensor._base is None and saved.unreferenced(tensor):
            tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


class GradientSink:
    """Where a stage's parameter gradients go: ``.grad`` (default) or fp32 ``main_grad`` buffers.

    With ``main_grad``, the bf16/fp16 parameters that require grad share one flat fp32 buffer; one
    unfrozen later gets a buffer of its own with its first gradient. Frozen parameters get no gradient.
    With ``live`` (a stage sharded by FSDP), ``params`` are the module's parameters at the time they
    are read: FSDP swaps its unsharded ones in while they are gathered, and those are what autograd sees.
    """

    def __init__(self, params: list[nn.Parameter], main_grad: bool, live: nn.Module | None = None):
        self._params = params
        self._live = live
        self.main_grad = main_grad
        if main_grad:
            low_precision = [p for p in params if p.dtype in _LOW_PRECISION and p.requires_grad]
            total = sum(p.numel() for p in low_precision)
            device = low_precision[0].device if low_precision else None
            self.flat_main_grad = torch.zeros(total, dtype=torch.float32, device=device) if low_precision else None
            offset = 0
            for param in low_precision:
                param.main_grad = self.flat_main_grad[offset : offset + param.numel()].view_as(param)
                offset += param.numel()

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._live.parameters()) if self._live is not None else self._params

    def target(self, param: nn.Parameter) -> torch.Tensor | None:
        if self.main_grad and param.dtype in _LOW_PRECISION:
            return getattr(param, "main_grad", None)
        return param.grad

    def add(self, grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter] | None = None) -> None:
        """Adds one micro-batch's gradients of ``params`` (default: all): one fused launch per dtype pair (DTensors,
        a tensor-parallel layer's, add through their own dispatch)."""
        accumulators, sources = [], []
        for param, grad in zip(self.params if params is None else params, grads):
            if grad is None:
                continue
            target = self.target(param)
            if target is None:
                self._start(param, grad)
            elif (target.dtype, grad.dtype) in _NATIVE_PAIRS and not isinstance(target, DTensor):
                accumulators.append(target)
                sources.append(grad)
            else:
                target.add_(grad)
        accumulate_(accumulators, sources)

    def _start(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        # A copy: autograd may hand back one tensor for several parameters, or an expanded view.
        if self.main_grad and param.dtype in _LOW_PRECISION:
            param.main_grad = grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            param.grad = grad.clone(memory_format=torch.contiguous_format)

    @torch.no_grad()  # the saved inputs carry autograd history, which .grad must not record
    def add_weight_grads(self, deferred: Sequence[DeferredGrad]) -> None:
        """Deferred Linear weight gradients; where the dtypes allow, the GEMM accumulates in place."""
        params, grads = [], []
        for param, x, grad_output in deferred:
            target = self.target(param)
            if target is not None and target.dtype == grad_output.dtype == x.dtype:
                target.addmm_(grad_output.reshape(-1, grad_output.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            else:
                # In the parameter's dtype, as autograd hands gradients back (under autocast, too).
                params.append(param)
                grads.append(weight_grad(grad_output, x).to(param.dtype))
        self.add(grads, params)


class StageExecutor:
    """Executes a rank's actions for one step; holds nothing between steps but the timeline."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: dict[int, nn.Module],
        sinks: dict[int, GradientSink],
        channels: dict[tuple[int, str], boundary.StructureChannel | Channel],
        loss_fn: Callable,
        on_stage_backward_done: Callable[[int], None] | None = None,
        weight_grad_store: WeightGradStore | None = None,
        cuda_graphs: bool = False,
        device_timeline: DeviceTimeline | None = None,
    ):
        self.schedule = schedule
        self.rank = rank
        self.modules = modules
        self.sinks = sinks
        self.channels = channels
        self.loss_fn = loss_fn
        self.last_stage = schedule.num_stages - 1
        self.on_stage_backward_done = on_stage_backward_done
        self.weight_grad_store = weight_grad_store
        self.device_timeline = device_timeline
        # Built (and the schedule checked) here, before any communication; captured at the first forward.
        self.graphed = {
            stage: GraphedStage(module, sinks[stage].params, in_flight_slots(schedule, rank, stage), stage,
                                self._scaled_loss if stage == self.last_stage else None,
                                weight_grad_store if any(a.kind == "I" and a.stage == stage
                                                         for a in schedule.actions[rank]) else None)
            for stage, module in modules.items()
        } if cuda_graphs else {}
        self.timeline: list[tuple[float, float, Action]] = []

    def run(self, inputs: list[tuple[tuple, dict]] | None, targets: list[tuple] | None,
            batch_size: int | None = None, target_batch: int | None = None) -> torch.Tensor | None:
        """One training step over all micro-batches (``inputs``: each one's positional and keyword arguments of the
        first stage); returns the summed (already 1/m-scaled) losses on the last stage.

        ``batch_size`` is the batch's on the first stage; later stages learn it from the activations and the
        last one checks that its targets' batch size, ``target_batch``, matches.
        """
        self._start(inputs, targets, batch_size, target_batch, self.schedule.micro_batches)
        if self.weight_grad_store:
            self.weight_grad_store.new_step()
        if self.last_stage in self.modules:
            self._check_target_batch(batch_size)  # a one-rank pipeline's own batch; the others' arrives with it
        self.timeline = []
        handlers = {
            "F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight,
            "SEND_F": self._send_forward, "RECV_F": self._recv_forward,
            "SEND_B": self._send_backward, "RECV_B": self._recv_backward,
        }
        device = self.device_timeline
        if device:
            device.start_step()
        for action in self.schedule.actions[self.rank]:
            started = time.perf_counter()
            timed = device is not None and action.is_compute
            if timed:
                device.mark()
            handlers[action.kind](action.stage, action.micro_batch)
            if timed:
                device.mark()
            self.timeline.append((started, time.perf_counter(), action))
        if device:
            device.end_step()
        return self._loss

    def infer(self, inputs: list[tuple[tuple, dict]] | None, forward_schedule: Callable[[int], Schedule]) -> list | None:
        """Inference over ``forward_schedule(micro_batches)``; returns the last stage's output of each micro-batch
        (None on a rank without the last stage).

        ``inputs`` are given on the first stage's rank; a rank without that stage learns how many micro-batches
        there are from its first message, which is always the first action of its forward-only schedule.
        """
        self._start(inputs, None, None, None, None)
        self._inferred: list = []
        first_message = None
        if inputs is None:
            first_message = Action("RECV_F", min(self.modules), 0)
            self._recv_forward(first_message.stage, 0)
            self._micro_batches = self._received[(first_message.stage, 0)].micro_batches
        else:
            self._micro_batches = len(inputs)
        handlers = {"F": self._infer, "SEND_F": self._send_inferred, "RECV_F": self._recv_forward}
        for action in forward_schedule(self._micro_batches).actions[self.rank]:
            if action != first_message:
                handlers[action.kind](action.stage, action.micro_batch)
        return self._inferred if self.last_stage in self.modules else None

    def _start(self, inputs, targets, batch_size: int | None, target_batch: int | None,
               micro_batches: int | None) -> None:
        """Per-call state: what a step or an inference reads and fills as its actions run."""
        self._inputs, self._targets = inputs, targets
        self._batch_size, self._target_batch = batch_size, target_batch
        self._micro_batches = micro_batches
        self._received: dict[tuple[int, int], boundary.Received] = {}
        # The tensors of a received message that gradients answer (none on the first stage, whose inputs are data).
        self._stage_inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], boundary.Flat] = {}
        self._saved: dict[tuple[int, int], _SavedStorages] = {}
        self._grads_out: dict[tuple[int, int], tuple | None] = {}
        self._grads_in: dict[tuple[int, int], tuple] = {}
        self._deferred: dict[tuple[int, int], list[DeferredGrad]] = {}
        self._deferrals: dict[tuple[int, int], list[Deferral]] = {}
        self._loss: torch.Tensor | None = None
        self._backwards_done: dict[int, int] = dict.fromkeys(self.modules, 0)

    def compute_spans(self) -> list[tuple[float, float, Action]]:
        """(start, end, action) of the last step's compute actions: CUDA-event times (seconds from the step's start)
        with a device timeline, else the host clock."""
        if self.device_timeline:
            compute = [action for _, _, action in self.timeline if action.is_compute]
            return [(start, end, action) for (start, end), action in zip(self.device_timeline.spans(), compute)]
        return [entry for entry in self.timeline if entry[2].is_compute]

    # -- compute -------------------------------------------------------------------------------

    def _scaled_loss(self, output, *targets) -> torch.Tensor:
        # The one place the loss is scaled: the step's gradients then average the micro-batches.
        return self.loss_fn(output, *targets) / self.schedule.micro_batches

    def _stage_arguments(self, stage: int, micro_batch: int) -> tuple[tuple, dict, list[torch.Tensor]]:
        """A forward's positional and keyword arguments, and the received tensors among them (none on the first
        stage, whose inputs are data)."""
        if stage == 0:
            return *self._inputs[micro_batch], []
        received = self._received.pop((stage, micro_batch))
        self._check_batch(received, stage == self.last_stage)
        return boundary.as_arguments(received.structure), {}, received.tensors

    def _forward(self, stage: int, micro_batch: int) -> None:
        key = (stage, micro_batch)
        last = stage == self.last_stage
        args, kwargs, self._stage_inputs[key] = self._stage_arguments(stage, micro_batch)
        targets = self._targets[micro_batch] if last else ()
        graphed = self.graphed.get(stage)
        if graphed:
            outputs = graphed.forward(micro_batch, args, targets, kwargs)
            if last:
                self._add_loss(outputs[0].detach().clone())  # the graph's loss buffer is rewritten by the next replay
            self._outputs[key] = boundary.Flat(list(outputs), graphed.output_layout)
            return
        store = self.weight_grad_store
        if store:
            store.recording = self._deferrals[key] = []
        saved = None if last else _SavedStorages()
        try:
            with saved.observe() if saved else contextlib.nullcontext():
                output = self.modules[stage](*args, **kwargs)
        finally:
            if store:
                store.recording = None
        if last:
            loss = self._scaled_loss(output, *targets)
            self._outputs[key] = boundary.flatten(loss)
            self._grads_out[key] = (torch.ones_like(loss),)
            self._add_loss(loss.detach())
        else:
            self._outputs[key] = boundary.stage_output(output)
            self._saved[key] = saved

    def _infer(self, stage: int, micro_batch: int) -> None:
        """An inference forward: no graphs, no saved tensors, nothing kept past its send."""
        args, kwargs, _ = self._stage_arguments(stage, micro_batch)
        output = self.modules[stage](*args, **kwargs)
        if stage == self.last_stage:
            self._inferred.append(output)
        else:
            self._outputs[(stage, micro_batch)] = boundary.stage_output(output)

    def _check_batch(self, received: boundary.Received, last: bool) -> None:
        """The first stage's batch against this rank's schedule and, on the last stage, its targets: a target of
        another batch size would broadcast silently in many losses."""
        if received.micro_batches != self._micro_batches:
            raise ValueError(f"the first stage split the batch into {received.micro_batches} micro-batches but "
                             f"the Pipeline on rank {self.rank} has micro_batches={self._micro_batches}")
        if last:
            self._check_target_batch(received.batch_size)

    def _check_target_batch(self, batch_size: int | None) -> None:
        if None not in (batch_size, self._target_batch) and batch_size != self._target_batch:
            raise ValueError(f"step: target has batch size {self._target_batch} but the inputs have {batch_size}")

    def _add_loss(self, loss: torch.Tensor) -> None:
        self._loss = loss if self._loss is None else self._loss + loss

    def _backward(self, stage: int, micro_batch: int) -> None:
        if stage in self.graphed:
            self._replay_backward(stage, micro_batch)
        else:
            self._run_stage_backward(stage, micro_batch)
        self._count_backward(stage)

    def _replay_backward(self, stage: int, micro_batch: int) -> None:
        key = (stage, micro_batch)
        del self._outputs[key]
        input_grads, param_grads = self.graphed[stage].backward(micro_batch, self._grads_out.pop(key, None))
        del self._stage_inputs[key]
        if stage > 0:
            # Copies: the slot's buffers are rewritten by its next replay, maybe before a send has read them.
            self._grads_in[key] = tuple(_clone(grad) for grad in input_grads)
        self.sinks[stage].add(param_grads)

    def _backward_input(self, stage: int, micro_batch: int) -> None:
        """Input grads and every parameter grad but the deferred Linear weight GEMMs' now (the critical path); those
        wait for W."""
        if stage in self.graphed:
            self._replay_backward(stage, micro_batch)
            return
        key = (stage, micro_batch)
        roots = [out for out, grad in zip(self._outputs[key].tensors, self._grads_out[key] or ()) if grad is not None]
        deferred: list[DeferredGrad] = []
        self.weight_grad_store.collecting = deferred
        try:
            self._run_stage_backward(stage, micro_batch)
        finally:
            self.weight_grad_store.collecting = None
        check_reported(self._deferrals.pop(key), roots,
                       f"pipeline rank {self.rank}, stage {stage}, micro-batch {micro_batch}, I pass")
        self._deferred[key] = deferred

    def _backward_weight(self, stage: int, micro_batch: int) -> None:
        if stage in self.graphed:
            self.sinks[stage].add(self.graphed[stage].backward_weights(micro_batch))
        else:
            self.sinks[stage].add_weight_grads(self._deferred.pop((stage, micro_batch)))
        self._count_backward(stage)

    def _run_stage_backward(self, stage: int, micro_batch: int) -> None:
        """Backward of a micro-batch towards the stage's inputs and its parameters that require grad."""
        key = (stage, micro_batch)
        outputs, grads = self._outputs.pop(key).tensors, self._grads_out.pop(key)
        inputs = self._stage_inputs.pop(key)
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        params = [p for p in self.sinks[stage].params if p.requires_grad]
        results = _run_backward(outputs, grads, wanted + params, keep_graph=False)
        self._store_input_grads(key, inputs, results[: len(wanted)])
        self.sinks[stage].add(results[len(wanted) :], params)

    def _count_backward(self, stage: int) -> None:
        """Tells the data-parallel reducer when a stage's gradients are final for this step."""
        self._backwards_done[stage] += 1
        if self._backwards_done[stage] == self.schedule.micro_batches and self.on_stage_backward_done:
            self.on_stage_backward_done(stage)

    def _store_input_grads(self, key, inputs: list[torch.Tensor], grads: Sequence) -> None:
        """One entry per tensor of the received message: its gradient, or None where it required none."""
        if key[0] == 0:
            return  # the first stage's inputs are data
        remaining = iter(grads)
        self._grads_in[key] = tuple(next(remaining) if tensor.requires_grad else None for tensor in inputs)

    # -- communication ------------------------------------------------------------------------

    def _send_forward(self, stage: int, micro_batch: int) -> None:
        key = (stage, micro_batch)
        outputs = self._outputs[key]
        self._transfer("send", "act", stage + 1, stage, micro_batch, outputs, self.schedule.micro_batches,
                       self._batch_size)
        _free_storage(outputs.tensors, self._saved.pop(key, None))

    def _send_inferred(self, stage: int, micro_batch: int) -> None:
        outputs = self._outputs.pop((stage, micro_batch))
        self._transfer("send", "act", stage + 1, stage, micro_batch, outputs, self._micro_batches)

    def _recv_forward(self, stage: int, micro_batch: int) -> None:
        received = self._transfer("recv", "act", stage - 1, stage, micro_batch)
        self._batch_size = received.batch_size  # passed on to the next stage
        self._received[(stage, micro_batch)] = received

    def _send_backward(self, stage: int, micro_batch: int) -> None:
        grads = self._grads_in.pop((stage, micro_batch))
        self._transfer("send", "grad", stage - 1, stage, micro_batch, grads)

    def _recv_backward(self, stage: int, micro_batch: int) -> None:
        self._grads_out[(stage, micro_batch)] = self._transfer("recv", "grad", stage + 1, stage, micro_batch)

    def _transfer(self, direction: str, kind: str, peer_stage: int, stage: int, micro_batch: int, *message):
        """A send (of ``message``) or receive on the activation (StructureChannel) or gradient channel to a peer stage."""
        channel = self.channels[(self.schedule.stage_rank(peer_stage), kind)]
        with naming_transfer(self.rank, stage, micro_batch, direction, "activation" if kind == "act" else "gradient",
                             peer_stage):
            if direction == "send":
                channel.send(*message)
                return None
            return channel.recv()


@contextlib.contextmanager
def naming_transfer(rank: int, stage: int, micro_batch: int, direction: str, what: str, peer_stage: int):
    """Channel errors and timeouts inside get the rank, stage, micro-batch and action in front of their message."""
    try:
        yield
    except (ChannelError, TimeoutError) as error:
        action = f"{direction} of the {what} {'to' if direction == 'send' else 'from'} stage {peer_stage}"
        raise type(error)(f"pipeline rank {rank}, stage {stage}, micro-batch {micro_batch}, {action}: {error}") from error
