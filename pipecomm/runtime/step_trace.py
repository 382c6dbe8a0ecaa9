"""One step's timeline on a rank: its bubble fraction, and a Chrome trace of every rank's actions."""

from __future__ import annotations

import json

from pipecomm.runtime.executor import StageExecutor
from pipecomm.schedules.schedule import Action

__all__: list[str] = []

Entry = tuple[float, float, str, str]  # (start, end, action, kind)


def bubble_fraction(executor: StageExecutor) -> float:
    """The rank's idle share of the last step: 1 - time in compute actions / the step's span (the GPU's times with a
    device timeline, else the host's)."""
    if executor.device_timeline:
        return executor.device_timeline.bubble_fraction()
    timeline = executor.timeline
    if not timeline:
        return 0.0
    span = timeline[-1][1] - timeline[0][0]
    busy = sum(end - start for start, end, action in timeline if action.is_compute)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def step_seconds(executor: StageExecutor) -> float:
    """How long the rank's last step took: the GPU's time from its start to its end with a device timeline (a
    step the host cannot keep fed takes as long as the host does), else the host's."""
    if executor.device_timeline:
        return executor.device_timeline.step_seconds()
    timeline = executor.timeline
    return timeline[-1][1] - timeline[0][0] if timeline else 0.0


def compute_spans(executor: StageExecutor) -> list[tuple[float, float, Action]]:
    """(start, end, action) of the last step's compute actions: CUDA-event times (seconds from the step's start)
    with a device timeline, else the host clock."""
    if executor.device_timeline:
        compute = [action for _, _, action in executor.timeline if action.is_compute]
        return [(start, end, action) for (start, end), action in zip(executor.device_timeline.spans(), compute)]
    return [entry for entry in executor.timeline if entry[2].is_compute]


def timeline(executor: StageExecutor) -> list[Entry]:
    """The last step's actions: with a device timeline its compute actions at the GPU's times, else every action
    at the host's."""
    entries = compute_spans(executor) if executor.device_timeline else executor.timeline
    return [(start, end, str(action), action.kind) for start, end, action in entries]


def write_chrome_trace(path: str, timelines: list[list[Entry]], device_timed: bool) -> None:
    """Every rank's ``timeline`` as one Chrome trace (chrome://tracing, Perfetto): a process per rank, compute and
    transfers on two threads; host times from the earliest rank's start, device times each from its own step's."""
    origin = 0.0 if device_timed else min((events[0][0] for events in timelines if events), default=0.0)
    trace_events = [
        {
            "name": name,
            "ph": "X",
            "ts": (start - origin) * 1e6,
            "dur": (end - start) * 1e6,
            "pid": rank,
            "tid": "comm" if kind.startswith(("SEND", "RECV")) else "compute",
        }
        for rank, events in enumerate(timelines)
        for start, end, name, kind in events
    ]
    with open(path, "w") as file:
        json.dump({"traceEvents": trace_events, "displayTimeUnit": "ms"}, file)
