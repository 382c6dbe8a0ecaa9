"""Point-to-point channels between two ranks: one fused transfer per message over CUDA IPC, shared memory or torch.distributed."""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import socket
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist

import pipecomm
from pipecomm import _C

__all__ = [
    "Channel",
    "ChannelError",
    "ChannelTimeoutError",
    "Handle",
    "PeerDiedError",
    "ProtocolError",
    "connect",
]

ChannelError = _C.ChannelError
ChannelTimeoutError = _C.ChannelTimeoutError
PeerDiedError = _C.PeerDiedError
ProtocolError = _C.ProtocolError

DEFAULT_TIMEOUT = 300.0
BACKENDS = ("auto", "ipc", "shm", "dist")

# Per (low rank, high rank) pair, how many channels this process has opened, so that both ends of
# the n-th connect() between two ranks agree on its store keys without talking first.
_connections_per_pair: collections.Counter = collections.Counter()

Meta = tuple  # per entry: None, or (dtype, shape)


def connect(
    peer_rank: int,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    *,
    device: torch.device | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    num_slots: int = 4,
    slot_bytes: int = 1 << 20,
) -> Channel:
    """Opens a channel to ``peer_rank`` (a global rank); the peer must call ``connect`` back.

    ``device`` is where this rank's tensors live: by default the current CUDA device when the
    group's backend is NCCL, else the CPU. ``backend="auto"`` picks CUDA IPC for GPUs on one host,
    shared memory for CPU tensors on one host and torch.distributed otherwise; ``"ipc"``,
    ``"shm"`` and ``"dist"`` force one. Every wait raises after ``timeout`` seconds.
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

    store = _Rendezvous(rank, peer_rank, timeout)
    same_host = store.exchange("host", _host_identity()) == _host_identity()
    if backend == "auto":
        backend = ("ipc" if device.type == "cuda" else "shm") if same_host else "dist"
    if backend in ("ipc", "shm") and not same_host:
        raise ValueError(f"connect: backend {backend!r} needs rank {rank} and rank {peer_rank} on one host")
    if backend == "ipc" and not (device.type == "cuda" and pipecomm.cuda_built()):
        raise ValueError(f"connect: backend 'ipc' needs CUDA tensors and a CUDA build of pipecomm, not {device}")
    if backend == "shm" and device.type != "cpu":
        raise ValueError(f"connect: backend 'shm' carries CPU tensors, not {device}")
    if backend == "dist":
        channel: Channel = DistChannel(rank, peer_rank, device, timeout, group)
    elif backend == "shm":
        channel = _connect_shm(store, rank, peer_rank, device, timeout, num_slots, slot_bytes)
    else:
        channel = _connect_ipc(store, rank, peer_rank, device, timeout, num_slots, slot_bytes)
    channel.initial_slot_bytes = slot_bytes
    return channel


def _segment_names(store: _Rendezvous, rank: int, peer_rank: int) -> tuple[str, str]:
    """The incoming and outgoing rings' shared-memory names, unique to this pair and connection."""
    token = store.token()
    return f"/pipecomm.{token}.{peer_rank}to{rank}", f"/pipecomm.{token}.{rank}to{peer_rank}"


def _connect_shm(store, rank, peer_rank, device, timeout, num_slots, slot_bytes) -> Channel:
    native = _C.ShmChannel(*_segment_names(store, rank, peer_rank), rank, peer_rank, num_slots, slot_bytes, timeout)
    native.connect()
    return ShmChannel(rank, peer_rank, device, timeout, native)


def _connect_ipc(store, rank, peer_rank, device, timeout, num_slots, slot_bytes) -> Channel:
    from pipecomm._ipc import IpcChannel

    native = _C.IpcChannel(*_segment_names(store, rank, peer_rank), rank, peer_rank, device.index, num_slots,
                           slot_bytes, timeout)
    store.set("ipc", native.handles())
    native.connect(store.get_peer("ipc"))
    return IpcChannel(rank, peer_rank, device, timeout, native, store)


class Handle:
    """An operation in flight; ``wait()`` returns its result (the received tuple, or None)."""

    def __init__(self, complete):
        self._complete = complete
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            self._result = self._complete()
            self._done = True
            self._complete = None
        return self._result


