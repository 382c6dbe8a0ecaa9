"""What a Pipeline refuses before any communication: a configuration, a schedule or stage modules that do not fit."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.splitting.capture import CapturedStage
from pipecomm.runtime.compiled_modules import replaying_inductor_graphs
from pipecomm.splitting.partition import StageModule
from pipecomm.schedules.auto_schedule import initial_schedule
from pipecomm.schedules.offload import OffloadPlan
from pipecomm.schedules.schedule import SCHEDULES, Schedule, looped_placement, make_schedule
from pipecomm.schedules.validation import validate

__all__: list[str] = []


def checked_batch_dim(batch_dim: int | None, modules: dict[int, nn.Module]) -> int:
    """The dimension the batch is split along: ``batch_dim``, or 0 when unsaid, with a warning where a stage holds a
    module that takes sequence-first tensors (its batch in dim 1), whose inputs split along dim 0 would be cut in time."""
    if batch_dim is not None:
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"Pipeline: batch_dim must be a dimension index >= 0, not {batch_dim!r}")
        return batch_dim
    for stage, module in sorted(modules.items()):
        found = next(((name, inner) for name, inner in module.named_modules() if _sequence_first(inner)), None)
        if found is not None:
            name, inner = found
            warnings.warn(f"Pipeline: stage {stage} holds {type(inner).__name__} {name!r} with batch_first=False, "
                          "which takes sequence-first tensors; step splits every tensor of the inputs and targets "
                          "along dim 0, which would cut sequence-first data in time. Pass batch_dim=1 for "
                          "sequence-first data, or batch_dim=0 to say that the data is batch-first (the model "
                          "transposes it)", stacklevel=3)
            break
    return 0


def _sequence_first(module: nn.Module) -> bool:
    if isinstance(module, (nn.RNNBase, nn.MultiheadAttention, nn.Transformer)):
        return not module.batch_first
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    return False


def check_configuration(modules, stages, num_stages, num_ranks, schedule) -> None:
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


def graph_mode(cuda_graphs, device: torch.device, modules, *, sharded: bool, offload) -> bool | str:
    """``cuda_graphs`` as the stages run it: True and False as given; "auto" is False where graphs cannot serve: off a
    GPU, with offload (a graph replays into the same memory, which cannot leave the device), and on sharded or
    tensor-parallel stages (whose collectives run between a stage's kernels)."""
    if cuda_graphs not in (True, False, "auto"):
        raise ValueError(f'Pipeline: cuda_graphs must be True, False or "auto", not {cuda_graphs!r}')
    if cuda_graphs != "auto":
        return cuda_graphs
    tensor_parallel = any(isinstance(p, DTensor) for module in modules for p in module.parameters())
    serves = device.type == "cuda" and not (sharded or tensor_parallel or offload is not False)
    return "auto" if serves else False


def check_options(device: torch.device, *, auto: bool, sharded: bool, cuda_graphs: bool, device_timing: bool,
                  main_grad: bool, offload) -> None:
    """Options that do not go together, or not with the stages' device (``cuda_graphs``: graphs asked for, True)."""
    if not isinstance(offload, (bool, OffloadPlan)):
        raise ValueError(f"Pipeline: offload must be True, False or a pipecomm OffloadPlan, not {offload!r}")
    if offload is not False and cuda_graphs:
        raise ValueError("Pipeline: offload cannot be combined with cuda_graphs=True: a graph replays into the same "
                         "memory every time, so its saved activations cannot leave the device; use one or the other")
    if isinstance(offload, OffloadPlan) and auto:
        raise ValueError('Pipeline: an OffloadPlan is for one schedule, and schedule="auto" changes it; pass '
                         "offload=True, which plans for the schedule auto settles on")
    if auto and cuda_graphs:
        raise ValueError('Pipeline: schedule="auto" changes the schedule after its measured steps, and with '
                         "it the order of each stage's passes, which cuda_graphs=True captures at the first step; "
                         "plan first (pipecomm.plan_schedule) and pass the Schedule")
    for flag, value in (("cuda_graphs", cuda_graphs), ("device_timing", device_timing)):
        if value and device.type != "cuda":
            raise ValueError(f"Pipeline: {flag}=True needs stages on a CUDA device, not {device}")
    if sharded and (cuda_graphs or main_grad):
        raise ValueError("Pipeline: stages sharded with fully_shard take neither cuda_graphs=True nor "
                         "main_grad=True (FSDP's MixedPrecisionPolicy(reduce_dtype=torch.float32) keeps fp32 "
                         "gradients)")


def check_schedule(schedule: Schedule, stages, rank: int, micro_batches: int) -> None:
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


def module_device(modules) -> torch.device:
    for module in modules:
        for param in module.parameters():
            return param.device
    return torch.device("cpu")


def starting_schedule(schedule: str | Schedule, num_ranks: int, micro_batches: int, stages: list[int],
                      rank: int) -> Schedule:
    """The schedule a Pipeline starts with (for "auto", the one it measures with), checked against this rank's stages."""
    if isinstance(schedule, Schedule):
        chosen = schedule
    elif schedule == "auto":
        chosen = initial_schedule(num_ranks, micro_batches, stages, rank)
    else:
        chosen = make_schedule(schedule, num_ranks, micro_batches, len(stages))
    check_schedule(chosen, stages, rank, micro_batches)
    validate(chosen)
    return chosen


def gradient_hook(module: nn.Module, post_accumulate_only: bool = False) -> str | None:
    """The first trainable parameter of ``module`` with a gradient hook (``register_hook``, or with
    ``post_accumulate_only`` a ``register_post_accumulate_grad_hook`` alone), said; None where none has one."""
    for name, param in module.named_parameters():
        if param.requires_grad and param._post_accumulate_grad_hooks:
            return f"parameter {name!r} has a post-accumulate-grad hook"
        if param.requires_grad and param._backward_hooks and not post_accumulate_only:
            return f"parameter {name!r} has a gradient hook (register_hook)"
    return None


def has_post_accumulate_hooks(params) -> bool:
    """Cheap enough for every step: one attribute read per parameter."""
    return any(param._post_accumulate_grad_hooks for param in params)
