"""GPU benchmark: pipecomm's point-to-point transport vs NCCL send/recv and a peer copy, on 2 GPUs of one host.

Spawns two ranks (rank r on cuda:r, one NCCL process group) and measures, in one run:
  1. one uint8 tensor per message, 4 KB .. 256 MB: one-way latency (half a ping-pong round trip,
     timed on rank 0) and streaming bandwidth (rank 0 sends back to back, timed on rank 1), for a
     pipecomm channel and for dist.send/recv; the ceiling is an in-process copy-engine peer copy
     cuda:0 -> cuda:1 (rank 0 alone, at the end);
  2. 8 mixed-dtype tensors per message (~64 KB and ~16 MB): one pipecomm send vs 8 dist.send and
     one dist.batch_isend_irecv of 8;
  3. bf16 GEMM TFLOP/s on both GPUs alone and while 256 MB messages stream from rank 0 to rank 1
     on another stream (pipecomm, then NCCL).
--smoke runs a tiny version on CPU (gloo; pipecomm backend "shm", or "dist") to check the control
flow on a machine without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from _common import (
    RankFailure,
    environment,
    gb_per_s,
    mixed_tensors,
    print_environment,
    print_table,
    spawn_ranks,
    start_rank,
    write_json,
)

WORLD_SIZE = 2
# ~10 ms of torch.cuda._sleep at ~2 GHz: the host queues a whole GEMM window behind it, so host
# stalls (GIL, the transfer thread) cannot open gaps inside the window.
# GPU cycles a GEMM window sleeps first (~50 ms at H100/H200 clocks): every GEMM is enqueued before the
# GPU reaches the first, so the transfer thread's hold on the GIL cannot starve the GEMMs of launches.
SLEEP_CYCLES = 100_000_000
SLEEP_MS_BOUND = 80.0  # the sleep at the slowest clock these GPUs run
# Targets the project has to show; printed with the measured ratios.
TARGET_BW_FRACTION, TARGET_BW_MIN_BYTES = 0.95, 64 << 20
TARGET_LATENCY_RATIO, TARGET_LATENCY_BYTES = 1 / 3, 4 << 10
TARGET_GEMM_LOSS_PCT = 3.0

P2P_COLUMNS = ["size", "pc_us", "nccl_us", "pc/nccl_us", "pc_host_us", "nccl_host_us", "pc_GB/s", "nccl_GB/s", "peer_GB/s", "copy__GB/s",
               "pc/peer", "nccl/peer"]
TUPLE_COLUMNS = ["case", "MB", "timing", "pc_us", "nccl_x8_us", "nccl_batch_us", "pc/nccl_x8", "pc/nccl_batch"]
GEMM_COLUMNS = ["rank", "role", "alone_TF/s", "drift%", "+pc_TF/s", "pc_loss%", "+nccl_TF/s", "nccl_loss%",
                "copy_loss%", "covered", "pc_xfer_GB/s", "nccl_xfer_GB/s", "copy_xfer_GB/s"]
# The same windows seen through NVML: whether a loss is the SM clock dropping (power) or the GEMM sharing.
CLOCK_COLUMNS = ["rank", "role", "alone_MHz", "pc_clock_loss%", "pc_loss%", "nccl_clock_loss%", "nccl_loss%",
                 "copy_clock_loss%", "copy_loss%", "alone_W", "pc_W", "capped"]


# ---------------------------------------------------------------------------------------------
# Timing and rank plumbing


class Clock:
    """Marks in the current stream's order (CUDA events) on a GPU; host time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        """end - start in milliseconds; negative when end came first (marks on different streams)."""
        if self.cuda:
            start.synchronize()
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