class Channel:
    """Both directions between this rank and one peer. Messages arrive in the order they were sent."""

    backend: str
    initial_slot_bytes: int = 1 << 20  # what connect() was given; shrink()'s default

    def __init__(self, rank: int, peer_rank: int, device: torch.device, timeout: float):
        self.rank = rank
        self.peer_rank = peer_rank
        self.device = device
        self.timeout = timeout
        self._pending_recvs: collections.deque[Handle] = collections.deque()
        self._closed = False

    def send(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Sends a tuple of tensors (any dtypes and shapes; None entries kept) as one transfer."""
        self._check_open("send")
        self._send(list(tensors))

    def recv(self, out: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor | None, ...]:
        """Receives the next message; into ``out`` if given, which must match it exactly."""
        self._check_open("recv")
        while self._pending_recvs:
            self._pending_recvs[0].wait()
        return self._recv_now(out)

    def send_recv(self, tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Sends a message and receives the peer's, as in the 1F1B steady state."""
        self.send(tensors)
        return self.recv()

    def send_async(self, tensors: Sequence[torch.Tensor | None]) -> Handle:
        self.send(tensors)
        return Handle(lambda: None)

    def recv_async(self, out: Sequence[torch.Tensor | None] | None = None) -> Handle:
        self._check_open("recv")
        handle = Handle(lambda: self._complete_pending(handle, out))
        self._pending_recvs.append(handle)
        return handle

    def send_recv_async(self, tensors: Sequence[torch.Tensor | None]) -> Handle:
        self.send(tensors)
        return self.recv_async()

    def shrink(self, slot_bytes: int | None = None) -> bool:
        """Gives back the memory this end's incoming slots grew to for large messages.

        The slots become ``slot_bytes`` (default: the size ``connect`` was given) if that is smaller;
        later large messages grow them again. Returns whether they shrank. Over shared memory that
        happens at once and only while no message to this end is in flight. Over CUDA IPC the peer
        may already be copying its next ``num_slots`` messages into the old slots, so the smaller
        ones take over after those and the old memory then returns to torch's caching allocator
        (``torch.cuda.memory_allocated`` drops; ``empty_cache`` or memory pressure frees it).
        """
        self._check_open("shrink")
        if slot_bytes is not None and slot_bytes < 1:
            raise ValueError(f"{self._describe_direction('receive')}: shrink: slot_bytes must be positive, got {slot_bytes}")
        return self._shrink(self.initial_slot_bytes if slot_bytes is None else slot_bytes)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _complete_pending(self, handle: Handle, out):
        # Messages are matched to receives in posting order, whatever order the handles are waited in.
        while self._pending_recvs[0] is not handle:
            self._pending_recvs[0].wait()
        self._pending_recvs.popleft()
        return self._recv_now(out)

    def _recv_now(self, out):
        message = self._recv()
        if out is not None:
            _copy_into(message, out, self._describe_direction("receive"))
            return tuple(out)
        return message

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise ProtocolError(f"pipecomm channel rank {self.rank} <-> rank {self.peer_rank}: cannot {action}, closed")

    def _describe_direction(self, action: str) -> str:
        source, target = (self.rank, self.peer_rank) if action == "send" else (self.peer_rank, self.rank)
        return f"pipecomm {self.backend} channel rank {source} -> rank {target}"

    def _send(self, tensors: list) -> None:
        raise NotImplementedError

    def _recv(self) -> tuple:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _shrink(self, slot_bytes: int) -> bool:
        raise NotImplementedError


class ShmChannel(Channel):
    """CPU tensors between processes of one host, through shared-memory rings; each message is one native call."""

    backend = "shm"

    def __init__(self, rank, peer_rank, device, timeout, native):
        super().__init__(rank, peer_rank, device, timeout)
        self._native = native
        self._send = native.send
        self._recv = native.recv

    def _close(self):
        self._native.close()

    def _shrink(self, slot_bytes):
        return self._native.shrink(slot_bytes)


class DistChannel(Channel):
    """Any two ranks through torch.distributed send/recv: a header, metadata on change, one packed payload.

    The receiver reads the header on the host before posting the payload's receive, so with NCCL
    each message costs a small host sync; same-host ranks use the IPC and shared-memory channels.
    """

    backend = "dist"

    def __init__(self, rank, peer_rank, device, timeout, group):
        super().__init__(rank, peer_rank, device, timeout)
        self._group = group
        self._sent_meta: Meta | None = None
        self._received_meta: Meta | None = None
        nccl = dist.get_backend(group) == "nccl"
        self._wire_device = device if nccl else torch.device("cpu")
        self._send_seq = 0
        self._recv_seq = 0
        # (seq, works, buffers) of sends not known to be complete; the buffers must outlive them.
        self._in_flight: collections.deque = collections.deque()

    def _send(self, tensors):
        meta, present = self._outgoing(tensors)
        meta_bytes = b"" if meta == self._sent_meta else pickle.dumps(meta)
        self._sent_meta = meta
        payload = pipecomm.pack(present).to(self._wire_device) if present else None
        header = torch.tensor([len(meta_bytes), 0 if payload is None else payload.numel()], dtype=torch.int64)
        parts = [header.to(self._wire_device)]
        if meta_bytes:
            parts.append(torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(self._wire_device))
        if payload is not None:
            parts.append(payload)
        works = [dist.isend(part, self.peer_rank, group=self._group) for part in parts]
        self._in_flight.append((self._send_seq, works, parts))
        self._send_seq += 1
        while self._in_flight and all(work.is_completed() for work in self._in_flight[0][1]):
            self._in_flight.popleft()

    def _outgoing(self, tensors: list) -> tuple[Meta, list[torch.Tensor]]:
        """The message's metadata and its tensors as contiguous buffers on this channel's device."""
        present = []
        for index, tensor in enumerate(tensors):
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{self._describe_direction('send')}: entry {index} is a {type(tensor).__name__}, not a tensor")
            if tensor.device != self.device:
                raise ValueError(
                    f"{self._describe_direction('send')}: tensors[{index}] is on {tensor.device}, "
                    f"but this channel carries tensors on {self.device}"
                )
            present.append(tensor.detach().contiguous())
        return _describe(tensors), present

    def _allocate(self, meta: Meta) -> list:
        return [None if entry is None else torch.empty(entry[1], dtype=entry[0], device=self.device) for entry in meta]

    def _recv(self):
        seq = self._recv_seq
        header = self._receive(torch.empty(2, dtype=torch.int64, device=self._wire_device), seq, "header")
        meta_length, payload_length = header.tolist()
        if meta_length:
            meta_buffer = self._receive(torch.empty(meta_length, dtype=torch.uint8, device=self._wire_device), seq, "metadata")
            self._received_meta = pickle.loads(meta_buffer.cpu().numpy().tobytes())
        if self._received_meta is None:
            raise ProtocolError(f"{self._describe_direction('receive')}: message {seq} arrived before any metadata")
        outs = self._allocate(self._received_meta)
        present = [tensor for tensor in outs if tensor is not None]
        if payload_length:
            payload = self._receive(torch.empty(payload_length, dtype=torch.uint8, device=self._wire_device), seq, "payload")
            pipecomm.unpack_(payload.to(self.device), present)
        self._recv_seq += 1
        return tuple(outs)

    def _receive(self, buffer, seq, part):
        work = dist.irecv(buffer, self.peer_rank, group=self._group)
        self._wait(work, f"rank {self.rank} waiting to receive the {part} of message {seq}", "receive")
        return buffer

    def _wait_sends(self):
        while self._in_flight:
            seq, works, _ = self._in_flight.popleft()
            for work in works:
                self._wait(work, f"rank {self.rank} waiting to send message {seq}", "send")

    def _wait(self, work, what, direction):
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise ChannelTimeoutError(
                f"{self._describe_direction(direction)}: {what} failed or timed out after {self.timeout:g} s: {error}"
            ) from error

    def _shrink(self, slot_bytes):
        return False  # no slots: every message's buffers are allocated for it

    def _close(self):
        self._wait_sends()


def _describe(tensors: list) -> Meta:
    return tuple(None if tensor is None else (tensor.dtype, tuple(tensor.shape)) for tensor in tensors)


def _copy_into(message: tuple, out: Sequence, direction: str) -> None:
    if len(out) != len(message):
        raise ValueError(f"{direction}: the message has {len(message)} entries but out has {len(out)}")
    for index, (got, target) in enumerate(zip(message, out)):
        if (got is None) != (target is None):
            raise ValueError(f"{direction}: entry {index} is {'None' if got is None else 'a tensor'} in the message")
        if got is None:
            continue
        if got.shape != target.shape or got.dtype != target.dtype:
            raise ValueError(
                f"{direction}: entry {index} is {got.dtype} {tuple(got.shape)} but out[{index}] is "
                f"{target.dtype} {tuple(target.shape)}"
            )
        target.copy_(got)


def _default_device(group) -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            boot = boot_id.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


class _Rendezvous:
    """The store keys of one channel: both ends of the n-th connect() between two ranks share them."""

    def __init__(self, rank: int, peer_rank: int, timeout: float):
        low, high = sorted((rank, peer_rank))
        _connections_per_pair[low, high] += 1
        self.prefix = f"pipecomm/channel/{low}-{high}/{_connections_per_pair[low, high]}"
        self.rank = rank
        self.peer_rank = peer_rank
        self.is_low = rank == low
        self.timeout = datetime.timedelta(seconds=timeout)
        self.store = dist.distributed_c10d._get_default_store()

    def set(self, name: str, value: bytes | str) -> None:
        self.store.set(f"{self.prefix}/{name}/{self.rank}", value)

    def get_peer(self, name: str) -> bytes:
        key = f"{self.prefix}/{name}/{self.peer_rank}"
        try:
            self.store.wait([key], self.timeout)
        except RuntimeError as error:
            raise ChannelTimeoutError(
                f"pipecomm channel rank {self.rank} <-> rank {self.peer_rank}: rank {self.rank} timed out after "
                f"{self.timeout.total_seconds():g} s waiting for rank {self.peer_rank} to publish {name!r} "
                f"(did it call connect({self.rank})?)"
            ) from error
        return self.store.get(key)

    def exchange(self, name: str, value: str) -> str:
        self.set(name, value)
        return self.get_peer(name).decode()

    def token(self) -> str:
        """A name for this channel's shared-memory segments, chosen by the lower rank."""
        if self.is_low:
            token = f"{os.getpid()}{uuid.uuid4().hex[:8]}"
            self.set("token", token)
            return token
        return self.get_peer("token").decode()
