"""graph_capture: Python's collector kept out of a CUDA-graph capture."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from pipecomm.runtime.graph_capture import capture_into
from ranks import needs_cuda


def test_the_collector_is_paused_during_a_capture_and_set_back_after(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: contextlib.nullcontext())
    seen = []

    def broken() -> None:
        seen.append(gc.isenabled())
        raise RuntimeError("the capture broke")

    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            capture_into(None, lambda: seen.append(gc.isenabled()), None, None)
            assert gc.isenabled() is enabled
        gc.enable()
        with pytest.raises(RuntimeError, match="the capture broke"):
            capture_into(None, broken, None, None)
        assert gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False, False]


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self):
        self.itself = self


@needs_cuda
def test_on_gpu_a_graph_left_in_a_reference_cycle_cannot_break_a_later_capture():
    """Destroying a CUDA graph synchronizes the device, which a capture forbids: a collection inside a capture that
    freed a closed Pipeline's graphs invalidated it (test_compiled's inductor + graphs twin, 2 runs in 3 on two
    H200s). Here the capture allocates enough objects for the collector to run several times over."""
    stream = torch.cuda.Stream()
    x = torch.ones(1024, device="cuda")
    garbage = _Cycle()
    garbage.graph = torch.cuda.CUDAGraph()
    capture_into(garbage.graph, lambda: x.mul(2), torch.cuda.graph_pool_handle(), stream)
    del garbage
    graph, outputs = torch.cuda.CUDAGraph(), []

    def run() -> None:
        outputs.append(x * 3)
        assert len([[] for _ in range(200_000)]) == 200_000  # containers: the collector's thresholds are met

    capture_into(graph, run, torch.cuda.graph_pool_handle(), stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outputs[0], torch.full_like(x, 3))
    gc.collect()  # the garbage graph is destroyed here, outside any capture