@dataclass
class RankContext:
    rank: int
    peer: int
    device: torch.device
    store: dist.Store
    clock: Clock
    args: argparse.Namespace

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Both ranks idle and at the same point: local GPU work drained, then a barrier."""
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def host_barrier(self, name: str) -> None:
        """A barrier through the store: unlike dist.barrier it leaves no NCCL kernel spinning on the GPU."""
        self.store.set(f"p2p/{name}/{self.rank}", "1")
        self.store.wait([f"p2p/{name}/{self.peer}"], datetime.timedelta(seconds=self.args.timeout))

    def all_reduce(self, value: float, op: str) -> float:
        reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(tensor, op=reduce_op)
        return float(tensor.item())

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[p2p] {message}", file=sys.stderr, flush=True)


class Mover(Protocol):
    """One way of moving a message (a list of tensors) to the peer: what the patterns below time."""

    def send(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def recv(self, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]: ...


class PipecommMover:
    def __init__(self, channel: Any):
        self.channel = channel

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        self.channel.send(tensors)

    def recv(self, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return self.channel.recv()  # pipecomm learns the layout from the message itself


class LabelledMover:
    """A mover whose calls show as pipecomm.send / pipecomm.recv in a profiler trace. Only for
    --profile: record_function costs the host 2-4 us per call even with no profiler running, which
    the timed movers must not pay (the NCCL ones have no such label)."""

    def __init__(self, mover: Mover):
        self.mover = mover

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        with torch.profiler.record_function("pipecomm.send"):
            self.mover.send(tensors)

    def recv(self, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        with torch.profiler.record_function("pipecomm.recv"):
            return self.mover.recv(like)


def profile_ping_pong(ctx: RankContext, mover: Mover, nbytes: int, directory: str) -> None:
    """A torch.profiler trace of pipecomm's ping-pong on each rank: where the host's time per message
    goes (CUDA runtime calls inside pipecomm.send / pipecomm.recv, the wait for the peer's note)."""
    message = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ctx.cuda else [])
    with torch.profiler.profile(activities=activities) as profiler:
        ping_pong(ctx, LabelledMover(mover), message)
    os.makedirs(directory, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(directory, f"pingpong-rank{ctx.rank}.json"))
    with open(os.path.join(directory, f"pingpong-rank{ctx.rank}.txt"), "w") as table:
        table.write(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


class DistMover:
    """torch.distributed send/recv, one call per tensor (or one batch_isend_irecv), into reused buffers.

    dist.send/recv and Work.wait() only order the current stream after the NCCL stream, so the host
    does not block on the GPU, as with pipecomm.
    """

    def __init__(self, peer: int, batched: bool):
        self.peer = peer
        self.batched = batched
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        if self.batched:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.peer) for t in tensors]):
                work.wait()
        else:
            for tensor in tensors:
                dist.send(tensor, self.peer)

    def recv(self, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        # Buffers are reused per layout, as a pipeline stage would: NCCL needs them before the message.
        key = tuple((t.dtype, tuple(t.shape)) for t in like)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = [torch.empty_like(t) for t in like]
        if self.batched:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, self.peer) for t in buffers]):
                work.wait()
        else:
            for tensor in buffers:
                dist.recv(tensor, self.peer)
        return buffers


class PeerCopyMover:
    """Raw cudaMemcpyPeerAsync copies from rank 0 into a buffer on cuda:1 that rank 0 allocated itself, with
    nothing on rank 1: the copy engine's own cost to the GEMMs, the floor for any copy-engine transport.

    one_sided: rank 1's recv and rank 0's recv of acks return at once, so only rank 0 can tell when the
    copies ran.
    """

    one_sided = True

    def __init__(self, ctx: RankContext, cudart: ctypes.CDLL, nbytes: int):
        self.cudart = cudart
        self.source_device = ctx.device.index
        self.destination = None
        if ctx.rank == 0:
            self.destination = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", 1))
            self.destination[:1].copy_(torch.zeros(1, dtype=torch.uint8, device=ctx.device))  # torch enables peer access

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        source = tensors[0]
        if self.destination is None or source.numel() != self.destination.numel():
            return
        status = self.cudart.cudaMemcpyPeerAsync(self.destination.data_ptr(), 1, source.data_ptr(),
                                                 self.source_device, source.numel(),
                                                 torch.cuda.current_stream().cuda_stream)
        if status != 0:
            raise RuntimeError(f"cudaMemcpyPeerAsync failed with CUDA error {status}")

    def recv(self, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return like

    def ms_per_copy(self, ctx: RankContext, payload: torch.Tensor, count: int) -> float:
        """Rank 0: ms per back-to-back copy."""
        self.send([payload])
        start = ctx.clock.mark()
        for _ in range(count):
            self.send([payload])
        return ctx.clock.ms(start, ctx.clock.mark()) / count


# ---------------------------------------------------------------------------------------------
# Timed patterns. Both ranks call each with the same arguments; the timing rank returns its samples.


def ping_pong(ctx: RankContext, mover: Mover,
              message: list[torch.Tensor]) -> tuple[list[float], list[float]] | None:
    """Rank 0: per repetition, one-way ms = half the mean round trip, on the GPU and on the host clock
    (the host's enqueueing alone; when it matches the GPU's, the host bounds the latency). Rank 1
    echoes what it receives."""
    args = ctx.args

    def round_trip() -> None:
        if ctx.rank == 0:
            mover.send(message)
            mover.recv(message)
        else:
            mover.send(mover.recv(message))  # the echo is ordered after the data arrived

    for _ in range(args.warmup):
        round_trip()
    samples, host_samples = [], []
    for _ in range(args.reps):
        ctx.sync()
        # An untimed round trip first: the start mark then waits for its echo on the GPU, so the
        # barrier's skew between the ranks stays out of the timing.
        round_trip()
        start = ctx.clock.mark()
        host_start = time.perf_counter()
        for _ in range(args.iters):
            round_trip()
        host_ms = (time.perf_counter() - host_start) * 1e3
        end = ctx.clock.mark()  # after the last recv, whose data the current stream waits for
        if ctx.rank == 0:
            samples.append(ctx.clock.ms(start, end) / args.iters / 2)
            host_samples.append(host_ms / args.iters / 2)
    ctx.sync()
    return (samples, host_samples) if ctx.rank == 0 else None


def streaming(ctx: RankContext, mover: Mover, message: list[torch.Tensor], iters: int | None = None,
              reps: int | None = None) -> list[float] | None:
    """Rank 1: per repetition, ms per message while rank 0 sends iters messages back to back."""
    iters = iters or ctx.args.iters
    reps = reps or ctx.args.reps
    for _ in range(ctx.args.warmup):
        if ctx.rank == 0:
            mover.send(message)
        else:
            mover.recv(message)
    samples = []
    for _ in range(reps):
        ctx.sync()
        if ctx.rank == 0:
            for _ in range(iters + 1):
                mover.send(message)
        else:
            mover.recv(message)  # untimed first message: timing starts at its arrival
            start = ctx.clock.mark()
            for _ in range(iters):
                mover.recv(message)
            end = ctx.clock.mark()
            samples.append(ctx.clock.ms(start, end) / iters)
    ctx.sync()
    return samples if ctx.rank == 1 else None


def load_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (found in /proc/self/maps), for cudaMemcpyPeerAsync.

    None when torch links it statically or the platform has no /proc: the raw peer copy is then skipped.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line.split()[-1]})
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)
            function = library.cudaMemcpyPeerAsync
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                             ctypes.c_void_p]
        function.restype = ctypes.c_int
        return library
    return None


