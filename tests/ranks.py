"""Runs a function on several CPU processes joined by gloo through a FileStore; a hang becomes a test failure.

The processes are forked from one server process that imported torch, pipecomm and transformers once
(multiprocessing's forkserver), so each test's ranks start fresh, sharing no state with another test's, in tens of
milliseconds instead of the seconds a new interpreter takes to import torch.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipecomm
from ports import free_port


# What the rank server imports once, so that no rank spends its CPU on it: what the test modules import (a rank
# imports its test's module to find the function it runs; torch._dynamo.testing brings functorch and networkx, 0.35 s).
# Not this module: its import asks whether CUDA is available, which would initialize the CUDA driver in the server,
# and a process forked after that cannot use CUDA.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo.testing", "pipecomm", "pytest",
            "numpy", "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]
# And what a rank imports at its first use of some parts of torch and pipecomm (an import that fails is skipped):
# torch.compile's (every dynamo backend, aot_autograd's and inductor's passes: 1.5 s of CPU), a capture's
# (torch.export and the sympy it brings: 0.8 s), the planner's (numba and its cffi support: 0.5 s). Only on machines
# without a GPU: with a CPU build of torch none of it asks for CUDA, but inductor's imports beside triton and a GPU
# have not been checked for touching the driver.
_FIRST_USE_PRELOAD = [
    "torch._dynamo.backends.cudagraphs", "torch._dynamo.backends.distributed", "torch._dynamo.backends.inductor",
    "torch._dynamo.backends.onnxrt", "torch._dynamo.backends.tensorrt", "torch._dynamo.backends.torchxla",
    "torch._dynamo.backends.tvm", "torch._dynamo.repro.after_dynamo", "torch._dynamo.dce_extra_outputs",
    "torch._inductor.compile_fx", "torch._inductor.compiler_bisector", "torch._subclasses.schema_check_mode",
    "torch._functorch._aot_autograd.subclass_codegen", "torch.distributed.tensor.experimental", "torch.export._trace",
    "torch._export.passes.replace_set_grad_with_hop_pass", "torch._export.passes.replace_autocast_with_hop_pass",
    "torch._export.passes._node_metadata_hook", "torch.fx.experimental.validator", "sympy.tensor.tensor",
    "sympy.sets.setexpr", "numba", "numba.core.typing.cffi_utils",
]


_calls = itertools.count()


def _rank_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    preload = _PRELOAD if torch.cuda.is_available() else _PRELOAD + _FIRST_USE_PRELOAD
    context.set_forkserver_preload(preload)  # read when the server starts, at the first rank of the session
    return context


def start_rank_server() -> None:
    """Starts the rank server now, with these preloads, instead of at the first ranks a test runs."""
    _rank_context()
    multiprocessing.forkserver.ensure_running()


def _entry(rank: int, world_size: int, store_path: str | int, process_group: str, results, fn, args) -> None:
    # What the server imported (400,000 objects) out of the garbage collector's reach: a rank's full collections
    # walked them all, writing to every page the rank shares with the server (copy-on-write), 0.3 s of CPU each and
    # 40 s in the suite's ranks (0.8 s frozen). What the rank creates is collected as before.
    gc.freeze()
    # Ranks share the machine's cores: more threads each would only make them contend.
    torch.set_num_threads(1)
    try:
        if "nccl" in process_group:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if isinstance(store_path, int):  # a TCPStore on this port, hosted by rank 0's process
            store = dist.TCPStore("127.0.0.1", store_path, world_size, is_master=rank == 0,
                                  timeout=datetime.timedelta(seconds=60))
        else:
            store = dist.FileStore(store_path, world_size)
        dist.init_process_group(process_group, store=store, rank=rank, world_size=world_size)
        # Every rank is connected before any may finish: one that exits early would break a peer's connecting.
        dist.barrier()
        outcome = fn(rank, world_size, *args)
        results.put((rank, "ok", outcome))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # What the interpreter's exit did for a spawned rank, which a forked one leaves with os._exit: Pipelines
        # still open are closed (their shared-memory files unlinked), then the process groups.
        pipecomm.runtime.fail_fast.close_live_pipelines()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, tmp_path: Path, *args, timeout: float = 60.0, may_exit: frozenset = frozenset(),
              tcp_store: bool = False, process_group: str = "gloo", prepare: Callable[[], object] | None = None) -> list:
    """Runs fn(rank, world_size, *args) on world_size spawned ranks and returns their results by rank.

    Ranks in ``may_exit`` are allowed to exit without a result (a simulated crash); their result is
    their exit code. The ranks meet through a file, or with ``tcp_store`` through a TCPStore that
    rank 0's process hosts (as torchrun's does), for tests where that process dies. ``process_group`` is
    the default group's backend (``"cpu:gloo,cuda:nccl"`` for NCCL twins, one GPU per rank).

    With ``prepare`` (CPU only: no CUDA before a fork), one process runs it once and forks every rank from itself;
    each then runs fn(rank, world_size, prepared, *args) on its copy of what it prepared (a model captured once
    for all of a test's ranks instead of once per rank).
    """
    context = _rank_context()
    results = context.Queue()
    # A store file of its own per call: one a crashed rank left behind would hang the next call's rendezvous.
    store_path = free_port() if tcp_store else str(tmp_path / f"store-{os.getpid()}-{next(_calls)}")
    if prepare is None:
        processes = [
            context.Process(target=_entry, args=(rank, world_size, store_path, process_group, results, fn, args),
                            daemon=True)
            for rank in range(world_size)
        ]
    else:  # one process whose exit notes come as results; it is no rank
        processes = [context.Process(target=_fork_ranks, args=(world_size, store_path, process_group, results, fn,
                                                                args, prepare), daemon=True)]
    for process in processes:
        process.start()
    outcomes: dict[int, object] = {}
    exited: set[int] = set()  # ranks seen exited without a result, given one more wait for what they sent
    hung: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                if prepare is None:
                    _collect_exits(processes, outcomes, may_exit, exited)
                elif processes[0].exitcode not in (None, 0):
                    raise AssertionError(f"the process forking the ranks exited with code {processes[0].exitcode}")
                if time.monotonic() > deadline:
                    hung = sorted(set(range(world_size)) - set(outcomes))
                    raise AssertionError(f"ranks {hung} gave no result within {timeout:g} s (hang?)") from None
                continue
            if status == "error":
                raise AssertionError(_failures(rank, payload, results))
            if status == "exited":
                if rank not in may_exit:
                    raise AssertionError(f"rank {rank} exited with code {payload} without a result")
                outcomes.setdefault(rank, payload)
                continue
            outcomes[rank] = payload
    finally:
        for index, process in enumerate(processes):
            # A hung rank is killed at once: it had its whole timeout (the forking process holds every rank).
            process.join(timeout=0 if hung and (prepare is not None or index in hung) else 5)
            if process.is_alive():
                if prepare is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)  # the ranks it forked too
                process.kill()
    return [outcomes[rank] for rank in range(world_size)]


def _failures(rank: int, payload: str, results, patience: float = 2.0) -> str:
    """The first failure reported and those other ranks report within ``patience`` seconds, the ranks' own errors
    before their reports of a peer's (PeerFailedError, PeerDiedError), which may come in first: a GPU flake's cause
    was seen only as the peer's report of it."""
    failed = [(rank, payload)]
    until = time.monotonic() + patience
    while time.monotonic() < until:
        try:
            other, status, text = results.get(timeout=max(0.01, until - time.monotonic()))
        except queue.Empty:
            break
        if status == "error":
            failed.append((other, text))
    failed.sort(key=lambda entry: "PeerFailedError" in entry[1] or "PeerDiedError" in entry[1])
    return "\n".join(f"rank {other} failed:\n{text}" if other >= 0 else text for other, text in failed)


def _fork_ranks(world_size: int, store_path: str | int, process_group: str, results, fn, args, prepare) -> None:
    """Runs ``prepare`` once, then forks every rank from this process; reports a rank that exits unsuccessfully
    (its result, if any, is in the queue before the report: it flushed the queue before exiting)."""
    os.setpgrp()  # its ranks with it, so that the parent can kill them all at once
    gc.freeze()  # as _entry does
    torch.set_num_threads(1)  # no thread pool in a process that forks
    try:
        prepared = prepare()
    except BaseException:
        results.put((-1, "error", f"prepare failed:\n{traceback.format_exc()}"))
        return
    children = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            try:
                _entry(rank, world_size, store_path, process_group, results, fn, (prepared, *args))
            finally:
                results.close()
                results.join_thread()
                os._exit(0)
        children[pid] = rank
    while children:
        pid, status = os.wait()
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            results.put((children[pid], "exited", code))
        del children[pid]


def _collect_exits(processes, outcomes: dict, may_exit: frozenset, exited: set[int]) -> None:
    """Ranks that exited without a result: allowed ones yield their exit code, others fail the test."""
    for rank, process in enumerate(processes):
        if rank in outcomes or process.exitcode is None:
            continue
        # A result sent just before exiting can still be in the queue's pipe, whole (a rank flushes its queue before
        # it exits): the next wait takes it. A rank seen exited twice, with the queue empty in between, sent none.
        if rank not in exited:
            exited.add(rank)
            continue
        if rank not in may_exit:
            raise AssertionError(f"rank {rank} exited with code {process.exitcode} without a result")
        outcomes[rank] = process.exitcode


NEEDS_CUDA_REASON = "needs a GPU and a CUDA build of pipecomm"  # conftest marks these tests `cuda`
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and pipecomm.cuda_built()), reason=NEEDS_CUDA_REASON)
# NCCL cannot put two ranks on one GPU: these twins run on the multi-GPU machines.
NEEDS_TWO_GPUS_REASON = "needs 2 GPUs and a CUDA build of pipecomm"
needs_two_gpus = pytest.mark.skipif(not (torch.cuda.device_count() >= 2 and pipecomm.cuda_built()),
                                    reason=NEEDS_TWO_GPUS_REASON)


def rank_device(rank: int, kind: str) -> torch.device:
    """Rank r uses GPU r when there are enough GPUs; otherwise ranks share GPU 0 (IPC still crosses processes)."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def graph_pool_bytes() -> int:
    """What the caching allocator holds in private pools (CUDA graphs'), on the current device."""
    device = torch.cuda.current_device()
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if segment["device"] == device and tuple(segment["segment_pool_id"]) != (0, 0))


def held_stages(schedule: str, world_size: int, micro_batches: int, virtual: int, rank: int) -> list[int]:
    """The stages ``schedule`` places on ``rank`` ("auto" plans for the placement of zb-h1, or zb-v's V for two)."""
    placed_like = {"auto": "zb-h1" if virtual == 1 else "zb-v"}.get(schedule, schedule)
    return list(pipecomm.make_schedule(placed_like, world_size, micro_batches, virtual).stages_of(rank))
