"""offload=True on a running Pipeline: one step measures what waits and how long the passes take, then every rank
plans alike (``plan_offload``) and its activations go to host memory from the next step on."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from pipecomm.runtime import step_trace
from pipecomm.runtime.collectives import PipelineCollectives
from pipecomm.runtime.executor import StageExecutor
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.schedules.offload import OffloadPlan, plan_offload
from pipecomm.schedules.simulation import simulate

__all__: list[str] = []

# Bytes copied each way to measure the link between device and host memory.
_PROBE_BYTES = 64 << 20


class OffloadPlanner:
    """Measures on one step this rank's F, B, I and W and the bytes a micro-batch's forward saves, and once the
    copy's speed each way; plans for the slowest rank's (a max over the pipeline, so that every rank plans alike)."""

    def __init__(self, collectives: PipelineCollectives, num_ranks: int, device: torch.device):
        self.collectives = collectives
        self.num_ranks = num_ranks
        self.device = device
        self._measuring: ActivationOffloader | None = None

    def before_step(self, executor: StageExecutor, parameters) -> None:
        """The step to measure: every forward's saved activations counted, none copied."""
        if self._measuring is None:
            waits = [(action.stage, action.micro_batch, "F") for action in executor.schedule.actions[executor.rank]
                     if action.kind == "F"]
            self._measuring = ActivationOffloader(self.device, waits, parameters, measure_only=True)
            executor.set_offload(self._measuring, {})

    def after_step(self, executor: StageExecutor) -> OffloadPlan:
        executor.set_offload(None, {})
        schedule = executor.schedule
        durations: dict[tuple[str, int], list[float]] = {}
        for start, end, action in step_trace.compute_spans(executor):
            durations.setdefault((action.kind, action.stage), []).append(end - start)
        costs = [sum(statistics.median(times) for (kind, _), times in durations.items() if kind == wanted)
                 for wanted in ("F", "B", "I", "W")]
        per_micro_batch: dict[int, int] = {}
        for (_, micro_batch, _), size in self._measuring.parked_bytes.items():
            per_micro_batch[micro_batch] = per_micro_batch.get(micro_batch, 0) + size
        activation_bytes = statistics.median(per_micro_batch.values()) if per_micro_batch else 0.0
        to_host, to_device = copy_speeds(self.device)
        measured = self._slowest_rank([*costs, activation_bytes / to_host, activation_bytes / to_device])
        costs = dict(zip(("F", "B", "I", "W"), measured[:4]))
        if costs["B"] == 0.0:  # a split backward: its B is its I and W
            costs["B"] = costs["I"] + costs["W"]
        timeline = simulate(schedule, costs).timeline
        return plan_offload(schedule, timeline, measured[4], measured[5])

    def _slowest_rank(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.collectives.wire_device())
        if self.num_ranks > 1:
            self.collectives.all_reduce(tensor, dist.ReduceOp.MAX, "the all-reduce of the offload measurements")
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
