"""The user API: one rank's part of a pipeline, driven by ``step()`` inside an ordinary training loop."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import _C, boundary, microbatch, transport
from pipecomm.capture import CapturedStage
from pipecomm.compiled_modules import replaying_inductor_graphs
from pipecomm.device_timing import DeviceTimeline
from pipecomm.auto_schedule import CostMeter, initial_schedule
from pipecomm.executor import StageExecutor
from pipecomm.gradient_sink import GradientSink
from pipecomm.failure import Collective, FailureNotes, PeerFailedError, describe
from pipecomm.grad_sync import DataParallelGrads, SharedParameters, local_shard, stage_norm
from pipecomm.parallel import uses_nccl
from pipecomm.partition import StageModule
from pipecomm.planner import plan_schedule
from pipecomm.recompute import checkpoint_stages
from pipecomm.schedule import SCHEDULES, Schedule, forward_schedule, looped_placement, make_schedule, validate
from pipecomm.sharded_stages import ShardedStages
from pipecomm.split_backward import WeightGradStore, defer_linear_weight_grads
from pipecomm.transport.channel import ChannelError
from pipecomm.transport.lifetime import keep_forever
from pipecomm.transport.loopback import LoopbackChannel

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
    and 2p - 1 - r). ``schedule`` is a name of ``pipecomm.schedule.SCHEDULES``, a ``Schedule``
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
        # Set first, so that a failure while building is published and peers waiting to connect stop at once.
        self._notes = FailureNotes()
        self._failed: str | None = None
        self._closed = False
        self._channels: dict[tuple[int, str], object] = {}
        self._undo_deferral: Callable[[], None] = lambda: None
        self._undo_recompute: Callable[[], None] = lambda: None
        self._loss_wire: torch.Tensor | None = None
        self._deferral_checked = False
        self._forward_schedules: dict[int, Schedule] = {}  # inference's, per micro-batch count
        self.planned_costs: dict[str, float] | None = None  # schedule="auto": the F, I and W it planned for
        with self._failing_fast("building the Pipeline"):
            _check_configuration(modules, stages, num_stages, self.num_ranks, schedule)
            self._costs = CostMeter() if schedule == "auto" else None  # until "auto" has planned
            if self._costs is not None and cuda_graphs:
                raise ValueError('Pipeline: schedule="auto" changes the schedule after its measured steps, and with '
                                 "it how many micro-batches each stage holds, which cuda_graphs=True fixes at the first "
                                 "step; plan first (pipecomm.plan_schedule) and pass the Schedule")
            if isinstance(schedule, Schedule):
                self.schedule: Schedule = schedule
            elif self._costs is not None:
                self.schedule = initial_schedule(self.num_ranks, micro_batches, stages, self.rank)
            else:
                self.schedule = make_schedule(schedule, self.num_ranks, micro_batches, len(stages))
            _check_schedule(self.schedule, stages, self.rank, micro_batches)
            validate(self.schedule)
            self.num_stages = num_stages
            self.micro_batches = micro_batches
            self.modules = dict(zip(stages, modules))
            self.device = torch.device(device) if device is not None else _module_device(modules)
            for flag, value in (("cuda_graphs", cuda_graphs), ("device_timing", device_timing)):
                if value and self.device.type != "cuda":
                    raise ValueError(f"Pipeline: {flag}=True needs stages on a CUDA device, not {self.device}")
            self._sharded = ShardedStages(self.modules)
            if self._sharded and (cuda_graphs or main_grad):
                raise ValueError("Pipeline: stages sharded with fully_shard take neither cuda_graphs=True nor "
                                 "main_grad=True (FSDP's MixedPrecisionPolicy(reduce_dtype=torch.float32) keeps fp32 "
                                 "gradients)")
            self._sinks = {s: GradientSink(list(self.modules[s].parameters()), main_grad,
                                           live=self.modules[s] if self._sharded.holds(s) else None)
                           for s in self.stages}
            self._data_parallel = (
                DataParallelGrads(self._sinks, data_group, skip=self._sharded.sharded_parameters())
                if data_group is not None and dist.get_world_size(data_group) > 1
                else None
            )
            splits_backward = any(action.kind == "I" for action in self.schedule.actions[self.rank])
            store = WeightGradStore() if splits_backward else None
            self._executor = StageExecutor(
                self.schedule, self.rank, self.modules, self._sinks, self._channels, loss_fn,
                on_stage_backward_done=self._stage_gradients_final,
                weight_grad_store=store, cuda_graphs=cuda_graphs,
                device_timeline=(DeviceTimeline(self.device)
                                 if device_timing or (self._costs is not None and self.device.type == "cuda") else None),
            )
            self._device_timing = device_timing
            if store:
                self._undo_deferral = defer_linear_weight_grads(modules, store)
            # After the deferral: a recomputed Linear then recomputes the deferring forward.
            self._undo_recompute = checkpoint_stages(modules, recompute, cuda_graphs=cuda_graphs)
            self._connect(transport, timeout)
            self._last_rank = self.schedule.stage_rank(num_stages - 1)
            self._shared = (
                SharedParameters(self.modules, lambda s: self._global_rank(self.schedule.stage_rank(s)))
                if dist.is_initialized()
                else None
            )
            if self._shared:
                sharded = self._sharded.sharded_parameters()
                if any(id(param) in sharded for param, _, _ in self._shared.entries):
                    raise ValueError("Pipeline: a parameter shared between stages (a tied embedding and head) is "
                                     "sharded by fully_shard; keep it out of fully_shard (shard the blocks)")
                self._shared.synchronize_values(self._wait)
        _live.add(self)
        if self.num_ranks > 1:
            global _ran_on_several_ranks
            _ran_on_several_ranks = True

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
        with self._call("step"):
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
            self._check_deferral()
            if self._costs is not None and self._costs.add_step(self._executor):
                self._switch_to_plan()
            if self._data_parallel:
                self._data_parallel.finish(self._wait)
            if self._shared:
                self._shared.reduce_grads(self._sink_of, self._wait)
            if self.num_ranks == 1:
                return loss
            if self._loss_wire is None:  # one buffer for every step's broadcast: see transport.keep_forever
                self._loss_wire = torch.zeros((), dtype=torch.float32, device=self._wire_device())
                keep_forever([self._loss_wire])
            if loss is None:
                self._loss_wire.zero_()
            else:
                self._loss_wire.copy_(loss)
            self._broadcast(self._loss_wire, "the loss")
            return self._loss_wire.to(self.device, copy=True)

    @torch.no_grad()
    def forward(self, *inputs, broadcast_result: bool = False, **kwargs):
        """Inference, micro-batched, without autograd: the full-batch output on the last stage (None elsewhere).

        Any batch size works: it is split into min(batch size, micro_batches) micro-batches, unevenly if
        need be; only the first stage's rank needs the inputs. The result has the structure the model
        returns, each tensor leaf concatenated over the micro-batches along dim 0 (0-d tensors stacked);
        non-tensor leaves must be equal across micro-batches. With ``broadcast_result=True`` every rank
        of the pipeline gets it (autoregressive decoding). Failures behave as in ``step``.
        """
        with self._call("forward"):
            split_inputs = None
            if 0 in self.stages:
                split_inputs = microbatch.split(microbatch.Batch(inputs, kwargs), self.micro_batches, "",
                                                self.device, uneven=True)
            return self._forward(split_inputs, broadcast_result)

    def _forward(self, split_inputs: list | None, broadcast_result: bool):
        outputs = self._executor.infer(split_inputs, self._forward_schedule)
        self._sharded.reshard()
        result = microbatch.join(outputs) if outputs else None
        if broadcast_result and self.num_ranks > 1:
            result = self._broadcast_from_last(result)
        return result

    def _forward_schedule(self, micro_batches: int) -> Schedule:
        """Inference's forward-only schedule on this pipeline's placement, built and validated once per micro-batch count."""
        schedule = self._forward_schedules.get(micro_batches)
        if schedule is None:
            schedule = forward_schedule(self.num_ranks, micro_batches, self.schedule.placement)
            validate(schedule)
            self._forward_schedules[micro_batches] = schedule
        return schedule

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every stage's gradients by the global norm across the whole pipeline; returns that norm."""
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, not {norm_type}")
        with self._call("clip_grad_norm_"):
            held = [(p, g) for sink in self._sinks.values() for p in sink.params if (g := sink.target(p)) is not None]
            grads = [grad for _, grad in held]
            elsewhere = self._shared.counted_by_another_rank() if self._shared else set()
            counted = [grad for param, grad in held if id(param) not in elsewhere]
            op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
            total = stage_norm(counted, norm_type).to(self._wire_device())
            if self.num_ranks > 1:
                self._wait(Collective(lambda: dist.all_reduce(total, op=op, group=self.group, async_op=True),
                                      [total], self.group,
                                      f"pipeline rank {self.rank}: clip_grad_norm_'s all-reduce of the gradient norm"))
            norm = total if norm_type == math.inf else total.sqrt()
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            if grads:
                torch._foreach_mul_([local_shard(grad) for grad in grads], scale.to(grads[0].device))
            return norm

    def bubble_fraction(self) -> float:
        """This rank's idle share of the last step: 1 - time in compute actions / the step's span.

        With ``device_timing=True`` the times are the GPU's (CUDA events around each compute action;
        reading them waits for the step to finish on the GPU). Otherwise they come from the host
        clock, which on GPUs measures launch time, since the host runs ahead of the device.
        """
        if self._executor.device_timeline:
            return self._executor.device_timeline.bubble_fraction()
        timeline = self._executor.timeline
        if not timeline:
            return 0.0
        span = timeline[-1][1] - timeline[0][0]
        busy = sum(end - start for start, end, action in timeline if action.is_compute)
        return max(0.0, 1.0 - busy / span) if span > 0 else 0.0

    def trace(self, path: str) -> None:
        """Writes a Chrome trace (chrome://tracing, Perfetto) of the last step's actions on every rank.

        Collective: every rank of the pipeline calls it; the first one writes the file. With
        ``device_timing=True`` it shows the compute actions at the GPU's times, each rank's from the start of
        its step on its GPU; transfers, timed only by the host, are left out.
        """
        executor = self._executor
        entries = executor.compute_spans() if executor.device_timeline else executor.timeline
        timeline = [(start, end, str(action), action.kind) for start, end, action in entries]
        gathered = [None] * self.num_ranks if self.rank == 0 else None
        if self.num_ranks > 1:
            with self._call("trace"):
                dist.gather_object(timeline, gathered, dst=self._global_rank(0), group=self.group)
        else:
            gathered = [timeline]
        if self.rank != 0:
            return
        origin = 0.0 if executor.device_timeline else min((events[0][0] for events in gathered if events), default=0.0)
        trace_events = [
            {
                "name": name,
                "ph": "X",
                "ts": (start - origin) * 1e6,
                "dur": (end - start) * 1e6,
                "pid": rank,
                "tid": "comm" if kind.startswith(("SEND", "RECV")) else "compute",
            }
            for rank, events in enumerate(gathered)
            for start, end, name, kind in events
        ]
        with open(path, "w") as file:
            json.dump({"traceEvents": trace_events, "displayTimeUnit": "ms"}, file)

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
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        self._undo_recompute()
        self._undo_deferral()
        # In the order they opened (a dict's), the same on every rank: closing an NCCL-backed channel waits for its
        # peer to close the same one (a set's order, which differs between processes, hung two H100s so).
        for channel in self._channels.values():
            channel.close()

    # -- internals -----------------------------------------------------------------------------

    def _stage_gradients_final(self, stage: int) -> None:
        """A stage's last backward of the step is done: its gradients go to their reductions over the replicas."""
        self._sharded.finish(stage)
        if self._data_parallel:
            self._data_parallel.start(stage)

    def _check_deferral(self) -> None:
        """After the first step of a zero-bubble schedule: a warning if no Linear deferred its weight gradient."""
        store = self._executor.weight_grad_store
        if store is None or self._deferral_checked:
            return
        self._deferral_checked = True
        if store.deferrals_made == 0:
            warnings.warn(
                f"Pipeline rank {self.rank}: schedule {self.schedule.name!r} split the backward, but no nn.Linear of "
                f"stages {self.stages} deferred its weight gradient to W in the first step: they run inside "
                "torch.compile'd regions (whose backward computes every gradient in one graph), are frozen, or are "
                "subclasses with a forward of their own. Training is exact, but the W passes have nothing to fill "
                "the bubbles with; 1f1b gives the same for less bookkeeping", stacklevel=3)

    def _switch_to_plan(self) -> None:
        """schedule="auto", after the measured steps: the slowest rank's F, I and W (a max over the pipeline, so that
        every rank plans alike), the plan for this placement at 1f1b's memory, used from the next step on."""
        costs = torch.tensor(self._costs.costs(), dtype=torch.float64, device=self._wire_device())
        if self.num_ranks > 1:
            self._wait(Collective(lambda: dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                                  [costs], self.group, f"pipeline rank {self.rank}: the all-reduce of the measured costs"))
        measured = dict(zip(("F", "I", "W"), costs.tolist()))
        plan = plan_schedule(self.num_ranks, self.micro_batches, measured, placement=self.schedule.placement)
        self.schedule = plan  # plan_schedule validated it
        self._executor.switch_schedule(plan, self._device_timing)
        self.planned_costs = measured
        if self._executor.weight_grad_store is None:
            self._undo_deferral()
            self._undo_deferral = lambda: None
        self._costs = None

    def _check_usable(self, action: str) -> None:
        if self._failed is not None:
            raise RuntimeError(f"Pipeline rank {self.rank}: cannot {action}: an earlier call failed and closed it "
                               f"({self._failed}); build a new Pipeline")
        if self._closed:
            raise RuntimeError(f"Pipeline rank {self.rank}: cannot {action}: it was closed")

    @contextlib.contextmanager
    def _call(self, action: str):
        """One public call: refused after a failure or close, refused while another thread is in a Pipeline call,
        and failing fast."""
        self._check_usable(action)
        busy = _calls.enter(self, action)
        try:
            with self._failing_fast(action):
                if busy:
                    raise RuntimeError(f"Pipeline rank {self.rank}: {action} called from thread "
                                       f"{threading.current_thread().name!r} while {busy}; Pipelines are not "
                                       "thread-safe: calls on one process must not overlap")
                reasons = self._notes.reasons(self._global_rank(self.rank))
                if reasons:
                    raise PeerFailedError(f"pipeline rank {self.rank}: cannot {action}: {reasons}")
                yield
        finally:
            if not busy:
                _calls.leave()

    @contextlib.contextmanager
    def _failing_fast(self, action: str):
        """On a failure: this rank's cause published, or the cause another rank published named instead of a
        symptom; channels aborted so that peers waiting on them fail at once; the Pipeline closed."""
        try:
            yield
        except BaseException as error:
            explained = self._fail(action, error)
            if explained is error:
                raise
            raise explained from error

    def _fail(self, action: str, error: BaseException) -> BaseException:
        """Publishes and aborts; returns the error to raise: ``error``, or a PeerFailedError naming the cause."""
        global_rank = self._global_rank(self.rank)
        symptom = isinstance(error, (ChannelError, TimeoutError, PeerFailedError))
        reasons = self._notes.reasons(global_rank) if symptom else ""
        explained = error
        if reasons and not isinstance(error, PeerFailedError):
            explained = PeerFailedError(f"{error} ({reasons})")
        own = f"rank {global_rank} (pipeline rank {self.rank}, stages {self.stages}) failed in {action}: {describe(error)}"
        if not reasons:
            self._notes.publish(global_rank, own)
        self._failed = describe(explained, limit=500)
        self._abort(reasons or own)  # the original cause first: the shm and IPC channels carry 240 bytes of it
        return explained

    def _abort(self, reason: str) -> None:
        """Closes everything at once, telling each peer why; never raises (peers may be gone)."""
        self._closed = True
        _live.discard(self)
        for undo in (self._undo_recompute, self._undo_deferral):
            with contextlib.suppress(Exception):
                undo()
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                channel.abort(reason)

    def _connect(self, backend: str, timeout: float) -> None:
        """Two channels (activations, gradients) to every neighbouring rank, opened in one global order of rank
        pairs so that no two ranks wait on each other's connect; each added to ``_channels`` as it opens, so that
        a failure midway aborts the ones already open."""
        peers = set()
        for stage in self.stages:
            for neighbour in (stage - 1, stage + 1):
                if 0 <= neighbour < self.num_stages:
                    peers.add(self.schedule.stage_rank(neighbour))
        global_rank = self._global_rank(self.rank)
        for peer in sorted(peers, key=lambda peer: (min(peer, self.rank), max(peer, self.rank))):
            for kind in ("act", "grad"):
                if peer == self.rank:
                    channel = LoopbackChannel(global_rank, self.device, timeout)
                else:
                    channel = transport.connect(self._global_rank(peer), self.group, backend, device=self.device,
                                                timeout=timeout, peer_failure=lambda: self._notes.reasons(global_rank))
                # Activations are structures; gradients, one per tensor of the activation message, stay flat.
                self._channels[(peer, kind)] = (boundary.StructureChannel(channel, self.device) if kind == "act"
                                                else channel)

    def _sink_of(self, param: nn.Parameter) -> GradientSink:
        return next(sink for sink in self._sinks.values() if any(p is param for p in sink.params))

    def _global_rank(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank) if self.group is not None else pipeline_rank

    def _wire_device(self) -> torch.device:
        """Where collectives over the pipeline group need their tensors."""
        if dist.is_initialized() and uses_nccl(self.group):
            return self.device
        return torch.device("cpu")

    def _broadcast_from_last(self, result):
        """The last stage's inference output on every rank, as three broadcasts: the channels' frame header (with the
        layout's length), the tensors' metadata with the output's layout, and the packed payload."""
        wire = self._wire_device()
        codec = _C.MessageCodec(str(self.device), "the inference output", "the inference output")
        last = self.rank == self._last_rank
        if last:
            flat = boundary.flatten(result)
            header, meta, payload = codec.encode(flat.tensors)
            layout = boundary.serialize(flat.layout, None, "the inference output")
            sizes = torch.cat([header, torch.tensor([len(layout)])])
            described = torch.cat([meta, torch.frombuffer(bytearray(layout), dtype=torch.uint8)])
        else:
            sizes = torch.zeros(_C.FRAME_HEADER_FIELDS + 1, dtype=torch.int64)
        sizes = self._broadcast_host(sizes, wire, "the inference output's header")
        _, meta_bytes, payload_bytes = codec.read_header(sizes[:-1])
        if not last:
            described = torch.empty(meta_bytes + int(sizes[-1]), dtype=torch.uint8)
        described = self._broadcast_host(described, wire, "the inference output's layout")
        if last:
            if payload_bytes:
                self._broadcast(payload.to(wire), "the inference output's tensors")
            return result
        tensors = codec.allocate(described[:meta_bytes], payload_bytes)
        if payload_bytes:
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=wire)
            self._broadcast(payload, "the inference output's tensors")
            codec.unpack_payload(payload)
        layout, _ = boundary.deserialize(described[meta_bytes:].numpy().tobytes())
        return boundary.unflatten(tensors, layout)

    def _broadcast_host(self, tensor: torch.Tensor, wire: torch.device, what: str) -> torch.Tensor:
        """A broadcast of host data, read back on the host."""
        tensor = tensor.to(wire)
        self._broadcast(tensor, what)
        return tensor.cpu()

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """From the last stage's rank to every rank of the pipeline."""
        source = self._global_rank(self._last_rank)
        self._wait(Collective(lambda: dist.broadcast(tensor, src=source, group=self.group, async_op=True), [tensor],
                              self.group, f"pipeline rank {self.rank}: the broadcast of {what} from the last stage "
                                          f"(rank {source})"))

    def _wait(self, collective: Collective) -> None:
        """Waits for one of this Pipeline's collectives: at most its timeout, and not once another rank failed."""
        collective.wait(self.timeout, self._notes, self._global_rank(self.rank))