def peer_copy(ctx: RankContext, nbytes: int, raw: bool) -> list[float] | None:
    """Rank 0 alone: ms per back-to-back copy from cuda:0 to cuda:1 on a copy engine.

    raw: cudaMemcpyPeerAsync itself on cuda:0's current stream, the ceiling. Otherwise
    dst.copy_(src, non_blocking=True), which adds torch's two-way event handshake between the
    devices' streams around every copy (about 14 us on H200), so it sits below the ceiling up to
    ~64 MB. Smoke runs copy CPU to CPU so the table code has a number.
    """
    args = ctx.args
    destination_device = torch.device("cuda", 1) if ctx.cuda and not args.share_gpu else ctx.device
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=ctx.device)
    destination = torch.empty(nbytes, dtype=torch.uint8, device=destination_device)
    copy: Callable[[], object] = lambda: destination.copy_(source, non_blocking=True)  # noqa: E731
    if raw:
        cudart = load_cudart() if ctx.cuda else None
        if cudart is None:
            return None
        destination.copy_(source)  # lets torch enable peer access between the devices first
        stream = torch.cuda.current_stream(ctx.device).cuda_stream

        def copy() -> None:
            status = cudart.cudaMemcpyPeerAsync(destination.data_ptr(), destination_device.index,
                                                source.data_ptr(), ctx.device.index, nbytes, stream)
            if status != 0:
                raise RuntimeError(f"cudaMemcpyPeerAsync failed with CUDA error {status}")

    for _ in range(args.warmup):
        copy()
    samples = []
    for _ in range(args.reps):
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
            torch.cuda.synchronize(destination_device)
        # Both copies run on the source device's current stream, where the marks go.
        start = ctx.clock.mark()
        for _ in range(args.iters):
            copy()
        end = ctx.clock.mark()
        samples.append(ctx.clock.ms(start, end) / args.iters)
    return samples


# ---------------------------------------------------------------------------------------------
# GEMM interference


class TransferThread(threading.Thread):
    """count messages from rank 0 to rank 1 on a side stream, while the main thread runs GEMMs.

    The side stream keeps the transfer independent of the GEMMs on the default stream (send orders
    after the current stream's prior work, recv makes the current stream wait). Rank 1 acks the
    first and the last message, so each rank can mark on its own GPU when the transfer was running.
    """

    def __init__(self, ctx: RankContext, mover: Mover, payload: torch.Tensor, count: int):
        super().__init__(daemon=True)
        self.ctx, self.mover, self.payload, self.count = ctx, mover, payload, count
        self.ack = torch.zeros(16, dtype=torch.uint8, device=ctx.device)
        self.started = threading.Event()
        self.first: Any = None
        self.last: Any = None
        self.error: str | None = None

    def run(self) -> None:
        ctx, mover, clock = self.ctx, self.mover, self.ctx.clock
        try:
            if ctx.cuda:
                torch.cuda.set_device(ctx.device)  # the current device is per thread
                scope = torch.cuda.stream(torch.cuda.Stream(ctx.device))
            else:
                scope = contextlib.nullcontext()
            with scope:
                if ctx.rank == 0:
                    mover.send([self.payload])
                    mover.recv([self.ack])
                    self.first = clock.mark()
                    self.started.set()
                    for _ in range(self.count - 1):
                        mover.send([self.payload])
                    mover.recv([self.ack])
                    self.last = clock.mark()
                else:
                    mover.recv([self.payload])
                    self.first = clock.mark()
                    mover.send([self.ack])
                    self.started.set()
                    for _ in range(self.count - 1):
                        mover.recv([self.payload])
                    self.last = clock.mark()
                    mover.send([self.ack])
        except BaseException:
            self.error = traceback.format_exc()
        finally:
            self.started.set()


