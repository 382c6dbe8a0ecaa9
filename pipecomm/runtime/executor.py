"""Runs one rank's schedule: dispatches each action to its stage's runner or channel, in the schedule's order."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from pipecomm.runtime import boundary
from pipecomm.runtime.device_timing import DeviceTimeline
from pipecomm.runtime.failure import NOTE_PREFIX
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.loss_average import AverageCheck
from pipecomm.runtime.microbatch import any_requires_grad, check_received_batch, check_target_batch
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.schedules.schedule import Action, Schedule, forward_schedule
from pipecomm.schedules.validation import validate
from pipecomm.runtime.split_backward import WeightGradStore
from pipecomm.runtime.rank_graphs import RankGraphs
from pipecomm.runtime.graph_runner import GraphRunner, make_runner, reclaim_graph_memory
from pipecomm.runtime.stage_runner import EagerStage
from pipecomm.runtime.stage_transfers import StageTransfers
from pipecomm.transport.channel import Channel

__all__: list[str] = []


class StageExecutor:
    """Executes a rank's actions for one step: each compute action goes to its stage's runner (``stage_runner``), each
    transfer to its channel; holds nothing between steps but the timeline."""

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
        cuda_graphs: bool | str = False,
        device_timeline: DeviceTimeline | None = None,
    ):
        self.schedule = schedule
        self.rank = rank
        self.transfers = StageTransfers(rank, schedule, channels)
        self.loss_fn = loss_fn
        self.last_stage = schedule.num_stages - 1
        self._average_check = AverageCheck(loss_fn, rank) if self.last_stage in modules else None
        self.on_stage_backward_done = on_stage_backward_done
        self.device_timeline = device_timeline
        self.stages: dict[int, EagerStage] = {}
        rank_graphs = RankGraphs(schedule, rank)  # what the rank's graphed stages share
        for stage, module in modules.items():
            loss = self._scaled_loss if stage == self.last_stage else None
            store = weight_grad_store if schedule.splits_backward(rank, stage) else None
            # Graphed ones are built (and the schedule checked) here, before any communication; captured at an F.
            self.stages[stage] = make_runner(module, sinks[stage], stage, loss, store, rank, schedule, cuda_graphs,
                                             rank_graphs)
        self.timeline: list[tuple[float, float, Action]] = []
        self.offloader: ActivationOffloader | None = None
        self._reloads: dict[int, list] = {}  # action index -> the waits whose copies back start before it
        self._handlers = {
            "F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight,
            "SEND_F": self._send_forward, "RECV_F": self._recv_forward,
            "SEND_B": self._send_backward, "RECV_B": self._recv_backward,
        }

    def switch_schedule(self, schedule: Schedule, weight_grad_store: WeightGradStore | None,
                        device_timing: bool) -> None:
        """From the next step on, ``schedule`` (on the same placement): the stages it gives I passes defer to
        ``weight_grad_store``, the others to none; without ``device_timing``, no device timeline."""
        self.schedule = schedule
        for stage, runner in self.stages.items():
            runner.adopt_schedule(schedule, weight_grad_store if schedule.splits_backward(self.rank, stage) else None)
        if not device_timing:
            self.device_timeline = None
        self.set_offload(None, {})  # an offload plan is one schedule's

    def hold_graphs(self, held: bool) -> None:
        """While ``held``, graphed stages not captured yet run eagerly: the steps being measured for a schedule must
        not pay a capture, nor some be graphed and others not, and graphs captured in them would follow the order
        they are measured for."""
        for runner in self.stages.values():
            if isinstance(runner, GraphRunner):
                runner.held = held

    def release_graphs(self) -> None:
        """Every graphed stage's graphs and their memory let go now (the Pipeline closes), not when a collection finds
        them: until then their pools hold memory that nothing else can use. Reclaimed once: a rank's stages share
        one pool, which only the last one dropped frees."""
        graphed = [runner for runner in self.stages.values() if isinstance(runner, GraphRunner)]
        dropped = [runner.drop_graphs(reclaim=False) for runner in graphed]
        if any(dropped):
            reclaim_graph_memory()

    def graph_states(self) -> dict[int, str]:
        """Each stage's CUDA graphs: ``GraphRunner.state``, or "eager" where the stage never captures."""
        return {stage: runner.state if isinstance(runner, GraphRunner) else "eager"
                for stage, runner in self.stages.items()}

    def set_offload(self, offloader: ActivationOffloader | None, reloads: dict[int, list]) -> None:
        """From the next step on, activations go to host memory through ``offloader`` (None: stay), the copies back
        starting before the actions ``reloads`` gives (``OffloadPlan.reloads_at``)."""
        self.offloader = offloader
        self._reloads = reloads if offloader else {}
        for runner in self.stages.values():
            runner.offloader = offloader

    def run(self, inputs: list[tuple[tuple, dict]] | None, targets: list[tuple] | None,
            batch_size: int | None = None, target_batch: int | None = None) -> torch.Tensor | None:
        """One training step over all micro-batches (``inputs``: each one's positional and keyword arguments of the
        first stage); returns the summed (already 1/m-scaled) losses on the last stage.

        ``batch_size`` is the batch's on the first stage; later stages learn it from the activations and the
        last one checks that its targets' batch size, ``target_batch``, matches.
        """
        self._start(inputs, targets, batch_size, target_batch, self.schedule.micro_batches)
        if self.last_stage in self.stages:
            check_target_batch(batch_size, target_batch)  # a one-rank pipeline's own batch; the others' arrives with it
            self._average_check.see(targets)
        self.timeline = []
        handlers = self._handlers
        device = self.device_timeline
        if device:
            device.start_step()
        reloads = self._reloads
        action = None
        try:
            for index, action in enumerate(self.schedule.actions[self.rank]):
                started = time.perf_counter()
                if reloads and index in reloads:
                    for wait in reloads[index]:
                        self.offloader.reload(wait)
                timed = device is not None and action.is_compute
                if timed:
                    device.mark()
                handlers[action.kind](action.stage, action.micro_batch)
                if timed:
                    device.mark()
                self.timeline.append((started, time.perf_counter(), action))
        except Exception as error:
            _note_action(error, action, self.rank)
            raise
        if device:
            device.end_step()
        self.transfers.settle_gradients()
        for runner in self.stages.values():
            runner.step_done()
        return self._loss

    def infer(self, inputs: list[tuple[tuple, dict]] | None, batch_size: int | None = None) -> list | None:
        """Inference over the forward-only schedule on this schedule's placement; returns the last stage's output of each micro-batch
        (None on a rank without the last stage).

        ``inputs`` (and their whole ``batch_size``) are given on the first stage's rank; a rank without that stage
        learns how many micro-batches there are from its first message, which is always the first action of its
        forward-only schedule, and the batch size (``inferred_batch_size``) from the messages.
        """
        self._start(inputs, None, batch_size, None, None)
        self._inferred: list = []
        first_message = None
        if inputs is None:
            first_message = Action("RECV_F", min(self.stages), 0)
            self._recv_forward(first_message.stage, 0)
            self._micro_batches = self.stages[first_message.stage].record(0).received.micro_batches
        else:
            self._micro_batches = len(inputs)
        handlers = {"F": self._infer, "SEND_F": self._send_inferred, "RECV_F": self._recv_forward}
        inference = validated_forward_schedule(self.schedule.num_ranks, self._micro_batches, self.schedule.placement)
        action = None
        try:
            for action in inference.actions[self.rank]:
                if action != first_message:
                    handlers[action.kind](action.stage, action.micro_batch)
        except Exception as error:
            _note_action(error, action, self.rank)
            raise
        return self._inferred if self.last_stage in self.stages else None

    inferred_batch_size = property(lambda self: self._batch_size,
                                   doc="The last inference's whole batch size, as the first stage split it.")

    def _start(self, inputs, targets, batch_size: int | None, target_batch: int | None,
               micro_batches: int | None) -> None:
        """Per-call state: what a step or an inference reads and fills as its actions run."""
        self._inputs, self._targets = inputs, targets
        self._batch_size, self._target_batch = batch_size, target_batch
        # Whether the caller's inputs or targets require grad (each micro-batch's do alike): one look per step.
        self._inputs_need_grad, self._targets_need_grad = _requires_grad(inputs), _requires_grad(targets)
        self._micro_batches = micro_batches
        for runner in self.stages.values():
            runner.start(training=micro_batches is not None)
        if self.offloader:
            self.offloader.start()
        self._loss: torch.Tensor | None = None
        self._backwards_done: dict[int, int] = dict.fromkeys(self.stages, 0)
        self.transfers.start(training=micro_batches is not None)

    def leaves_beside(self) -> list[torch.Tensor]:
        """The tensors this step trained beside the stages' parameters (parameters loss_fn holds, tensors a stage
        keeps outside its modules' parameters), each once."""
        return list({id(tensor): tensor for runner in self.stages.values()
                     for tensor in runner.beside.values()}.values())

    # -- compute -------------------------------------------------------------------------------

    def _scaled_loss(self, output, *targets) -> torch.Tensor:
        # The one place the loss is scaled: the step's gradients then average the micro-batches.
        loss = self.loss_fn(output, *targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            # loss.backward() in one process refuses these too; a per-sample loss would silently be summed.
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return the micro-batch's loss as a tensor of one element, as "
                            f"loss.backward() needs, but it returned {what}; reduce it (.mean(), .sum()) or return "
                            "the loss alone")
        if not loss.requires_grad and any(tensor.requires_grad for tensor in boundary.flatten(output).tensors):
            # The step would return the loss and train nothing; loss.backward() in one process raises here. (A model
            # frozen whole, whose output requires no grad either, steps as before: nothing to train.)
            raise RuntimeError("loss_fn returned a loss that does not require grad from an output that does, so no "
                               "gradient would reach any parameter (loss.backward() in one process raises here): "
                               "it detached the output or computed the loss under torch.no_grad()")
        return (loss if loss.dim() == 0 else loss.reshape(())) / self.schedule.micro_batches

    def _callers_tensors(self, stage: int, args: tuple, kwargs: dict, targets: tuple) -> list[torch.Tensor]:
        """The caller's tensors among a micro-batch's first-stage arguments and last-stage targets that require grad:
        their gradients go on into the caller's autograd graph, as ``loss.backward()`` in one process sends them."""
        parts = [(args, kwargs)] if stage == 0 and self._inputs_need_grad else []
        if stage == self.last_stage and self._targets_need_grad:
            parts.append(targets)
        return [tensor for part in parts for tensor in boundary.flatten(part).tensors if tensor.requires_grad]

    def _stage_arguments(self, stage: int, micro_batch: int) -> tuple[tuple, dict, list[torch.Tensor]]:
        """A forward's positional and keyword arguments, and the received tensors among them (none on the first
        stage, whose inputs are data)."""
        if stage == 0:
            return *self._inputs[micro_batch], []
        held = self.stages[stage].record(micro_batch)
        received, held.received = held.received, None
        check_received_batch(received.micro_batches, self._micro_batches, self.rank)
        if stage == self.last_stage:
            check_target_batch(received.batch_size, self._target_batch)
        return boundary.as_arguments(received.structure), {}, received.tensors

    def _forward(self, stage: int, micro_batch: int) -> None:
        args, kwargs, received = self._stage_arguments(stage, micro_batch)
        targets = self._targets[micro_batch] if stage == self.last_stage else ()
        loss = self.stages[stage].forward(micro_batch, args, kwargs, received, targets,
                                          self._callers_tensors(stage, args, kwargs, targets))
        if loss is not None:
            self._loss = loss if self._loss is None else self._loss + loss

    def _infer(self, stage: int, micro_batch: int) -> None:
        args, kwargs, _ = self._stage_arguments(stage, micro_batch)
        output = self.stages[stage].infer(micro_batch, args, kwargs)
        if stage == self.last_stage:
            self._inferred.append(output)

    def _backward(self, stage: int, micro_batch: int) -> None:
        self.stages[stage].backward(micro_batch)
        self._count_backward(stage)

    def _backward_input(self, stage: int, micro_batch: int) -> None:
        self.stages[stage].backward_input(micro_batch)

    def _backward_weight(self, stage: int, micro_batch: int) -> None:
        self.stages[stage].backward_weight(micro_batch)
        self._count_backward(stage)

    def _count_backward(self, stage: int) -> None:
        """Tells the data-parallel reducer when a stage's gradients are final for this step."""
        self._backwards_done[stage] += 1
        if self._backwards_done[stage] == self.schedule.micro_batches and self.on_stage_backward_done:
            self.on_stage_backward_done(stage)

    # -- communication ------------------------------------------------------------------------

    def _send_forward(self, stage: int, micro_batch: int) -> None:
        runner = self.stages[stage]
        self.transfers.send_activation(stage, micro_batch, runner.record(micro_batch).outputs,
                                       self.schedule.micro_batches, self._batch_size)
        runner.outputs_sent(micro_batch, lambda: self.transfers.send_read_event(stage, "act"))

    def _send_inferred(self, stage: int, micro_batch: int) -> None:
        held = self.stages[stage].micro_batches.pop(micro_batch)
        self.transfers.send_activation(stage, micro_batch, held.outputs, self._micro_batches, self._batch_size)

    def _recv_forward(self, stage: int, micro_batch: int) -> None:
        received = self.transfers.recv_activation(stage, micro_batch)
        self._batch_size = received.batch_size  # passed on to the next stage
        self.stages[stage].record(micro_batch).received = received

    def _send_backward(self, stage: int, micro_batch: int) -> None:
        runner = self.stages[stage]
        self.transfers.send_gradient(stage, micro_batch, runner.take_input_grads(micro_batch))
        runner.input_grads_sent(micro_batch, lambda: self.transfers.send_read_event(stage, "grad"))

    def _recv_backward(self, stage: int, micro_batch: int) -> None:
        self.stages[stage].record(micro_batch).output_grads = self.transfers.recv_gradient(stage, micro_batch)


