"""CUDA-event timing of a rank's compute actions, for the bubble the GPU saw rather than the host's launch time."""

from __future__ import annotations

import torch

__all__: list[str] = []


class DeviceTimeline:
    """Events around each compute action of the last step, on the stream the actions run on.

    Recording costs a few microseconds of host time per event and no synchronisation; reading
    (``bubble_fraction``) waits for the step's last event.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._step = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._marks: list[torch.cuda.Event] = []  # reused step after step: start, end, start, end, ...
        self._used = 0

    def start_step(self) -> None:
        self._used = 0
        self._step[0].record(torch.cuda.current_stream(self.device))

    def mark(self) -> None:
        """Called right before and right after each compute action."""
        if self._used == len(self._marks):
            self._marks.append(torch.cuda.Event(enable_timing=True))
        self._marks[self._used].record(torch.cuda.current_stream(self.device))
        self._used += 1

    def end_step(self) -> None:
        self._step[1].record(torch.cuda.current_stream(self.device))

    def spans(self) -> list[tuple[float, float]]:
        """(start, end) in seconds from the step's start, per compute action of the last step, in order."""
        self._step[1].synchronize()
        origin = self._step[0]
        return [(origin.elapsed_time(self._marks[i]) / 1e3, origin.elapsed_time(self._marks[i + 1]) / 1e3)
                for i in range(0, self._used, 2)]

    def step_seconds(self) -> float:
        """The last step's GPU time, from its start to its end (waits for the end)."""
        self._step[1].synchronize()
        return self._step[0].elapsed_time(self._step[1]) / 1e3

    def bubble_fraction(self) -> float:
        """The share of the last step's GPU time, from its start to its end, not spent in compute actions."""
        if self._used == 0:
            return 0.0
        busy = sum(end - start for start, end in self.spans())
        span = self._step[0].elapsed_time(self._step[1]) / 1e3
        return min(1.0, max(0.0, 1.0 - busy / span)) if span > 0 else 0.0