class GpuClocks:
    """SM clock, power and whether the power cap is throttling, read from NVML (the driver's libnvidia-ml).

    Tells a GEMM slowed by sharing memory or SMs from one slowed by its clock: a GPU at its power cap
    lowers the clock when a copy engine and NVLink draw power beside the GEMM. None of it on CPU or
    where the library cannot be loaded.
    """

    SM_CLOCK = 1  # NVML_CLOCK_SM
    POWER_CAP_REASONS = 0x4 | 0x80  # SW power cap, HW power brake

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda" or os.environ.get("CUDA_VISIBLE_DEVICES"):
            return  # NVML numbers the GPUs physically; only an unmasked process can match them to cuda:i
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            self.reads = (nvml.nvmlDeviceGetClockInfo, nvml.nvmlDeviceGetPowerUsage,
                          nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
            handle = ctypes.c_void_p()
            if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetHandleByIndex_v2(device.index, ctypes.byref(handle)) == 0:
                self.handle = handle
        except (OSError, AttributeError):
            self.handle = None

    def sample(self) -> tuple[float, float, bool] | None:
        """(SM MHz, watts, power-capped) now."""
        if self.handle is None:
            return None
        clock_info, power_usage, throttle_reasons = self.reads
        mhz, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        if (clock_info(self.handle, self.SM_CLOCK, ctypes.byref(mhz))
                or power_usage(self.handle, ctypes.byref(milliwatts))
                or throttle_reasons(self.handle, ctypes.byref(reasons))):
            return None
        return float(mhz.value), milliwatts.value / 1e3, bool(reasons.value & self.POWER_CAP_REASONS)

    def during(self, first: Any, last: Any) -> dict[str, float] | None:
        """Samples every ~0.5 ms from when event `first` completes until `last` does: the median clock
        and power, and the share of samples with the power cap throttling."""
        if self.handle is None:
            return None
        taken = []
        while not last.query():
            if first.query():
                reading = self.sample()
                if reading is not None:
                    taken.append(reading)
            time.sleep(0.0005)
        if not taken:
            return None
        return {"mhz": statistics.median(t[0] for t in taken), "watts": statistics.median(t[1] for t in taken),
                "capped": sum(t[2] for t in taken) / len(taken), "samples": len(taken)}


def gemm_phase(ctx: RankContext, movers: dict[str, Mover]) -> dict[str, Any]:
    args = ctx.args
    n = args.gemm_n
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=ctx.device)
    b = torch.randn(n, n, dtype=dtype, device=ctx.device)
    c = torch.empty(n, n, dtype=dtype, device=ctx.device)
    flop = 2 * n**3

    clocks = GpuClocks(ctx.device)

    def window(clock_key: str | None = None) -> list[tuple[Any, Any]]:
        if ctx.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        marks = []
        for _ in range(args.gemm_count):
            start = ctx.clock.mark()
            torch.mm(a, b, out=c)
            marks.append((start, ctx.clock.mark()))
        if clock_key is not None and ctx.cuda:
            reading = clocks.during(marks[0][0], marks[-1][1])
            if reading is not None:
                result["clocks"].setdefault(clock_key, []).append(reading)
        return marks

    def tflops(marks: list[tuple[Any, Any]]) -> float:
        # Median of per-GEMM times: a launch gap between GEMMs does not count against them.
        return flop / statistics.median(ctx.clock.ms(start, end) for start, end in marks) / 1e9

    result: dict[str, Any] = {"n": n, "gemms": args.gemm_count, "tflops": {}, "covered": {},
                              "xfer_gbps": {}, "messages": {}, "clocks": {}}
    window()  # cuBLAS heuristics, clocks
    ctx.sync()

    def alone(clock_key: str | None = None) -> float:
        ctx.sync()
        return tflops(window(clock_key))

    # A window's length, the same number on both ranks: it sizes the transfer that must outlast it.
    window_ms = ctx.all_reduce(flop / statistics.median(alone() for _ in range(2)) / 1e9 * args.gemm_count, "max")
    payload = torch.randint(0, 256, (args.gemm_transfer_bytes,), dtype=torch.uint8, device=ctx.device)
    counts = {}
    for name, mover in movers.items():
        if isinstance(mover, PeerCopyMover):
            calibration = [mover.ms_per_copy(ctx, payload, 4)] if ctx.rank == 0 else None
        else:
            calibration = streaming(ctx, mover, [payload], iters=4, reps=1)
        message_ms = ctx.all_reduce(calibration[0] if calibration else 0.0, "max")
        # Twice the window plus the sleep, at the unloaded rate: the transfer only slows under load.
        counts[name] = min(max(math.ceil((2 * window_ms + SLEEP_MS_BOUND) / max(message_ms, 1e-3)) + 2, 8),
                           args.gemm_max_messages)
    result["messages"] = counts
    result["tflops"]["alone"] = []
    # Alone and loaded windows alternate, so clock and power drift over the run hit both alike.
    for _ in range(args.reps):
        result["tflops"]["alone"].append(alone("alone"))
        for name, mover in movers.items():
            ctx.sync()
            thread = TransferThread(ctx, mover, payload, counts[name])
            thread.start()
            if not thread.started.wait(args.timeout):
                raise TimeoutError(f"{name}: the transfer did not start within {args.timeout} s")
            marks = window(name)
            thread.join(args.timeout)
            if thread.is_alive():
                raise TimeoutError(f"{name}: {counts[name]} transfers did not finish within {args.timeout} s")
            if thread.error:
                raise RuntimeError(f"{name} transfer thread failed:\n{thread.error}")
            result["tflops"].setdefault(name, []).append(tflops(marks))
            # The transfer was running on this rank's GPU before the first GEMM and after the last; a
            # one-sided copy leaves nothing on rank 1 to tell, and is timed on rank 0.
            one_sided = isinstance(mover, PeerCopyMover)
            result["covered"].setdefault(name, []).append(
                None if one_sided and ctx.rank == 1 else
                ctx.clock.ms(thread.first, marks[0][0]) >= 0 and ctx.clock.ms(marks[-1][1], thread.last) >= 0)
            if ctx.rank == (0 if one_sided else 1):
                result["xfer_gbps"].setdefault(name, []).append(
                    gb_per_s((counts[name] - 1) * payload.numel(), ctx.clock.ms(thread.first, thread.last)))
            ctx.sync()
    return result


