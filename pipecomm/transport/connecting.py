"""connect(): the one way to open a channel, which picks its backend from where the two ranks and their tensors are."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipecomm import _C
from pipecomm.parallel.backend import uses_nccl
from pipecomm.transport.channel import Channel, ChannelError
from pipecomm.transport.dist import DistChannel
from pipecomm.transport.ipc import IpcChannel
from pipecomm.transport.rendezvous import SEGMENT_PREFIX, Rendezvous, host_identity
from pipecomm.transport.shm import ShmChannel

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "connect"]

DEFAULT_TIMEOUT = 300.0
BACKENDS = ("auto", "ipc", "shm", "dist")


def connect(
    peer_rank: int,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    num_slots: int = 4,
    slot_bytes: int = 1 << 20,
    peer_failure: Callable[[], str] | None = None,
) -> Channel:
    """Opens a channel to ``peer_rank`` (a global rank); the peer must call ``connect`` back.

    ``device`` is where this rank's tensors live: by default the current CUDA device when the
    group's backend is NCCL, else the CPU. ``backend="auto"`` picks CUDA IPC for GPUs on one host,
    shared memory for CPU tensors on one host and torch.distributed otherwise; ``"ipc"``,
    ``"shm"`` and ``"dist"`` force one. Ranks are on one host when their machine and boot match, or,
    where the environment variable ``PIPECOMM_HOST_ID`` is set (read here), when its values match:
    processes of one machine with different values then act as separate hosts, as in a test of a
    multi-host setup on one machine. Ranks that share a value must share a machine. Every wait
    raises after ``timeout`` seconds. At most ``num_slots`` messages go unreceived each way: a send
    waits for room. Over torch.distributed the channel opens two-rank process groups of its own from
    the default store: gloo, and NCCL for CUDA tensors when ``group``'s backend is NCCL (otherwise
    they cross through host memory). While it waits for the peer to call back,
    ``peer_failure`` (if given) is asked every 0.1 s why the peer will not come; an answer ends the
    wait with a ChannelError that holds it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"connect: backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if not dist.is_initialized():
        raise ValueError("connect: torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank()
    if peer_rank == rank or not 0 <= peer_rank < dist.get_world_size():
        raise ValueError(
            f"connect: peer_rank must be another rank in [0, {dist.get_world_size()}), got {peer_rank} on rank {rank}"
        )
    if timeout <= 0 or num_slots < 1 or slot_bytes < 1:
        raise ValueError("connect: timeout, num_slots and slot_bytes must be positive")
    device = torch.device(device) if device is not None else _default_device(group)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    rendezvous = Rendezvous(rank, peer_rank, timeout, peer_failure)
    same_host = rendezvous.exchange("host", host_identity()) == host_identity()
    if backend == "auto":
        backend = ("ipc" if device.type == "cuda" else "shm") if same_host else "dist"
    if backend in ("ipc", "shm") and not same_host:
        raise ValueError(f"connect: backend {backend!r} needs rank {rank} and rank {peer_rank} on one host")
    if backend == "ipc" and not (device.type == "cuda" and bool(_C.build_info()["cuda"])):
        raise ValueError(f"connect: backend 'ipc' needs CUDA tensors and a CUDA build of pipecomm, not {device}")
    if backend == "shm" and device.type != "cpu":
        raise ValueError(f"connect: backend 'shm' carries CPU tensors, not {device}")
    if backend == "dist":
        channel: Channel = DistChannel(rank, peer_rank, device, timeout, group, rendezvous, num_slots)
    else:
        _sweep_stale_segments()
        channel_type = ShmChannel if backend == "shm" else IpcChannel
        channel = channel_type.open(rendezvous, device, timeout, num_slots, slot_bytes)
    channel.initial_slot_bytes = slot_bytes
    return channel


def _sweep_stale_segments() -> None:
    """Unlinks the segments of channels whose creating process died before both ends had mapped them
    (a crash while slots were growing leaves some); live processes' segments stay."""
    with contextlib.suppress(ChannelError, ValueError):  # e.g. no /dev/shm: nothing of ours is there either
        _C.sweep_stale_segments(SEGMENT_PREFIX)


def _default_device(group) -> torch.device:
    if torch.cuda.is_available() and uses_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