@functools.lru_cache(maxsize=16)
def validated_forward_schedule(num_ranks: int, micro_batches: int, placement: tuple[int, ...]) -> Schedule:
    """Inference's schedule on ``placement`` for ``micro_batches``, built and validated once per count."""
    schedule = forward_schedule(num_ranks, micro_batches, placement)
    validate(schedule)
    return schedule


def _requires_grad(micro_batches: list | None) -> bool:
    """Whether any tensor of the first of a step's micro-batch structures requires grad."""
    return bool(micro_batches) and any_requires_grad(micro_batches[0])


_PASSES = {"F": "forward", "B": "backward", "I": "I pass (input gradients)", "W": "W pass (weight gradients)"}


_LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"


def _note_action(error: Exception, action: Action | None, rank: int) -> None:
    """Adds to an error where in the schedule it came from, if a compute action's (the transfers name their own), and
    for an in-place op on a leaf in a later stage's forward, why one process let it be."""
    if action is not None and action.kind in _PASSES:
        error.add_note(f"{NOTE_PREFIX}in the {_PASSES[action.kind]} of stage {action.stage}, micro-batch "
                       f"{action.micro_batch}, on pipeline rank {rank}")
        if action.kind == "F" and action.stage > 0 and _LEAF_IN_PLACE in str(error):
            error.add_note(f"{NOTE_PREFIX}if that leaf is one of stage {action.stage}'s inputs: they arrive from stage "
                           f"{action.stage - 1} as leaves that require grad, for their gradient to go back, where one "
                           "process has them as another op's outputs; change a copy (x = x.clone()) or do it out of "
                           "place")