# ---------------------------------------------------------------------------------------------
# One rank


def open_channel(ctx: RankContext) -> tuple[Any, str | None]:
    """A pipecomm channel to the peer, or None and why: the NCCL numbers are still worth printing."""
    backend = ctx.args.backend
    if backend == "ipc" and not ctx.cuda:
        backend = "shm"  # the smoke run's same-host backend for CPU tensors
    channel, error = None, None
    try:
        import pipecomm.transport as transport

        channel = transport.connect(ctx.peer, backend=backend, device=ctx.device, timeout=float(ctx.args.timeout))
    except Exception as exc:  # reported in the header; the rest of the run goes on without pipecomm
        error = f"{type(exc).__name__}: {exc}"
    if ctx.all_reduce(1.0 if channel is not None else 0.0, "min") < 1:
        if channel is not None:
            channel.close()
            channel = None
        error = error or "the peer rank could not connect"
    return channel, error


def gpu_link() -> str | None:
    """The GPU0-GPU1 entry of `nvidia-smi topo -m` (e.g. NV18, PIX, SYS), best effort."""
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]
    header = next((line.split() for line in lines if line.split()[:2] == ["GPU0", "GPU1"]), None)
    row = next((line.split() for line in lines if line.startswith("GPU0")), None)
    return row[2] if header and row and len(row) > 2 else None


def rank_environment(ctx: RankContext, backend: str | None, channel_error: str | None) -> dict[str, Any]:
    env = environment(ctx.device)
    env["ranks"] = f"{WORLD_SIZE} processes, rank r on {ctx.device if ctx.args.share_gpu else 'cuda:r' if ctx.cuda else 'cpu'}"
    env["process_group"] = dist.get_backend()
    if ctx.cuda and not ctx.args.share_gpu:
        env["card_1"] = torch.cuda.get_device_properties(1).name
        env["peer_access_0_to_1"] = torch.cuda.can_device_access_peer(0, 1)
        env["nvidia_smi_topo_gpu0_gpu1"] = gpu_link()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
        env["PIPECOMM_IPC_SM_MAX_BYTES"] = os.environ.get("PIPECOMM_IPC_SM_MAX_BYTES")
    env["pipecomm_backend"] = backend
    if channel_error:
        env["pipecomm_channel_error"] = channel_error
    return env


