"""Helpers shared by the GPU bench scripts: environment header, timing, JSON output and tables."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True).stdout.strip()
    return completed.stdout.strip() + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict[str, Any]:
    """What a reader needs to reproduce or compare a result."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        card = properties.name
        card_memory_gib = round(properties.total_memory / 2**30, 1)
    else:
        card = platform.processor() or platform.machine()
        card_memory_gib = None
    try:
        import pipecomm

        pipecomm_build = pipecomm.build_info()
    except Exception as error:  # the header must still print when the extension is broken
        pipecomm_build = {"error": repr(error)}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "card": card,
        "card_memory_gib": card_memory_gib,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "pipecomm": pipecomm_build,
    }


def print_environment(env: Mapping[str, Any]) -> None:
    for key, value in env.items():
        print(f"# {key}: {value}")


def time_cuda(fn: Callable[[], object], warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of fn(), each call timed by its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of fn(): on a CUDA device between two events around it (waiting for the second),
    elsewhere on the host clock. ``time_cuda`` is for many calls back to back."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_host(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Median wall-clock milliseconds of fn(); the fallback for smoke runs on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_on(device: torch.device, fn: Callable[[], object], warmup: int, iters: int) -> float:
    if device.type == "cuda":
        return time_cuda(fn, warmup=warmup, iters=iters)
    return time_host(fn, warmup=min(warmup, 2), iters=min(iters, 5))


def gb_per_s(nbytes: int, milliseconds: float) -> float:
    return nbytes / (milliseconds * 1e-3) / 1e9


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def format_cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return f"{value:.3g}"
    return "" if value is None else str(value)


def print_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> None:
    """Plain-text table: text columns left-aligned, numbers right-aligned."""
    cells = [[format_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    numeric = [all(isinstance(row.get(column), (int, float)) or row.get(column) is None for row in rows)
               for column in columns]

    def render(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if is_num else v.ljust(w) for v, w, is_num in zip(values, widths, numeric)).rstrip()

    print(render(list(columns)))
    print("  ".join("-" * width for width in widths))
    for line in cells:
        print(render(line))


# Eight dtypes a stage boundary may carry, float and not, in rotation.
MIXED_DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.int64,
    torch.int32, torch.uint8, torch.bool, torch.float32,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.randint(0, 100, shape, dtype=dtype, device=device)


def mixed_tensors(total_bytes: int, device: torch.device) -> list[torch.Tensor]:
    """Eight tensors of rotating dtypes, ~total/8 bytes each, sizes nudged off 16-byte multiples."""
    tensors = []
    for index, dtype in enumerate(MIXED_DTYPES):
        element_size = torch.empty((), dtype=dtype).element_size()
        numel = max(total_bytes // len(MIXED_DTYPES) // element_size - (2 * index + 1), 1)
        tensors.append(random_tensor((numel,), dtype, device))
    return tensors


# ---------------------------------------------------------------------------------------------
# Spawning ranks (bench/e2e.py, bench/test_overhead.py)


class RankFailure(RuntimeError):
    """A spawned rank failed, exited without a result, or the deadline passed; the ranks were killed."""


def init_rank_group(rank: int, world_size: int, store_port: int, backend: str, timeout: float,
                    device: torch.device | None = None) -> Any:
    """Joins the TCPStore that spawn_ranks opened and the default process group; returns the store."""
    import torch.distributed as dist

    delta = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=delta)
    extra = {"device_id": device} if device is not None and device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta, **extra)
    return store


def start_rank(rank: int, world_size: int, store_port: int, smoke: bool, timeout: float,
               share_gpu: bool = False) -> tuple[torch.device, Any]:
    """A bench rank's setup: NVLink multicast off, its GPU (the CPU in smoke runs; cuda:0 for every rank with
    ``share_gpu``) and the process group (NCCL; gloo in smoke runs and on a shared GPU, where NCCL cannot put
    two ranks). Returns the device and the shared store."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # as in scripts/gpu_check.sh; before NCCL starts
    # Eager init (device_id) runs unbatched send/recv on the group's one communicator, serialized with
    # its other ops; the ranks here issue them in one order anyway, so the per-process warning is noise.
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    if smoke:
        torch.set_num_threads(1)  # several ranks on a small machine
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0 if share_gpu else rank)
        torch.cuda.set_device(device)
    backend = "gloo" if smoke or share_gpu else "nccl"
    store = init_rank_group(rank, world_size, store_port, backend, timeout, device if backend == "nccl" else None)
    return device, store


def _dump_stacks(processes: list) -> None:
    """Has each live process print its threads' Python stacks to standard error, and gives them a moment to."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2)


def _rank_entry(rank: int, world_size: int, store_port: int, messages: Any, fn: Callable[..., Any],
                args: tuple) -> None:
    import contextlib
    import traceback

    import torch.distributed as dist

    def report(payload: Any) -> None:
        messages.put(("report", rank, payload))

    # So that a rank past the deadline shows where it waits before it is killed (_dump_stacks).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        value = fn(rank, world_size, store_port, report, *args)
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))
        return
    messages.put(("ok", rank, value))
    with contextlib.suppress(Exception):  # the result is out; a slow teardown is the parent's to kill
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *, deadline: float = 300.0,
                timeout: float = 120.0, on_report: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
    """Runs fn(rank, world_size, store_port, report, *args) on world_size spawned processes.

    fn must be importable by name (module level). It joins the group with init_rank_group and may
    call report(payload) any number of times: each payload reaches on_report(rank, payload) in the
    parent as it arrives, so a run that dies later still leaves its partial results. Returns fn's
    return values by rank. Raises RankFailure (after killing every rank) when a rank raises, exits
    without a result, or the deadline passes, so nothing hangs.
    """
    import queue
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # Forked from one server process that imported these once, instead of a fresh interpreter importing torch per
    # rank (seconds each on a small machine); the server starts clean, so a parent that used CUDA is no obstacle.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "pipecomm"])
    messages = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    processes = [context.Process(target=_rank_entry, args=(rank, world_size, store.port, messages, fn, args),
                                 daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    end = time.monotonic() + deadline
    exited_at: dict[int, float] = {}
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            if now > end:
                missing = sorted(set(range(world_size)) - set(outcomes))
                _dump_stacks([processes[rank] for rank in missing])
                raise RankFailure(f"ranks {missing} still running after the {deadline:g} s deadline; killed "
                                  "(their Python stacks are on standard error)")
            try:
                kind, rank, payload = messages.get(timeout=max(min(0.5, end - now), 0.01))
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank not in outcomes and process.exitcode is not None:
                        # Its last message may still be in the pipe: give it a few seconds.
                        if now - exited_at.setdefault(rank, now) > 5:
                            raise RankFailure(f"rank {rank} exited with code {process.exitcode} "
                                              "without a result") from None
                continue
            if kind == "report":
                if on_report is not None:
                    on_report(rank, payload)
            elif kind == "error":
                raise RankFailure(f"rank {rank} failed:\n{payload}")
            else:
                outcomes[rank] = payload
    finally:
        for process in processes:
            process.join(timeout=15 if len(outcomes) == world_size else 1)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return outcomes