class _CallGuard:
    """Which Pipeline call this process is in, so that an overlapping one from another thread is refused."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside: str = ""

    def enter(self, pipe: Pipeline, action: str) -> str:
        """Empty if this call may go ahead; otherwise the call it overlaps."""
        if not self._lock.acquire(blocking=False):
            return self._inside or "another Pipeline call is running"
        self._inside = f"thread {threading.current_thread().name!r} is in {action} of the Pipeline of rank {pipe.rank}"
        return ""

    def leave(self) -> None:
        self._inside = ""
        self._lock.release()


_calls = _CallGuard()
# Pipelines not closed yet: closed at exit, and told of an uncaught exception so that their peers hear of it.
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


def _fail_live_pipelines(exc_type, exc_value, traceback) -> None:
    """An uncaught exception ends this process: its Pipelines fail first, so that their peers raise with its cause."""
    for pipe in list(_live):
        with contextlib.suppress(BaseException):
            pipe._fail("the program (uncaught exception)", exc_value)
    _previous_excepthook(exc_type, exc_value, traceback)


def _at_exit() -> None:
    for pipe in list(_live):
        with contextlib.suppress(Exception):
            pipe.close()
    if _ran_on_several_ranks:
        # A gloo worker thread drops its references to a finished collective's tensors after the collective
        # completes; dropping the last one needs the GIL, and a worker that asks for it once the interpreter is
        # finalizing aborts the process ("terminate called without an active exception", pytorch#190489). A
        # program's last collective (a metric's all-reduce, all_gather_object) may have finished just before it
        # exits: give the workers the GIL for a moment while the interpreter is still whole.
        time.sleep(_WORKER_GRACE_SECONDS)


_WORKER_GRACE_SECONDS = 0.05
_ran_on_several_ranks = False  # set by the first Pipeline of several ranks
atexit.register(_at_exit)
_previous_excepthook = sys.excepthook
sys.excepthook = _fail_live_pipelines


def _check_configuration(modules, stages, num_stages, num_ranks, schedule) -> None:
    """Every misconfiguration is a ValueError here, before any communication."""
    if isinstance(schedule, Schedule):
        if schedule.forward_only:
            raise ValueError(f"Pipeline: the schedule {schedule.name!r} is forward-only, and step needs backwards; "
                             "give a training schedule (Pipeline.forward derives its own forward-only one)")
        if schedule.num_ranks != num_ranks:
            raise ValueError(f"Pipeline: the schedule {schedule.name!r} is for {schedule.num_ranks} ranks, but the "
                             f"pipeline group has {num_ranks}")
    elif schedule not in (*SCHEDULES, "auto"):
        raise ValueError(f"Pipeline: unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}, auto")
    if len(modules) != len(stages):
        raise ValueError(f"Pipeline: got {len(modules)} modules but {len(stages)} stage indices")
    if num_stages != num_ranks * len(stages):
        raise ValueError(
            f"Pipeline: num_stages={num_stages} must equal the pipeline group size ({num_ranks}) times the "
            f"stages per rank ({len(stages)})"
        )
    for module, stage in zip(modules, stages):
        if not 0 <= stage < num_stages:
            raise ValueError(f"Pipeline: stage {stage} is out of range for num_stages={num_stages}")
        if isinstance(module, (StageModule, CapturedStage)) and (module.stage_index, module.num_stages) != (stage, num_stages):
            raise ValueError(f"Pipeline: the module given as stage {stage} of {num_stages} is stage "
                             f"{module.stage_index} of {module.num_stages} as pipecomm.split made it; split the model "
                             "into as many stages as the Pipeline has, and pass each rank its own")
        replaying = replaying_inductor_graphs([module])
        if replaying:
            raise ValueError(f"Pipeline: stage {stage}'s {', '.join(repr(name) if name else 'module' for name in replaying)} "
                             "is compiled with inductor's CUDA graphs (mode='reduce-overhead' or 'max-autotune'), whose "
                             "replays write each call's outputs over the last call's, the activations of a micro-batch "
                             "still in flight; compile with mode='default' or 'max-autotune-no-cudagraphs', and pass "
                             "cuda_graphs=True to the Pipeline for graphs that hold each micro-batch apart")


def _check_schedule(schedule: Schedule, stages, rank: int, micro_batches: int) -> None:
    """A schedule given as a Schedule must fit this Pipeline, and every schedule the stages this rank got."""
    if schedule.micro_batches != micro_batches or schedule.num_stages != len(stages) * schedule.num_ranks:
        raise ValueError(f"Pipeline: the schedule {schedule.name!r} runs {schedule.micro_batches} micro-batches of "
                         f"{schedule.num_stages} stages, but the Pipeline has micro_batches={micro_batches} and "
                         f"{len(stages)} stages per rank")
    expected = list(schedule.stages_of(rank))
    if sorted(stages) != expected:
        where = ("stage s runs on rank s % num_ranks" if schedule.placement == looped_placement(schedule.num_ranks,
                                                                                                 schedule.num_stages)
                 else f"{schedule.name!r} places stages on ranks as {list(schedule.placement)}")
        raise ValueError(f"Pipeline: rank {rank} of {schedule.num_ranks} holds stages {expected} ({where}; "
                         f"make_schedule(...).stages_of(rank) tells), got {sorted(stages)}")


def _module_device(modules) -> torch.device:
    for module in modules:
        for param in module.parameters():
            return param.device
    return torch.device("cpu")