def run_rank(rank: int, world_size: int, store_port: int, report: Any, config: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**config)
    device, store = start_rank(rank, world_size, store_port, args.smoke, args.timeout, args.share_gpu)
    ctx = RankContext(rank, 1 - rank, device, store, Clock(device), args)
    torch.manual_seed(rank)
    ctx.sync()

    channel, channel_error = open_channel(ctx)
    out: dict[str, Any] = {"samples": {}}
    if rank == 0:
        out["env"] = rank_environment(ctx, channel.backend if channel is not None else None, channel_error)
    samples = out["samples"]

    def record(key: str, values: list[float] | None) -> None:
        if values is not None:
            samples[key] = values

    movers: dict[str, Mover] = {}
    if channel is not None:
        movers["pipecomm"] = PipecommMover(channel)
    if not args.share_gpu:  # NCCL cannot put two ranks on one GPU
        movers["nccl"] = DistMover(ctx.peer, batched=False)

    for label, nbytes in args.size_list:
        ctx.log(f"one tensor of {label}")
        message = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)]
        for name, mover in movers.items():
            gpu_and_host = ping_pong(ctx, mover, message)
            if gpu_and_host is not None:
                record(f"lat/{name}/{label}", gpu_and_host[0])
                record(f"lat_host/{name}/{label}", gpu_and_host[1])
            record(f"bw/{name}/{label}", streaming(ctx, mover, message))

    if args.profile and "pipecomm" in movers:
        ctx.log(f"profiling the pipecomm ping-pong at {args.size_list[0][0]}")
        profile_ping_pong(ctx, movers["pipecomm"], args.size_list[0][1], args.profile)

    tuple_movers = dict(movers) if args.share_gpu else dict(movers, nccl_batch=DistMover(ctx.peer, batched=True))
    for label, nbytes in args.tuple_list:
        ctx.log(f"8 mixed tensors, {label} in all")
        message = mixed_tensors(nbytes, device)
        samples[f"tuple_bytes/{label}"] = [float(sum(t.numel() * t.element_size() for t in message))]
        for name, mover in tuple_movers.items():
            gpu_and_host = ping_pong(ctx, mover, message)
            record(f"tuple_lat/{name}/{label}", gpu_and_host[0] if gpu_and_host else None)
            record(f"tuple_bw/{name}/{label}", streaming(ctx, mover, message))

    if not args.no_gemm:
        ctx.log("GEMM interference")
        gemm_movers = dict(movers)
        cudart = load_cudart() if ctx.cuda else None
        if ctx.all_reduce(1.0 if cudart is not None else 0.0, "min") > 0:
            gemm_movers["copy"] = PeerCopyMover(ctx, cudart, args.gemm_transfer_bytes)
        out["gemm"] = gemm_phase(ctx, gemm_movers)

    ctx.log("in-process peer copy")
    if channel is not None:
        channel.close()
    ctx.sync()
    if ctx.cuda:
        torch.cuda.empty_cache()
    if rank == 0:
        for label, nbytes in args.size_list:
            record(f"peer/{label}", peer_copy(ctx, nbytes, raw=ctx.cuda))
            record(f"copy_/{label}", peer_copy(ctx, nbytes, raw=False))
    ctx.host_barrier("peer_copy_done")  # rank 1 waits on the host: its GPU stays idle meanwhile
    ctx.sync()
    return out


# ---------------------------------------------------------------------------------------------
# Parent: spawn, watch, report


