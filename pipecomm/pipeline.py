"""The user API: one rank's part of a pipeline, driven by ``step()`` inside an ordinary training loop.

A Pipeline is a facade: its stages' runs are the executor's (``executor``, ``stage_runner``), its channels the
links' (``links``), its collectives ``pipeline_collectives``'s, its gradients the finalizer's
(``gradient_finalizer``), its calls' failures the protocol's (``fail_fast``), its refusals ``pipeline_checks``'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import transport
from pipecomm.runtime import fail_fast, microbatch, step_trace
from pipecomm.schedules.auto_schedule import CostMeter, initial_schedule
from pipecomm.runtime.device_timing import DeviceTimeline
from pipecomm.runtime.executor import StageExecutor
from pipecomm.parallel.gradient_finalizer import GradientFinalizer
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.parallel.grad_sync import SharedParameters
from pipecomm.runtime.links import NeighbourLinks
from pipecomm.parallel.mesh import global_rank
from pipecomm.runtime.checks import check_configuration, check_options, check_schedule, module_device
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.schedules.planner import plan_schedule
from pipecomm.runtime.recompute import checkpoint_stages
from pipecomm.schedules.schedule import Schedule, forward_schedule, make_schedule
from pipecomm.schedules.validation import validate
from pipecomm.parallel.sharded_stages import ShardedStages
from pipecomm.runtime.split_backward import WeightGradStore, defer_linear_weight_grads, warn_if_nothing_deferred

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's stages of a pipeline-parallel model.

    Replace ``loss = loss_fn(model(x), y); loss.backward()`` with ``loss = pipe.step(x, target=y)``:
    afterwards every parameter's ``.grad`` holds what that single-process backward on the whole
    batch gives, so any optimizer works unchanged; frozen parameters (``requires_grad=False``, read
    at every step) keep no gradient. Every rank may call ``step`` with the same arguments; the first
    stage reads the inputs, the last ``target``, the others may pass None.

    A stage may return any pytree (tensors, tuples, lists, dicts, None, dataclasses, transformers
    ModelOutputs, with non-tensor leaves such as ints); the next stage receives that structure, a
    tuple unpacked into positional arguments and anything else as its one argument, and the last
    stage's ``loss_fn(output, *targets)`` the model's output. Only tensors that require grad on the
    sending stage require grad on the receiving one and get a gradient sent back.

    ``module``/``stage`` are one module and its stage index, or lists of them for schedules with
    several stages per rank (interleaved-1f1b: rank r holds stages r, r + p, r + 2p, ...; zb-v: r
    and 2p - 1 - r). ``schedule`` is a name of ``pipecomm.schedules.schedule.SCHEDULES``, a ``Schedule``
    (``pipecomm.make_schedule``, e.g. zb-v built for measured costs) or ``"auto"``: the first three
    steps run zb-h1 (one stage per rank) or zb-v (two in a V) and time each rank's F, I and W (on
    GPUs with CUDA events), then every rank switches to ``pipecomm.plan_schedule``'s plan for the
    slowest rank's costs at 1f1b's activation memory (``pipe.schedule``, ``pipe.planned_costs``).
    ``group`` is the pipeline's process group, ordered by stage (default: the whole world);
    ``data_group`` holds this stage's data-parallel replicas, whose gradients are averaged
    (``pipecomm.init`` makes both).
    Parameters that ``pipecomm.split`` found shared between stages (a tied embedding and LM head)
    start from the lowest holder's value and have their gradients summed across the holders.
    Stage modules may hold torch's ``fully_shard`` modules (FSDP2 over the data-parallel mesh): they stay
    gathered through a step and have their gradients reduce-scattered once, after the stage's last
    backward, and resharded; ``data_group``'s all-reduce then covers only the other parameters. Tensor-
    parallel layers (``parallelize_module``) work as they are, each tp rank of a stage talking to the same
    tp rank of the next; a DTensor output crosses as its local shard and is rebuilt with its placements on
    the receiving rank's mesh of the same dimension names (``pipecomm.init``'s).
    ``cuda_graphs=True`` captures each stage's forward and backward as CUDA graphs at the first
    step and replays them, for small models bound by kernel launches; shapes must then stay fixed
    (every schedule whose passes of a stage run in forward order, the zero-bubble ones with their I and W as
    separate graphs; not "auto"). ``device_timing=True`` times compute actions with CUDA
    events, so that ``bubble_fraction()`` reports the GPU's bubble.
    ``recompute=True`` recomputes each stage's forward during its backward (activation checkpointing),
    keeping only the stage's inputs between the two; a callable ``module -> bool`` checkpoints only the
    submodules it picks (selective recomputation, as Megatron's ``recompute_modules``).

    **Failures.** If a call fails on one rank (a bad batch, an error in a stage or the loss, a dead
    peer), that rank publishes its error through the job's store and closes its channels; every
    other rank's call then raises within seconds, wherever it waits (a channel, the loss or result
    broadcast, a gradient all-reduce, the start of its next call): a ``PeerFailedError`` whose
    message holds the failed rank's error, or a ``PeerDiedError`` if that process died without a
    word. Afterwards every rank's Pipeline refuses further calls; build a new one.

    **Threads.** Pipelines are not thread-safe: on one process, calls of Pipelines (``step``,
    ``forward``, ``clip_grad_norm_``, ``trace``) must not overlap, since their collectives would
    interleave on the process groups. An overlapping call raises and fails its Pipeline, on every rank.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        *,
        stage: int | Sequence[int],
        num_stages: int,
        loss_fn: Callable,
        micro_batches: int,
        schedule: str | Schedule = "1f1b",
        group: dist.ProcessGroup | None = None,
        data_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        transport: str = "auto",
        timeout: float = transport.DEFAULT_TIMEOUT,
        main_grad: bool = False,
        cuda_graphs: bool = False,
        device_timing: bool = False,
        recompute: bool | Callable[[nn.Module], bool] = False,
    ):
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.group = group
        self.timeout = timeout
        self.num_ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.stages = sorted(stages)
        # First, so that a failure while building is published and peers waiting to connect stop at once.
        self.calls = fail_fast.CallProtocol(self.rank, global_rank(group, self.rank), self.stages, self._abort)
        self._links = NeighbourLinks()
        self._undo_deferral: Callable[[], None] = lambda: None
        self._undo_recompute: Callable[[], None] = lambda: None
        self._deferral_checked = False
        self._forward_schedules: dict[int, Schedule] = {}  # inference's, per micro-batch count
        self.planned_costs: dict[str, float] | None = None  # schedule="auto": the F, I and W it planned for
        with self.calls.failing("building the Pipeline"):
            check_configuration(modules, stages, num_stages, self.num_ranks, schedule)
            self._costs = CostMeter() if schedule == "auto" else None  # until "auto" has planned
            if isinstance(schedule, Schedule):
                self.schedule: Schedule = schedule
            elif self._costs is not None:
                self.schedule = initial_schedule(self.num_ranks, micro_batches, stages, self.rank)
            else:
                self.schedule = make_schedule(schedule, self.num_ranks, micro_batches, len(stages))
            check_schedule(self.schedule, stages, self.rank, micro_batches)
            validate(self.schedule)
            self.num_stages = num_stages
            self.micro_batches = micro_batches
            self.modules = dict(zip(stages, modules))
            self.device = torch.device(device) if device is not None else module_device(modules)
            sharded = self._sharded = ShardedStages(self.modules)
            check_options(self.device, auto=self._costs is not None, sharded=bool(sharded), cuda_graphs=cuda_graphs,
                          device_timing=device_timing, main_grad=main_grad)
            self._sinks = {s: GradientSink(list(self.modules[s].parameters()), main_grad,
                                           live=self.modules[s] if sharded.holds(s) else None)
                           for s in self.stages}
            splits_backward = any(action.kind == "I" for action in self.schedule.actions[self.rank])
            store = WeightGradStore() if splits_backward else None
            self._executor = StageExecutor(
                self.schedule, self.rank, self.modules, self._sinks, self._links.channels, loss_fn,
                on_stage_backward_done=lambda stage: self._gradients.stage_done(stage),
                weight_grad_store=store, cuda_graphs=cuda_graphs,
                device_timeline=(DeviceTimeline(self.device)
                                 if device_timing or (self._costs is not None and self.device.type == "cuda") else None),
            )
            self._device_timing = device_timing
            if store:
                self._undo_deferral = defer_linear_weight_grads(modules, store)
            # After the deferral: a recomputed Linear then recomputes the deferring forward.
            self._undo_recompute = checkpoint_stages(modules, recompute, cuda_graphs=cuda_graphs)
            self._links.connect(self.schedule, self.rank, group, self.device, transport, timeout,
                                self.calls.peer_failures)
            self._collectives = PipelineCollectives(group, self.rank, self.schedule.stage_rank(num_stages - 1),
                                                    self.device, self.calls, timeout)
            shared = (SharedParameters(self.modules, lambda s: global_rank(group, self.schedule.stage_rank(s)))
                      if dist.is_initialized() else None)
            self._gradients = GradientFinalizer(self._sinks, sharded, data_group, shared, self._collectives)
        fail_fast.track(self, several_ranks=self.num_ranks > 1)

    def parameters(self) -> Iterator[nn.Parameter]:
        for stage in self.stages:
            yield from self.modules[stage].parameters()

    def step(self, *inputs, target=None, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean micro-batch loss on every rank.

        ``inputs`` and ``kwargs`` (e.g. ``attention_mask=``) are the first stage's positional and keyword
        arguments, ``target`` (a tuple: several) the arguments of ``loss_fn`` after the output; any of
        them may be pytrees, whose tensors are split along dim 0 into the micro-batches (every tensor
        of the inputs and the targets must have the same batch size there). A failure on any rank,
        bad arguments included, fails the call on every rank (see the class docstring).
        """
        with self.calls.call("step"):
            split_inputs = split_targets = batch = target_batch = None
            if 0 in self.stages:
                if not inputs and not kwargs:
                    raise ValueError("step: the first stage needs the batch inputs")
                batch_inputs = microbatch.Batch(inputs, kwargs)
                batch = microbatch.batch_size(batch_inputs, "")
                split_inputs = microbatch.split(batch_inputs, self.micro_batches, "", self.device)
            if self.num_stages - 1 in self.stages:
                if target is None:
                    raise ValueError("step: the last stage needs target=")
                targets = target if isinstance(target, tuple) else (target,)
                target_batch = microbatch.batch_size(targets, "target")
                split_targets = microbatch.split(targets, self.micro_batches, "target", self.device)
            loss = self._executor.run(split_inputs, split_targets, batch, target_batch)
            if not self._deferral_checked and self._executor.weight_grad_store:  # after the first step only
                self._deferral_checked = True
                warn_if_nothing_deferred(self._executor.weight_grad_store, f"Pipeline rank {self.rank}",
                                         self.schedule.name, self.stages)
            if self._costs is not None and self._costs.add_step(lambda: step_trace.compute_spans(self._executor)):
                self._switch_to_plan()
            self._gradients.finish_step()
            if self.num_ranks == 1:
                return loss
            return self._collectives.broadcast_loss(loss)

    @torch.no_grad()
    def forward(self, *inputs, broadcast_result: bool = False, **kwargs):
        """Inference, micro-batched, without autograd: the full-batch output on the last stage (None elsewhere).

        Any batch size works: it is split into min(batch size, micro_batches) micro-batches, unevenly if
        need be; only the first stage's rank needs the inputs. The result has the structure the model
        returns, each tensor leaf concatenated over the micro-batches along dim 0 (0-d tensors stacked);
        non-tensor leaves must be equal across micro-batches. With ``broadcast_result=True`` every rank
        of the pipeline gets it (autoregressive decoding). Failures behave as in ``step``.
        """
        with self.calls.call("forward"):
            split_inputs = None
            if 0 in self.stages:
                split_inputs = microbatch.split(microbatch.Batch(inputs, kwargs), self.micro_batches, "",
                                                self.device, uneven=True)
            outputs = self._executor.infer(split_inputs, self._forward_schedule)
            self._sharded.reshard()
            result = microbatch.join(outputs) if outputs else None
            if broadcast_result and self.num_ranks > 1:
                result = self._collectives.broadcast_result(result)
            return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every stage's gradients by the global norm across the whole pipeline; returns that norm."""
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, not {norm_type}")
        with self.calls.call("clip_grad_norm_"):
            return self._gradients.clip_grad_norm_(max_norm, norm_type, several_ranks=self.num_ranks > 1)

    def bubble_fraction(self) -> float:
        """This rank's idle share of the last step: 1 - time in compute actions / the step's span.

        With ``device_timing=True`` the times are the GPU's (CUDA events around each compute action;
        reading them waits for the step to finish on the GPU). Otherwise they come from the host
        clock, which on GPUs measures launch time, since the host runs ahead of the device.
        """
        return step_trace.bubble_fraction(self._executor)

    def trace(self, path: str) -> None:
        """Writes a Chrome trace (chrome://tracing, Perfetto) of the last step's actions on every rank.

        Collective: every rank of the pipeline calls it; the first one writes the file. With
        ``device_timing=True`` it shows the compute actions at the GPU's times, each rank's from the start of
        its step on its GPU; transfers, timed only by the host, are left out.
        """
        timeline = step_trace.timeline(self._executor)
        gathered = [None] * self.num_ranks if self.rank == 0 else None
        if self.num_ranks > 1:
            with self.calls.call("trace"):
                dist.gather_object(timeline, gathered, dst=global_rank(self.group, 0), group=self.group)
        else:
            gathered = [timeline]
        if self.rank == 0:
            step_trace.write_chrome_trace(path, gathered, device_timed=self._executor.device_timeline is not None)

    def state_dict(self) -> dict:
        """This rank's stages' state. Stages made by ``pipecomm.split`` use the original model's names,
        so ``pipecomm.merge_checkpoints`` of every rank's dict loads into the unsplit model."""
        state: dict = {}
        for stage in self.stages:
            for key, value in self.modules[stage].state_dict().items():
                if key in state and value is not state[key]:
                    raise ValueError(f"state_dict: stages on rank {self.rank} both have a {key!r}; name them "
                                     "uniquely, e.g. with pipecomm.split")
                state[key] = value
        return state

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        expected = set()
        for stage in self.stages:
            keys = self.modules[stage].state_dict().keys()
            expected.update(keys)
            self.modules[stage].load_state_dict({k: state[k] for k in keys if k in state}, strict=strict)
        unexpected = set(state) - expected
        if strict and unexpected:
            raise ValueError(f"load_state_dict: keys of no stage on rank {self.rank}: {sorted(unexpected)}")

    def close(self) -> None:
        """Closes the channels; idempotent. Pipelines left open are closed when the interpreter exits."""
        if self.calls.closed:
            return
        self.calls.closed = True
        fail_fast.untrack(self)
        self._undo_recompute()
        self._undo_deferral()
        self._links.close()

    # -- internals -----------------------------------------------------------------------------

    def _switch_to_plan(self) -> None:
        """schedule="auto", after the measured steps: the slowest rank's F, I and W (a max over the pipeline, so that
        every rank plans alike), the plan for this placement at 1f1b's memory, used from the next step on."""
        costs = torch.tensor(self._costs.costs(), dtype=torch.float64, device=self._collectives.wire_device())
        if self.num_ranks > 1:
            self._collectives.all_reduce(costs, dist.ReduceOp.MAX, "the all-reduce of the measured costs")
        measured = dict(zip(("F", "I", "W"), costs.tolist()))
        plan = plan_schedule(self.num_ranks, self.micro_batches, measured, placement=self.schedule.placement)
        self.schedule = plan  # plan_schedule validated it
        self._executor.switch_schedule(plan, self._device_timing)
        self.planned_costs = measured
        if self._executor.weight_grad_store is None:
            self._undo_deferral()
            self._undo_deferral = lambda: None
        self._costs = None

    def _forward_schedule(self, micro_batches: int) -> Schedule:
        """Inference's forward-only schedule on this pipeline's placement, built and validated once per micro-batch count."""
        schedule = self._forward_schedules.get(micro_batches)
        if schedule is None:
            schedule = forward_schedule(self.num_ranks, micro_batches, self.schedule.placement)
            validate(schedule)
            self._forward_schedules[micro_batches] = schedule
        return schedule

    def _abort(self, reason: str) -> None:
        """The protocol's abort: everything closed at once, each peer told why; never raises (peers may be gone)."""
        fail_fast.untrack(self)
        for undo in (self._undo_recompute, self._undo_deferral):
            with contextlib.suppress(Exception):
                undo()
        self._links.abort(reason)
