"""Runs one rank's schedule: forwards and backwards of its stages, the sends and receives between them, gradient accumulation."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipecomm._ops import accumulate_
from pipecomm.cuda_graphs import GraphedStage, in_flight_slots
from pipecomm.device_timing import DeviceTimeline
from pipecomm.schedule import Action, Schedule
from pipecomm.split_backward import DeferredGrad, WeightGradStore, weight_grad
from pipecomm.transport import Channel, ChannelError

__all__: list[str] = []

# accumulate_ kernels exist for these (accumulator, grad) pairs; others fall back to add_.
_NATIVE_PAIRS = {
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
}


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                  keep_graph: bool) -> tuple:
    """Gradients of ``outputs`` w.r.t. ``inputs`` without accumulating into ``.grad``.

    Goes to the autograd engine directly, as Megatron does, because the outputs' storage was freed
    after they were sent and torch.autograd.grad would reject their placeholder shapes.
    """
    pairs = [(out, grad) for out, grad in zip(outputs, grads) if isinstance(out, torch.Tensor) and out.requires_grad]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    tensors, grad_tensors = zip(*pairs)
    return torch.autograd.Variable._execution_engine.run_backward(
        tensors, grad_tensors, keep_graph, False, tuple(inputs), True, False
    )


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.clone() if tensor is not None else None


def _free_storage(outputs: tuple) -> None:
    """Drops the data of sent outputs while their autograd nodes live on (Megatron's deallocate_output_tensor).

    Safe: an op that saved its own output for backward saved a shallow copy holding the old storage.
    """
    for tensor in outputs:
        if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None and tensor._base is None:
            tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


class GradientSink:
    """Where a stage's parameter gradients go: ``.grad`` (default) or flat fp32 ``main_grad`` buffers."""

    def __init__(self, params: list[nn.Parameter], main_grad: bool):
        self.params = params
        self.main_grad = main_grad
        if main_grad:
            low_precision = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
            total = sum(p.numel() for p in low_precision)
            device = low_precision[0].device if low_precision else None
            self.flat_main_grad = torch.zeros(total, dtype=torch.float32, device=device) if low_precision else None
            offset = 0
            for param in low_precision:
                param.main_grad = self.flat_main_grad[offset : offset + param.numel()].view_as(param)
                offset += param.numel()

    def target(self, param: nn.Parameter) -> torch.Tensor | None:
        if self.main_grad and hasattr(param, "main_grad"):
            return param.main_grad
        return param.grad

    def add(self, grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter] | None = None) -> None:
        """Adds one micro-batch's gradients of ``params`` (default: all): one fused launch per dtype pair."""
        accumulators, sources = [], []
        for param, grad in zip(self.params if params is None else params, grads):
            if grad is None:
                continue
            target = self.target(param)
            if target is None:
                # A copy: autograd may hand back one tensor for several parameters, or an expanded view.
                param.grad = grad.clone(memory_format=torch.contiguous_format)
            elif (target.dtype, grad.dtype) in _NATIVE_PAIRS:
                accumulators.append(target)
                sources.append(grad)
            else:
                target.add_(grad)
        accumulate_(accumulators, sources)

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
        channels: dict[tuple[int, str], Channel],
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
                                self._scaled_loss if stage == self.last_stage else None)
            for stage, module in modules.items()
        } if cuda_graphs else {}
        self.timeline: list[tuple[float, float, Action]] = []

    def run(self, inputs: list[tuple] | None, targets: list[tuple] | None) -> torch.Tensor | None:
        """One training step over all micro-batches; returns the summed (already 1/m-scaled) losses on the last stage."""
        self._inputs, self._targets = inputs, targets
        self._received: dict[tuple[int, int], tuple] = {}
        self._stage_inputs: dict[tuple[int, int], tuple] = {}
        self._outputs: dict[tuple[int, int], tuple] = {}
        self._grads_out: dict[tuple[int, int], tuple | None] = {}
        self._grads_in: dict[tuple[int, int], tuple] = {}
        self._deferred: dict[tuple[int, int], list[DeferredGrad]] = {}
        self._deferred_weights: dict[tuple[int, int], set[int]] = {}
        self._loss: torch.Tensor | None = None
        self._backwards_done: dict[int, int] = dict.fromkeys(self.modules, 0)
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

    # -- compute -------------------------------------------------------------------------------

    def _scaled_loss(self, output, *targets) -> torch.Tensor:
        # The one place the loss is scaled: the step's gradients then average the micro-batches.
        return self.loss_fn(output, *targets) / self.schedule.micro_batches

    def _forward(self, stage: int, micro_batch: int) -> None:
        key = (stage, micro_batch)
        last = stage == self.last_stage
        args = self._inputs[micro_batch] if stage == 0 else self._received.pop(key)
        graphed = self.graphed.get(stage)
        if graphed:
            self._stage_inputs[key] = args
            outputs = graphed.forward(micro_batch, args, self._targets[micro_batch] if last else ())
            if last:
                self._add_loss(outputs[0].clone())  # the graph's loss buffer is rewritten by the next replay
            self._outputs[key] = outputs
            return
        if stage > 0:
            # Received activations become leaves whose grads are sent back to the previous stage.
            args = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                         for t in args)
        self._stage_inputs[key] = args
        store = self.weight_grad_store
        if store:
            store.recording = self._deferred_weights[key] = set()
        try:
            output = self.modules[stage](*args)
        finally:
            if store:
                store.recording = None
        if last:
            loss = self._scaled_loss(output, *self._targets[micro_batch])
            self._outputs[key] = (loss,)
            self._grads_out[key] = (torch.ones_like(loss),)
            self._add_loss(loss.detach())
        else:
            self._outputs[key] = _as_tuple(output)

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
        """Input grads and the cheap parameter grads now (the critical path); Linear weight grads wait for W."""
        key = (stage, micro_batch)
        deferred_weights = self._deferred_weights.pop(key)
        # Not asking for the deferred weights is what makes autograd skip their GEMMs.
        params = [p for p in self.sinks[stage].params if id(p) not in deferred_weights]
        deferred: list[DeferredGrad] = []
        self.weight_grad_store.collecting = deferred
        try:
            self._run_stage_backward(stage, micro_batch, params)
        finally:
            self.weight_grad_store.collecting = None
        self._deferred[key] = deferred

    def _backward_weight(self, stage: int, micro_batch: int) -> None:
        self.sinks[stage].add_weight_grads(self._deferred.pop((stage, micro_batch)))
        self._count_backward(stage)

    def _run_stage_backward(self, stage: int, micro_batch: int, params: list[nn.Parameter] | None = None) -> None:
        """Backward of a micro-batch towards the stage's inputs and ``params`` (default: all its parameters)."""
        key = (stage, micro_batch)
        outputs, grads = self._outputs.pop(key), self._grads_out.pop(key)
        inputs = self._stage_inputs.pop(key)
        wanted = self._grad_inputs(inputs)
        params = self.sinks[stage].params if params is None else params
        results = _run_backward(outputs, grads, wanted + params, keep_graph=False)
        self._store_input_grads(key, inputs, results[: len(wanted)])
        self.sinks[stage].add(results[len(wanted) :], params)

    def _count_backward(self, stage: int) -> None:
        """Tells the data-parallel reducer when a stage's gradients are final for this step."""
        self._backwards_done[stage] += 1
        if self._backwards_done[stage] == self.schedule.micro_batches and self.on_stage_backward_done:
            self.on_stage_backward_done(stage)

    @staticmethod
    def _grad_inputs(inputs: tuple) -> list[torch.Tensor]:
        return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def _store_input_grads(self, key, inputs: tuple, grads: Sequence) -> None:
        if key[0] == 0:
            return  # the first stage's inputs are data
        remaining = iter(grads)
        self._grads_in[key] = tuple(
            next(remaining) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs
        )

    # -- communication ------------------------------------------------------------------------

    def _send_forward(self, stage: int, micro_batch: int) -> None:
        outputs = self._outputs[(stage, micro_batch)]
        message = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outputs)
        self._transfer("send", "act", stage + 1, stage, micro_batch, message)
        _free_storage(outputs)

    def _recv_forward(self, stage: int, micro_batch: int) -> None:
        self._received[(stage, micro_batch)] = self._transfer("recv", "act", stage - 1, stage, micro_batch)

    def _send_backward(self, stage: int, micro_batch: int) -> None:
        grads = self._grads_in.pop((stage, micro_batch))
        self._transfer("send", "grad", stage - 1, stage, micro_batch, grads)

    def _recv_backward(self, stage: int, micro_batch: int) -> None:
        self._grads_out[(stage, micro_batch)] = self._transfer("recv", "grad", stage + 1, stage, micro_batch)

    def _transfer(self, direction: str, kind: str, peer_stage: int, stage: int, micro_batch: int, message=None):
        channel = self.channels[(self.schedule.stage_rank(peer_stage), kind)]
        what = "activation" if kind == "act" else "gradient"
        try:
            if direction == "send":
                channel.send(message)
                return None
            return channel.recv()
        except (ChannelError, TimeoutError) as error:
            action = f"{direction} of the {what} {'to' if direction == 'send' else 'from'} stage {peer_stage}"
            raise type(error)(
                f"pipeline rank {self.rank}, stage {stage}, micro-batch {micro_batch}, {action}: {error}"
            ) from error