def run_ranks(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Runs both ranks; kills them when one fails or the deadline passes, so nothing hangs."""
    try:
        return spawn_ranks(run_rank, WORLD_SIZE, (vars(args),), deadline=args.deadline, timeout=args.timeout)
    except RankFailure as failure:
        raise SystemExit(f"p2p: {failure}") from None


def median(samples: dict[str, list[float]], key: str) -> float | None:
    values = samples.get(key)
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def p2p_rows(args: argparse.Namespace, samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for label, nbytes in args.size_list:
        latency = {name: median(samples, f"lat/{name}/{label}") for name in ("pipecomm", "nccl")}
        gbps = {}
        for name, key in (("pipecomm", "bw/pipecomm"), ("nccl", "bw/nccl"), ("peer", "peer"), ("copy_", "copy_")):
            ms = median(samples, f"{key}/{label}")
            gbps[name] = gb_per_s(nbytes, ms) if ms else None
        if gbps["peer"] is None:  # no raw cudaMemcpyPeerAsync in this process: torch's copy_ is the ceiling
            gbps["peer"] = gbps["copy_"]
        rows.append({
            "size": label,
            "bytes": nbytes,
            "pc_us": latency["pipecomm"] * 1e3 if latency["pipecomm"] is not None else None,
            "nccl_us": latency["nccl"] * 1e3 if latency["nccl"] is not None else None,
            "pc/nccl_us": ratio(latency["pipecomm"], latency["nccl"]),
            "pc_host_us": (median(samples, f"lat_host/pipecomm/{label}") or 0) * 1e3 or None,
            "nccl_host_us": (median(samples, f"lat_host/nccl/{label}") or 0) * 1e3 or None,
            "pc_GB/s": gbps["pipecomm"],
            "nccl_GB/s": gbps["nccl"],
            "peer_GB/s": gbps["peer"],
            "copy__GB/s": gbps["copy_"],
            "pc/peer": ratio(gbps["pipecomm"], gbps["peer"]),
            "nccl/peer": ratio(gbps["nccl"], gbps["peer"]),
            "peer_us": median(samples, f"peer/{label}") * 1e3 if samples.get(f"peer/{label}") else None,
        })
    return rows


def tuple_rows(args: argparse.Namespace, samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for label, _ in args.tuple_list:
        nbytes = samples[f"tuple_bytes/{label}"][0]
        for timing, key in (("one-way", "tuple_lat"), ("stream", "tuple_bw")):
            us = {}
            for name in ("pipecomm", "nccl", "nccl_batch"):
                ms = median(samples, f"{key}/{name}/{label}")
                us[name] = ms * 1e3 if ms is not None else None
            rows.append({
                "case": f"8 mixed {label}", "MB": nbytes / 1e6, "timing": timing,
                "pc_us": us["pipecomm"], "nccl_x8_us": us["nccl"], "nccl_batch_us": us["nccl_batch"],
                "pc/nccl_x8": ratio(us["pipecomm"], us["nccl"]),
                "pc/nccl_batch": ratio(us["pipecomm"], us["nccl_batch"]),
            })
    return rows


def gemm_rows(outcomes: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rank in range(WORLD_SIZE):
        gemm = outcomes[rank].get("gemm")
        if not gemm:
            continue
        samples = gemm["tflops"]
        tflops = {name: statistics.median(values) for name, values in samples.items() if values}
        alone = samples["alone"]

        def loss(name: str) -> float | None:
            """Median over repetitions of the loss against the alone window just before."""
            if name not in samples:
                return None
            return statistics.median((1 - loaded / base) * 100 for loaded, base in zip(samples[name], alone))

        xfer = {name: statistics.median(values) if values else None for name, values in gemm["xfer_gbps"].items()}
        clocks = {name: {key: statistics.median(reading[key] for reading in readings)
                         for key in ("mhz", "watts", "capped")}
                  for name, readings in gemm.get("clocks", {}).items() if readings}

        def clock_loss(name: str) -> float | None:
            if name not in clocks or "alone" not in clocks:
                return None
            return (1 - clocks[name]["mhz"] / clocks["alone"]["mhz"]) * 100

        rows.append({
            "rank": rank, "role": "sender" if rank == 0 else "receiver",
            "alone_TF/s": tflops["alone"], "drift%": (alone[-1] / alone[0] - 1) * 100,
            "+pc_TF/s": tflops.get("pipecomm"), "pc_loss%": loss("pipecomm"),
            "+nccl_TF/s": tflops.get("nccl"), "nccl_loss%": loss("nccl"), "copy_loss%": loss("copy"),
            "covered": "/".join("n/a" if None in values else "yes" if all(values) else "NO"
                                for values in gemm["covered"].values()),
            "pc_xfer_GB/s": xfer.get("pipecomm"), "nccl_xfer_GB/s": xfer.get("nccl"),
            "copy_xfer_GB/s": xfer.get("copy"), "copy_clock_loss%": clock_loss("copy"),
            "alone_MHz": clocks.get("alone", {}).get("mhz"), "pc_clock_loss%": clock_loss("pipecomm"),
            "nccl_clock_loss%": clock_loss("nccl"), "alone_W": clocks.get("alone", {}).get("watts"),
            "pc_W": clocks.get("pipecomm", {}).get("watts"), "capped": clocks.get("alone", {}).get("capped"),
            "clocks": clocks, "messages": gemm["messages"], "n": gemm["n"], "tflops_samples": gemm["tflops"],
        })
    return rows


def targets(p2p: list[dict[str, Any]], gemm: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The project's targets as explicit ratios; 'n/a' when this run did not measure the case."""
    def verdict(value: float | None, ok: bool) -> str:
        return "n/a" if value is None else ("PASS" if ok else "FAIL")

    def at_most(value: float | None, limit: float) -> bool:
        return value is not None and value <= limit

    found = []
    for row in p2p:
        if row["bytes"] >= TARGET_BW_MIN_BYTES:
            value = row["pc/peer"]
            found.append({"target": f"pipecomm GB/s >= {TARGET_BW_FRACTION:.0%} of peer copy at {row['size']}",
                          "value": value, "verdict": verdict(value, value is not None and value >= TARGET_BW_FRACTION)})
        if row["bytes"] == TARGET_LATENCY_BYTES:
            value = row["pc/nccl_us"]
            found.append({"target": f"pipecomm one-way latency <= 1/3 of NCCL's at {row['size']}",
                          "value": value, "verdict": verdict(value, at_most(value, TARGET_LATENCY_RATIO))})
    for row in gemm:
        value = row["pc_loss%"]
        found.append({"target": f"GEMM loss on rank {row['rank']} ({row['role']}) during pipecomm <= "
                                f"{TARGET_GEMM_LOSS_PCT:g}%",
                      "value": value, "verdict": verdict(value, at_most(value, TARGET_GEMM_LOSS_PCT))})
    return found


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4K, 1M, 256M)")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)]


