"""offload=True on a running Pipeline: one step measures what waits and how long the passes take, then every rank
plans alike (``plan_offload``) and its activations go to host memory from the next step on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.schedules.offload import OffloadPlan, plan_offload
from pipecomm.schedules.schedule import Schedule
from pipecomm.schedules.simulation import simulate

__all__: list[str] = []

# Bytes copied each way to measure the link between device and host memory.
_PROBE_BYTES = 64 << 20


class SavedBytesMeter:
    """The bytes a micro-batch's forward saves on this rank (over its stages, their parameters and buffers aside),
    counted on the steps it is attached to by an offloader that copies nothing."""

    def __init__(self, device: torch.device, modules: Iterable[nn.Module]):
        self.device = device
        self.modules = list(modules)
        self._counted: ActivationOffloader | None = None

    def attach(self, executor: StageExecutor) -> None:
        if self._counted is None:
            waits = [(action.stage, action.micro_batch, "F") for action in executor.schedule.actions[executor.rank]
                     if action.kind == "F"]
            self._counted = ActivationOffloader(self.device, waits, self.modules, measure_only=True)
        executor.set_offload(self._counted, {})

    def detach(self, executor: StageExecutor) -> None:
        executor.set_offload(None, {})

    def per_micro_batch(self) -> float:
        summed: dict[int, int] = {}
        for (_, micro_batch, _), size in (self._counted.parked_bytes if self._counted else {}).items():
            summed[micro_batch] = summed.get(micro_batch, 0) + size
        return statistics.median(summed.values()) if summed else 0.0

    def copy_times(self) -> list[float]:
        """Seconds to copy one micro-batch's saved bytes to host memory and back."""
        size = self.per_micro_batch()
        return [size / speed for speed in copy_speeds(self.device)]


class OffloadPlanner:
    """Measures on one step this rank's F, B, I and W, the bytes a micro-batch's forward saves and the copies' speed
    each way; plans for the slowest rank's (a max over the pipeline, so that every rank plans alike)."""

    def __init__(self, collectives: PipelineCollectives, num_ranks: int, device: torch.device,
                 modules: Iterable[nn.Module]):
        self.collectives = collectives
        self.num_ranks = num_ranks
        self.meter = SavedBytesMeter(device, modules)

    def before_step(self, executor: StageExecutor) -> None:
        """The step to measure: every forward's saved activations counted, none copied."""
        self.meter.attach(executor)

    def after_step(self, executor: StageExecutor, schedule: Schedule) -> OffloadPlan:
        """The plan for ``schedule`` (the measured step's, or the one the next steps run) at the measured costs."""
        self.meter.detach(executor)
        durations: dict[tuple[str, int], list[float]] = {}
        for start, end, action in step_trace.compute_spans(executor):
            durations.setdefault((action.kind, action.stage), []).append(end - start)
        costs = [sum(statistics.median(times) for (kind, _), times in durations.items() if kind == wanted)
                 for wanted in ("F", "B", "I", "W")]
        measured = slowest_rank(self.collectives, self.num_ranks, [*costs, *self.meter.copy_times()],
                                "the offload measurements")
        costs = dict(zip(("F", "B", "I", "W"), measured[:4]))
        if costs["B"] == 0.0:  # a split backward: its B is its I and W
            costs["B"] = costs["I"] + costs["W"]
        return offload_plan_for(schedule, costs, measured[4:])


def offload_plan_for(schedule: Schedule, costs: Mapping[str, float], copy_times: list[float]) -> OffloadPlan:
    """``plan_offload`` on ``schedule``'s simulated timeline at ``costs``, with ``copy_times`` (out, back)."""
    return plan_offload(schedule, simulate(schedule, costs).timeline, *copy_times)


def slowest_rank(collectives: PipelineCollectives, num_ranks: int, values: list[float], what: str) -> list[float]:
    """Each value's maximum over the pipeline's ranks (the same list on every rank)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=collectives.wire_device())
    if num_ranks > 1:
        collectives.all_reduce(tensor, dist.ReduceOp.MAX, f"the all-reduce of {what}")
    return tensor.tolist()


def copy_speeds(device: torch.device) -> tuple[float, float]:
    """Bytes per second from ``device`` to pinned host memory and back (on the CPU: a host copy, both ways)."""
    if device.type != "cuda":
        source = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
        started = time.perf_counter()
        source.clone()
        speed = _PROBE_BYTES / max(time.perf_counter() - started, 1e-9)
        return speed, speed
    on_device = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    on_host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    speeds = []
    for destination, source in ((on_host, on_device), (on_device, on_host)):
        destination.copy_(source, non_blocking=True)  # the first copy pays for setting up the pinned mapping
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        destination.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        speeds.append(_PROBE_BYTES / (start.elapsed_time(end) / 1e3))
    return speeds[0], speeds[1]
