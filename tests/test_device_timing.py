"""device_timing: the bubble from CUDA events around compute actions, and a clear error off the GPU."""

from __future__ import annotations

import json
import time

import pytest
import torch

import pipecomm
from ranks import needs_cuda


def pipeline(device: str, **options) -> pipecomm.Pipeline:
    return pipecomm.Pipeline(torch.nn.Linear(8, 8).to(device), stage=0, num_stages=1, micro_batches=4,
                             loss_fn=torch.nn.functional.mse_loss, device=device, **options)


def test_device_timing_needs_a_cuda_device():
    with pytest.raises(ValueError, match="device_timing=True needs stages on a CUDA device"):
        pipeline("cpu", device_timing=True)


@needs_cuda
def test_the_bubble_comes_from_events_around_every_compute_action():
    pipe = pipeline("cuda", device_timing=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    for _ in range(2):  # the second step reuses the first one's events
        pipe.step(x, target=y)
        bubble = pipe.bubble_fraction()
        assert 0.0 <= bubble < 1.0
        compute = sum(1 for action in pipe.schedule.actions[0] if action.is_compute)
        assert pipe._executor.device_timeline._used == 2 * compute
    # A host-side pause inside the step's span is idle GPU time, and the bubble shows it.
    timeline = pipe._executor.device_timeline
    timeline.start_step()
    timeline.mark()
    torch.cuda._sleep(1_000_000)
    timeline.mark()
    torch.cuda.synchronize()
    time.sleep(0.05)
    timeline.end_step()
    assert timeline.bubble_fraction() > 0.5
    pipe.close()


@needs_cuda
def test_trace_shows_compute_actions_at_gpu_times(tmp_path):
    pipe = pipeline("cuda", device_timing=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    pipe.step(x, target=y)
    pipe.trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    compute = [str(action) for action in pipe.schedule.actions[0] if action.is_compute]
    assert [event["name"] for event in events] == compute
    ends = [event["ts"] + event["dur"] for event in events]
    assert all(event["ts"] >= 0 and event["dur"] >= 0 for event in events)
    assert all(later["ts"] >= end for later, end in zip(events[1:], ends))  # one stream: no overlap
    pipe.close()