def size_list(text: str) -> list[tuple[str, int]]:
    return [(token.strip(), parse_size(token)) for token in text.split(",") if token.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="also write all numbers to this JSON file")
    parser.add_argument("--sizes", default="4K,64K,1M,4M,16M,64M,256M",
                        help="one-tensor message sizes (K/M/G = 2^10/2^20/2^30 bytes)")
    parser.add_argument("--tuple-sizes", default="64K,16M", help="total sizes of the 8-tensor messages")
    parser.add_argument("--backend", choices=["ipc", "dist", "auto"], default="ipc",
                        help="pipecomm channel backend (default ipc; --smoke turns ipc into shm)")
    parser.add_argument("--iters", type=int, default=50, help="messages (round trips) per timed repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed messages first (pipecomm caches layouts)")
    parser.add_argument("--gemm-n", type=int, default=8192, help="GEMM is n x n x n, bf16")
    parser.add_argument("--gemm-count", type=int, default=20, help="GEMMs per timed window")
    parser.add_argument("--gemm-transfer", default="256M", help="message size streamed during the GEMM")
    parser.add_argument("--gemm-max-messages", type=int, default=4000, help="cap on messages per GEMM window")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM interference phase")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile pipecomm's ping-pong at the first size with torch.profiler: a Chrome "
                             "trace and a table of host time per call, per rank, in DIR")
    parser.add_argument("--timeout", type=int, default=120, help="seconds for init, connect and any one wait")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds before the ranks are killed")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (gloo; pipecomm shm or dist) to check the flow; numbers mean nothing")
    parser.add_argument("--share-gpu", action="store_true",
                        help="both ranks on cuda:0 over CUDA IPC (one GPU): pipecomm alone, no NCCL and no GEMM phase; "
                             "peer = a copy within that GPU")
    args = parser.parse_args(argv)
    if args.smoke:
        # Only options left at their defaults shrink, so a smoke run can still be steered.
        for name, value in (("sizes", "4K,1M"), ("tuple_sizes", "64K,1M"), ("iters", 5), ("reps", 2),
                            ("warmup", 2), ("gemm_n", 128), ("gemm_count", 4), ("gemm_transfer", "1M"),
                            ("gemm_max_messages", 200)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    try:
        args.size_list = size_list(args.sizes)
        args.tuple_list = size_list(args.tuple_sizes)
        args.gemm_transfer_bytes = parse_size(args.gemm_transfer)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if args.share_gpu:
        args.no_gemm = True  # the GEMM phase measures what a transfer costs another GPU's compute
    if min(args.iters, args.reps) < 1 or args.warmup < 0:
        parser.error("--iters and --reps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the ranks
    needed = 1 if args.share_gpu else WORLD_SIZE
    if not args.smoke and not (torch.cuda.is_available() and torch.cuda.device_count() >= needed):
        raise SystemExit(f"needs {WORLD_SIZE} CUDA devices (or --share-gpu on one, --smoke on CPU)")
    started = time.monotonic()
    outcomes = run_ranks(args)
    samples = {**outcomes[1]["samples"], **outcomes[0]["samples"]}
    env = outcomes[0]["env"]
    p2p, tuples, gemm = p2p_rows(args, samples), tuple_rows(args, samples), gemm_rows(outcomes)
    goals = targets(p2p, gemm)

    print_environment(env)
    if args.smoke:
        print("# SMOKE RUN on CPU: gloo stands in for NCCL, a CPU copy for the peer copy; numbers mean nothing")
    print(f"# {args.iters} messages x median of {args.reps} reps; us = one-way latency (half a ping-pong "
          "round trip, rank 0); host_us = the same loop on the host clock, enqueueing only; GB/s = back-to-back stream timed on rank 1; peer = in-process cuda:0->cuda:1 "
          "cudaMemcpyPeerAsync (copy engine), copy_ = the same through torch copy_; pc = pipecomm")
    print_table(p2p, P2P_COLUMNS)
    print("# 8 mixed-dtype tensors per message: one pipecomm send vs 8 dist.send (x8) and one "
          "batch_isend_irecv of 8 (batch); us per message; ratio < 1: pipecomm faster")
    print_table(tuples, TUPLE_COLUMNS)
    if gemm:
        print(f"# GEMM {gemm[0]['n']}^3 {'bf16' if not args.smoke else 'fp32'}, median of {args.gemm_count} per "
              f"window; alone and loaded windows alternate, loss = median of each loaded window against the alone one before it; drift = last alone / first; during {args.gemm_transfer} messages rank 0 -> rank 1 ("
              + ", ".join(f"{name} {count}" for name, count in gemm[0]["messages"].items())
              + " per window); covered = the transfer ran through the whole window (" + "/".join(gemm[0]["messages"])
              + "); xfer GB/s on rank 1 during the GEMMs; copy = raw cudaMemcpyPeerAsync from rank 0's process into "
              "cuda:1, nothing on rank 1 (timed on rank 0): the copy engine's own cost, the floor")
        print_table(gemm, GEMM_COLUMNS)
        if any(row["alone_MHz"] is not None for row in gemm):
            print("# NVML during the same GEMM windows (medians of ~0.5 ms samples): SM clock alone, its drop with "
                  "each transfer beside the TFLOP/s drop, board power, and the share of alone samples in which "
                  "the power cap was throttling the clock (capped)")
            print_table(gemm, CLOCK_COLUMNS)
    for goal in goals:
        value = "not measured" if goal["value"] is None else f"{goal['value']:.3f} {goal['verdict']}"
        print(f"# target: {goal['target']}: {value}")
    print(f"# wall time {time.monotonic() - started:.0f} s")
    if args.json:
        config = {key: value for key, value in vars(args).items()}
        write_json(args.json, {"env": env, "config": config, "p2p": p2p, "tuples": tuples, "gemm": gemm,
                               "targets": goals, "samples_ms": samples})


if __name__ == "__main__":
    main()
