"""One pass's CUDA-graph capture: its stream, its pool's segments, and Python's collector kept out of it."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable

import torch

__all__: list[str] = []

_capture_streams = threading.local()  # ``capture_stream``'s, by device, for each thread


def capture_into(graph: torch.cuda.CUDAGraph, run: Callable[[], None], pool, stream: torch.cuda.Stream,
                 empty_ok: bool = False) -> None:
    """``run``'s kernels captured into ``graph``, its memory from ``pool``, Python's cyclic collector paused.

    A collection inside a capture may destroy another CUDA graph that had become garbage in a reference cycle (a closed
    Pipeline's, a recapture's predecessor): destroying a graph and freeing its pool synchronizes the device, which a
    capture forbids, so the capture fails with cudaErrorStreamCaptureInvalidated, at a moment the collector picks.
    Measured on two H200s: test_compiled's inductor + graphs twin (three Pipelines one after another in a process)
    failed so in 2 runs of 3, the driver's log (CUDA_LOG_FILE) naming cuGraphExecDestroy, cuMemFree and
    cuCtxSynchronize called inside the capture; with the collector paused, 8 of 8 passed. torch.cuda.graph collected before each capture until torch made that opt-in
    (``torch.compiler.config.force_cudagraph_gc``), for its cost. Paused, the garbage waits for a collection outside.

    With ``empty_ok``, without torch's warning that the graph is empty (which blames a wrong device or stream): a W
    pass of a stage that deferred nothing, its Linears inside compiled regions, is empty, and the Pipeline has said
    why once already."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            if empty_ok:
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                run()
    finally:
        if collecting:
            gc.enable()


class ExpandableSegments:
    """Entered around each capture: the caching allocator's expandable segments on while it allocates the graphs'
    pool, and off again after it, unless the caller had them on. The pool then grows as one stretch of addresses,
    where segments sized for the first allocation that needed each left 4-10% of it unusable (one H200, two ranks: a
    graphed 1f1b's peak over an eager one's, 1.090x -> 1.046x on e2e's compute config). Around each capture, not all
    of them: between two, a sent output's data is freed, which allocates in the default pool, and a segment made
    there could later hold a buffer the IPC channel shares with the peer, which expandable segments forbid (no tensor
    of the pool is shared). The setting is the process's: another thread allocating during a capture gets expandable
    segments too."""

    def __init__(self, device: torch.device):
        self._settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        self._switch = (device.type == "cuda" and self._settings is not None
                        and torch.cuda.get_allocator_backend() == "native" and not _expandable_in_use())

    def __enter__(self) -> None:
        if self._switch:
            self._settings("expandable_segments:True")

    def __exit__(self, *exception) -> None:
        if self._switch:
            self._settings("expandable_segments:False")


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream this thread warms up and captures on for ``device``, the same for every capture: cuBLAS gives each
    stream it runs on a workspace from the caching allocator (32 MiB on Hopper) and keeps it for the process, so a new
    stream per capture (torch's pool hands out 32 in turn) kept one more each time a Pipeline recaptured or another
    Pipeline captured. One per thread, since a stream takes one capture at a time."""
    streams = _thread_capture_streams()
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def forget_capture_stream(device: torch.device) -> None:
    """After a failed capture: this thread's next capture on ``device`` gets a new stream, since whatever broke the
    capture may have left the old one in a state of its own."""
    _thread_capture_streams().pop(device, None)


def _thread_capture_streams() -> dict[torch.device, torch.cuda.Stream]:
    if not hasattr(_capture_streams, "by_device"):
        _capture_streams.by_device = {}
    return _capture_streams.by_device


def _expandable_in_use() -> bool:
    """Whether the caller has the allocator's expandable segments on, as the allocator's settings say (torch 2.11 has
    no getter for them, but its snapshot carries them: the segments alone cannot tell, since a caller that turned them
    on may have allocated nothing new since)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return "expandable_segments:true" in getter().replace(" ", "").lower()
    return bool(torch.cuda.memory._snapshot().get("allocator_settings", {}).get("expandable_segments"))
