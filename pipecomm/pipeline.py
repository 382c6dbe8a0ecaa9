"""The user API: one rank's part of a pipeline, driven by ``step()`` inside an ordinary training loop.

A Pipeline is a facade: its stages' runs are the executor's over the prepared stages (``prepared_stages``,
``executor``, ``stage_runner``), its channels the links' (``links``), its collectives ``collectives``'s, its
gradients the finalizer's (``gradient_finalizer``), "auto" the planner's (``auto_planner``), its calls' failures the
protocol's (``fail_fast``), its refusals ``checks``'s.

**Failures.** If a call fails on one rank (a bad batch, an error in a stage or the loss, a dead
peer), that rank publishes its error through the job's store and closes its channels; every
other rank's call then raises within seconds, wherever it waits (a channel, the loss or result
broadcast, a gradient all-reduce, its next call's first message or collective): a
``PeerFailedError`` whose message holds the failed rank's error, or a ``PeerDiedError`` if that
process died without a word. Afterwards every rank's Pipeline refuses further calls; build a new one.

**Shared, sharded and tensor-parallel stages.** Parameters that ``pipecomm.split`` found shared between stages
(a tied embedding and LM head) start from the lowest holder's value and have their gradients summed across the
holders. Stage modules may hold torch's ``fully_shard`` modules (FSDP2 over the data-parallel mesh): they stay
gathered through a step and have their gradients reduce-scattered once, after the stage's last backward, and
resharded; ``data_group``'s all-reduce then covers only the other parameters. Tensor-parallel layers
(``parallelize_module``) work as they are, each tp rank of a stage talking to the same tp rank of the next; a
DTensor output crosses as its local shard and is rebuilt with its placements on the receiving rank's mesh of the
same dimension names (``pipecomm.init``'s).

**Threads.** Pipelines are not thread-safe: on one process, calls of Pipelines (``step``,
``forward``, ``clip_grad_norm_``, ``trace``) must not overlap, since their collectives would
interleave on the process groups. An overlapping call raises and fails its Pipeline, on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import transport
from pipecomm.parallel.gradient_finalizer import GradientFinalizer
from pipecomm.parallel.grad_sync import SharedParameters
from pipecomm.parallel.mesh import failure_scope, global_rank
from pipecomm.parallel.sharded_stages import ShardedStages
from pipecomm.runtime import fail_fast, microbatch, stage_state, step_trace
from pipecomm.runtime.checks import (check_configuration, check_options, checked_batch_dim, graph_mode, module_device,
                                     starting_schedule)
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.device_timing import DeviceTimeline
from pipecomm.runtime.links import NeighbourLinks
from pipecomm.runtime.prepared_stages import PreparedStages
from pipecomm.runtime.step_tuning import StepTuning
from pipecomm.schedules.offload import OffloadPlan, check_plan
from pipecomm.schedules.schedule import Schedule, built_for_costs

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's stages of a pipeline-parallel model.

    Replace ``loss = loss_fn(model(x), y); loss.backward()`` with ``loss = pipe.step(x, target=y)``: afterwards
    every parameter's ``.grad`` holds what that single-process backward on the whole batch gives, so any optimizer
    works unchanged (the step's loss is the mean of the micro-batches' ``loss_fn``: the whole batch's for a loss that
    averages over items each micro-batch holds equally many of; docs/using.md, "The loss of a step", for sums and
    padded targets); frozen parameters (``requires_grad=False``, read at every step) keep no gradient. Every rank
    may call ``step`` with the same arguments; the first stage reads the inputs, the last ``target``.

    A stage may return any pytree (tensors, tuples, lists, dicts, None, dataclasses, transformers
    ModelOutputs, with non-tensor leaves such as ints); the next stage receives that structure, a
    tuple unpacked into positional arguments and anything else as its one argument, and the last
    stage's ``loss_fn(output, *targets)`` the model's output. Only tensors that require grad on the
    sending stage require grad on the receiving one and get a gradient sent back.

    ``module``/``stage`` are one module and its stage index, or lists of them for schedules with
    several stages per rank (interleaved-1f1b: rank r holds stages r, r + p, r + 2p, ...; zb-v: r
    and 2p - 1 - r). ``schedule`` is a name of ``pipecomm.schedules.schedule.SCHEDULES``, a ``Schedule``
    (``pipecomm.make_schedule``, e.g. zb-v built for measured costs) or ``"auto"``, which times F, I and W on its
    first steps, plans for the slowest rank's costs, tries the plan and 1f1b and keeps the faster; "zb-h2" and
    "zb-v" by name run their order rebuilt for the costs of the first step from the second on (docs/schedules.md;
    ``pipe.schedule``, ``pipe.planned_costs``, ``pipe.auto_step_times``).
    ``batch_dim`` is the dimension along which every tensor of the inputs and targets is split into micro-batches
    (default 0; 1 for sequence-first data: an LSTM's or nn.Transformer's with batch_first=False, whose presence in a
    stage warns once while batch_dim is left unsaid).
    ``group`` is the pipeline's process group, ordered by stage (default: the whole world);
    ``data_group`` holds this stage's data-parallel replicas, whose gradients are averaged
    (``pipecomm.init`` makes both).
    ``cuda_graphs="auto"`` (the default) replays each stage's passes as CUDA graphs where that pays and is safe, and
    changes nothing otherwise: on GPUs, after two steps whose micro-batches had one shape, a stage whose passes the
    host launches slower than the GPU runs them captures at the third and checks each graph's first replay against an
    eager run of the same micro-batch (a stage the GPU bounds stays eager: graphs would cost memory for nothing); a
    micro-batch that does not fit the graphs runs eagerly, and a parameter moved or frozen, a module attribute set
    anew (``eval()``, a dropout's ``p``) or autocast changed drops them until the shapes hold again. It stays eager,
    with a one-line warning, where a capture or its check fails, and says nothing where graphs do not apply (CPU,
    offload, sharded or tensor-parallel stages). ``cuda_graphs=True``
    captures at the first step, unchecked, and refuses any change (not with schedule "auto"); False never captures.
    Graphs keep each in-flight micro-batch's activations in their own memory (docs/using.md, "CUDA graphs").
    ``device_timing=True`` times compute actions with CUDA events, so that ``bubble_fraction()`` reports the GPU's
    bubble.
    ``recompute=True`` recomputes each stage's forward during its backward (activation checkpointing),
    keeping only the stage's inputs between the two; a callable ``module -> bool`` checkpoints only the
    submodules it picks (selective recomputation, as Megatron's ``recompute_modules``); with CUDA graphs too, whose
    backward replays draw a recomputed dropout's masks as the forward did.
    ``offload=True`` moves saved activations to host memory while they wait for their backward, where the
    schedule leaves time to copy them out and back behind compute, as planned from the first step's measurements
    (with "auto", from its measured steps, for each schedule it runs); an ``OffloadPlan`` made for this schedule is
    used as it is (docs/offload-recompute.md; ``pipe.offload_plan``). Not with ``cuda_graphs=True``.
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        *,
        stage: int | Sequence[int],
        num_stages: int,
        loss_fn: Callable,
        micro_batches: int,
        batch_dim: int | None = None,
        schedule: str | Schedule = "1f1b",
        group: dist.ProcessGroup | None = None,
        data_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        transport: str = "auto",
        timeout: float = transport.DEFAULT_TIMEOUT,
        main_grad: bool = False,
        cuda_graphs: bool | str = "auto",
        device_timing: bool = False,
        recompute: bool | Callable[[nn.Module], bool] = False,
        offload: bool | OffloadPlan = False,
    ):
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.group = group
        self.timeout = timeout
        self.num_ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.stages = sorted(stages)
        # First, so that a failure while building is published and peers waiting to connect stop at once.
        fail_fast.install()
        self.calls = fail_fast.CallProtocol(self.rank, global_rank(group, self.rank), self.stages, self._abort,
                                            failure_scope(group, data_group) if dist.is_initialized() else None)
        self._links = NeighbourLinks()
        self._prepared: PreparedStages | None = None
        with self.calls.failing("building the Pipeline"):
            check_configuration(modules, stages, num_stages, self.num_ranks, schedule)
            self.batch_dim = checked_batch_dim(batch_dim, dict(zip(stages, modules)))
            auto = schedule == "auto"
            starting = starting_schedule(schedule, self.num_ranks, micro_batches, stages, self.rank)
            self.num_stages = num_stages
            self.micro_batches = micro_batches
            self.modules = dict(zip(stages, modules))
            self.device = torch.device(device) if device is not None else module_device(modules)
            sharded = self._sharded = ShardedStages(self.modules)
            check_options(self.device, auto=auto, sharded=bool(sharded), cuda_graphs=cuda_graphs is True,
                          device_timing=device_timing, main_grad=main_grad, offload=offload)
            if isinstance(offload, OffloadPlan):
                check_plan(offload, starting)  # before any communication: each rank raises its own error
            cuda_graphs = graph_mode(cuda_graphs, self.device, modules, sharded=bool(sharded), offload=offload)
            # With cuda_graphs=True too: the first step runs eagerly, timed, and the graphs capture the rebuilt order.
            refit = isinstance(schedule, str) and built_for_costs(schedule)
            timed_on_device = device_timing or ((auto or refit or offload is True) and self.device.type == "cuda")
            self._prepared = PreparedStages(
                starting, self.rank, self.modules, sharded, loss_fn, self._links.channels, main_grad=main_grad,
                cuda_graphs=cuda_graphs, recompute=recompute,
                device_timeline=DeviceTimeline(self.device) if timed_on_device else None,
                on_stage_backward_done=lambda stage: self._gradients.stage_done(stage))
            self._executor = self._prepared.executor
            self._links.connect(starting, self.rank, group, self.device, transport, timeout,
                                self.calls.peer_failures)
            self._collectives = PipelineCollectives(group, self.rank, starting.stage_rank(num_stages - 1),
                                                    self.device, self.calls, timeout, self._links.channels, starting)
            self._collectives.check_built_alike(starting)
            self._tuning = StepTuning(self._prepared, self._collectives, self.num_ranks, micro_batches, self.device,
                                      modules, auto=auto, refit=refit, offload=offload, device_timing=device_timing)
            shared = (SharedParameters(self.modules, lambda s: global_rank(group, starting.stage_rank(s)),
                                       lambda value: self.calls.gather(value, "the shared parameters' holders",
                                                                       timeout))
                      if dist.is_initialized() else None)
            self._gradients = GradientFinalizer(self.modules, self._prepared.sinks, sharded, data_group, shared,
                                                self._collectives, self._loss_parameters(loss_fn))
        fail_fast.track(self, several_ranks=self.num_ranks > 1)

    schedule = property(lambda self: self._executor.schedule,
                        doc='The schedule the next step runs ("auto", "zb-h2" and "zb-v" change it after measuring).')
    planned_costs = property(lambda self: self._tuning.planned_costs,
                             doc='"auto", "zb-h2", "zb-v": the F, I and W (seconds) planned or rebuilt for.')
    auto_step_times = property(lambda self: self._tuning.auto_step_times,
                               doc='"auto", once settled: each schedule it tried and its median step seconds.')
    offload_plan = property(lambda self: self._tuning.offload_plan, doc="offload=True: the plan in use, once made.")
    cuda_graph_states = property(lambda self: self._executor.graph_states(),
                                 doc='Per stage of this rank: "replaying", "to capture", "watching", "eager" (graphs off) '
                                     'or "eager: " and why it gave graphs up.')

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stages' parameters, each once: two stages of this rank may share one (zb-v's first and last
        stage, a tied embedding and head), which an optimizer given it twice would step twice."""
        return (param for _, param in self.named_parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``parameters()`` with their names, the original model's for stages made by ``pipecomm.split``: for
        parameter groups by name, and optimizer state saved by name and loaded into another layout."""
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for stage in self.stages:
            for name, param in self.modules[stage].named_parameters():
                named.setdefault(id(param), (name, param))
        return iter(named.values())

    def step(self, *inputs, target=None, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean micro-batch loss on every rank.

        ``inputs`` and ``kwargs`` (e.g. ``attention_mask=``) are the first stage's positional and keyword
        arguments, ``target`` (a tuple: several) the arguments of ``loss_fn`` after the output; any of
        them may be pytrees, whose tensors are split along dim 0 into the micro-batches (every tensor
        of the inputs and the targets must have the same batch size there). It needs autograd on: under
        ``torch.no_grad()`` it raises (``forward`` is the inference). A failure on any rank, bad arguments
        included, fails the call on every rank (see the module docstring).
        """
        with self.calls.call("step"):
            if not torch.is_grad_enabled():
                # Every stage would then look frozen: the step returned the loss and computed no gradient, silently.
                raise RuntimeError(f"Pipeline rank {self.rank}: step trains (a forward and a backward per "
                                   "micro-batch), but autograd is off here (torch.no_grad() or "
                                   "torch.inference_mode()), so it would compute no gradient; call it with autograd "
                                   "on, or Pipeline.forward for inference")
            self._prepared.check_parameters()
            self._tuning.before_step()
            self._sharded.gather_ahead()
            self._gradients.start_step()
            loss = self._executor.run(*microbatch.split_step(inputs, kwargs, target, self.micro_batches, self.device,
                                                             first=0 in self.stages,
                                                             last=self.num_stages - 1 in self.stages,
                                                             dim=self.batch_dim))
            self._prepared.check_deferral()
            self._tuning.after_step()
            self._gradients.finish_step(self._executor.leaves_beside())
            if self.num_ranks == 1:
                return loss
            return self._collectives.broadcast_loss(loss)

    @torch.no_grad()
    def forward(self, *inputs, broadcast_result: bool = False, **kwargs):
        """Inference, micro-batched, without autograd: the full-batch output on the last stage (None elsewhere).

        Any batch size works: it is split into min(batch size, micro_batches) micro-batches, unevenly if
        need be; only the first stage's rank needs the inputs. The result has the structure the model
        returns, each tensor leaf concatenated over the micro-batches along ``batch_dim`` (0-d tensors stacked; one
        whose size there is not its micro-batch's and that is the same in each is returned once);
        non-tensor leaves must be equal across micro-batches. With ``broadcast_result=True`` every rank
        of the pipeline gets it (autoregressive decoding). Failures behave as in ``step``.
        """
        # Without the broadcast, the first stage's rank only sends, which may all fit in its channels' slots: it looks
        # for published failures first, as it might wait for nothing that a failed peer stops.
        with self.calls.call("forward", look_up_failures=not broadcast_result):
            batch, first = microbatch.Batch(inputs, kwargs), 0 in self.stages
            split_inputs = (microbatch.split(batch, self.micro_batches, "", self.device, uneven=True,
                                             dim=self.batch_dim) if first else None)
            outputs = self._executor.infer(split_inputs, microbatch.batch_size(batch, "", self.batch_dim)
                                           if first else None)
            self._sharded.reshard()
            result = (microbatch.join(outputs, self.batch_dim, self._executor.inferred_batch_size)
                      if outputs else None)
            if broadcast_result and self.num_ranks > 1:
                result = self._collectives.broadcast_result(result)
            return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every stage's gradients by the global norm across the whole pipeline; returns that norm."""
        if norm_type not in (2.0, math.inf):  # before the call: a bad argument fails no rank
            raise ValueError(f"clip_grad_norm_: norm_type must be 2 or inf, not {norm_type}")
        with self.calls.call("clip_grad_norm_"):
            return self._gradients.clip_grad_norm_(max_norm, norm_type, several_ranks=self.num_ranks > 1)

    def bubble_fraction(self) -> float:
        """This rank's idle share of the last step: 1 - time in compute actions / the step's span. With
        ``device_timing=True`` the times are the GPU's (CUDA events around each compute action; reading them waits for
        the step to finish on the GPU), else the host clock's, which on GPUs measures launch time."""
        return step_trace.bubble_fraction(self._executor)

    def trace(self, path: str) -> None:
        """Writes a Chrome trace (chrome://tracing, Perfetto) of the last step's actions on every rank. Collective:
        every rank calls it; the first one writes the file. With ``device_timing=True`` it shows the compute actions at
        the GPU's times, each rank's from the start of its step on its GPU (transfers, host-timed, are left out)."""
        with self.calls.call("trace", look_up_failures=True):
            gathered = self._collectives.gather_at_first_rank(step_trace.timeline(self._executor), self.num_ranks)
        if gathered is not None:
            step_trace.write_chrome_trace(path, gathered, device_timed=self._executor.device_timeline is not None)

    def state_dict(self) -> dict:
        """This rank's stages' state. Stages made by ``pipecomm.split`` use the original model's names,
        so ``pipecomm.merge_checkpoints`` of every rank's dict loads into the unsplit model."""
        return stage_state.state_dict(self.modules, self.rank)

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        stage_state.load_state_dict(self.modules, state, strict, self.rank)

    def close(self) -> None:
        """Closes the channels; idempotent. Pipelines left open are closed when the interpreter exits."""
        if self.calls.closed:
            return
        self.calls.closed = True
        self.calls.closing()  # before the channels close, for a peer that meets them closed to say why
        fail_fast.untrack(self)
        if self._prepared:
            self._prepared.restore()
            self._executor.release_graphs()
        self._links.close()

    # -- internals -----------------------------------------------------------------------------

    def _loss_parameters(self, loss_fn: Callable) -> list[nn.Parameter]:
        """loss_fn's own parameters, where this rank computes the loss: an nn.Module's, or a method's module's, but
        those of the stages (a loss that is a method of the model)."""
        owner = loss_fn if isinstance(loss_fn, nn.Module) else getattr(loss_fn, "__self__", None)
        if not isinstance(owner, nn.Module) or self.num_stages - 1 not in self.stages:
            return []
        staged = {id(param) for module in self.modules.values() for param in module.parameters()}
        return [param for param in owner.parameters() if id(param) not in staged]

    def _abort(self, reason: str) -> None:
        """The protocol's abort: everything closed at once, each peer told why; never raises (peers may be gone)."""
        fail_fast.untrack(self)
        if self._prepared:
            with contextlib.suppress(Exception):
                self._prepared.restore()
        self._links.abort(reason)
