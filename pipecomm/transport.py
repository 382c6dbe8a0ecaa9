"""Point-to-point channels between two ranks: one fused transfer per message over CUDA IPC, shared memory or torch.distributed."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

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

# Every shared-memory segment of a channel (its rings' control and data generations, the IPC channel's
# host and post rings) is named from this prefix.
_SEGMENT_PREFIX = "/pipecomm."
# How long close() and abort() wait for a call in another thread to leave before leaving the release to it.
_SHUTDOWN_WAIT_SECONDS = 1.0
# How gloo words a connection the peer's process closed, by dying or exiting.
_PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

# Per (low rank, high rank) pair, how many channels this process has opened, so that both ends of
# the n-th connect() between two ranks agree on its store keys without talking first.
_connections_per_pair: collections.Counter = collections.Counter()


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

    store = _Rendezvous(rank, peer_rank, timeout, peer_failure)
    same_host = store.exchange("host", _host_identity()) == _host_identity()
    if backend == "auto":
        backend = ("ipc" if device.type == "cuda" else "shm") if same_host else "dist"
    if backend in ("ipc", "shm") and not same_host:
        raise ValueError(f"connect: backend {backend!r} needs rank {rank} and rank {peer_rank} on one host")
    if backend == "ipc" and not (device.type == "cuda" and bool(_C.build_info()["cuda"])):
        raise ValueError(f"connect: backend 'ipc' needs CUDA tensors and a CUDA build of pipecomm, not {device}")
    if backend == "shm" and device.type != "cpu":
        raise ValueError(f"connect: backend 'shm' carries CPU tensors, not {device}")
    if backend == "dist":
        channel: Channel = DistChannel(rank, peer_rank, device, timeout, group, store, num_slots)
    else:
        _sweep_stale_segments()
        if backend == "shm":
            channel = _connect_shm(store, rank, peer_rank, device, timeout, num_slots, slot_bytes)
        else:
            channel = _connect_ipc(store, rank, peer_rank, device, timeout, num_slots, slot_bytes)
    channel.initial_slot_bytes = slot_bytes
    return channel


def _segment_names(store: _Rendezvous, rank: int, peer_rank: int) -> tuple[str, str]:
    """The incoming and outgoing rings' shared-memory names, unique to this pair and connection."""
    token = store.token()
    return f"{_SEGMENT_PREFIX}{token}.{peer_rank}to{rank}", f"{_SEGMENT_PREFIX}{token}.{rank}to{peer_rank}"


def _sweep_stale_segments() -> None:
    """Unlinks the segments of channels whose creating process died before both ends had mapped them
    (a crash while slots were growing leaves some); live processes' segments stay."""
    with contextlib.suppress(ChannelError, ValueError):  # e.g. no /dev/shm: nothing of ours is there either
        _C.sweep_stale_segments(_SEGMENT_PREFIX)


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

    def __init__(self, complete=None, out=None):
        self._complete = complete  # settles this handle; None: done already
        self._out = out  # where a receive puts its message
        self._done = complete is None
        self._result = None
        self._error: BaseException | None = None

    def wait(self):
        if not self._done:
            self._complete(self)
        if self._error is not None:
            raise self._error
        return self._result

    def _settle(self, result=None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        self._done = True
        self._complete = None


class Channel:
    """Both directions between this rank and one peer. Messages arrive in the order they were sent.

    Not thread-safe: a channel takes one call at a time. A call (send, recv, shrink, the async
    variants and their handles' ``wait``) made while another thread is inside one raises
    ProtocolError at once and changes nothing; give each thread its own channel instead.
    ``close`` and ``abort`` may come from any thread at any time: a call in progress in another
    thread then raises ProtocolError (over shared memory and CUDA IPC at once; over
    torch.distributed once its wait ends, which gloo cannot cut short: when the peer sends, dies or
    times out), and whichever of the two threads is last releases the channel.
    """

    backend: str
    initial_slot_bytes: int = 1 << 20  # what connect() was given; shrink()'s default

    def __init__(self, rank: int, peer_rank: int, device: torch.device, timeout: float):
        self.rank = rank
        self.peer_rank = peer_rank
        self.device = device
        self.timeout = timeout
        self._pending_recvs: collections.deque[Handle] = collections.deque()
        self._lock = threading.Lock()  # held by the call inside; never waited for, except by close/abort
        self._inside: str | None = None  # that call's name, for the error of a call that overlaps it
        self._shutdown_lock = threading.Lock()  # makes the first close or abort the only one
        self._closed = False
        self._abort_reason: str | None = None
        self._released = False

    def send(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Sends a tuple or list of tensors (any dtypes and shapes; None entries kept) as one transfer."""
        if not isinstance(tensors, (list, tuple)):
            self._refuse_message(tensors)
        self._enter("send")
        try:
            self._send(tensors)
        finally:
            self._leave()

    def recv(self, out: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor | None, ...]:
        """Receives the next message; into ``out`` if given, which must match it exactly."""
        self._enter("recv")
        try:
            if self._pending_recvs:
                self._receive_through(self._pending_recvs[-1])
            message = self._recv()
        finally:
            self._leave()
        return message if out is None else self._fill(out, message)

    def send_recv(self, tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Sends a message and receives the peer's, as in the 1F1B steady state."""
        self.send(tensors)
        return self.recv()

    def send_async(self, tensors: Sequence[torch.Tensor | None]) -> Handle:
        self.send(tensors)
        return Handle()

    def recv_async(self, out: Sequence[torch.Tensor | None] | None = None) -> Handle:
        self._enter("recv_async")
        try:
            handle = Handle(self._wait_pending, out)
            self._pending_recvs.append(handle)
        finally:
            self._leave()
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
        if slot_bytes is not None and slot_bytes < 1:
            raise ValueError(f"{self._describe_direction('receive')}: shrink: slot_bytes must be positive, got {slot_bytes}")
        self._enter("shrink")
        try:
            return self._shrink(self.initial_slot_bytes if slot_bytes is None else slot_bytes)
        finally:
            self._leave()

    def close(self) -> None:
        """Closes both directions; the peer receives what was sent before, then its receives raise ProtocolError.

        Over torch.distributed it first waits for this end's sends to be received (up to the timeout).
        A no-op on a closed channel.
        """
        self._shut_down(None)

    def abort(self, reason: str) -> None:
        """Closes this end at once, for a rank that failed: the peer's pending or next receive (after what
        was sent before) raises a ChannelError that names the channel, over torch.distributed with
        ``reason`` in it, over shared memory and CUDA IPC also its sends.

        Never raises (the peer may be dead), returns within about a second (over torch.distributed at
        once: the message carrying ``reason`` goes when the peer receives, while this process lives) and
        is a no-op on a closed channel. Later calls on this end raise ProtocolError.
        """
        with contextlib.suppress(Exception):
            self._shut_down(str(reason) or "no reason given")

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _enter(self, action: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise ProtocolError(
                f"{self._name()}: cannot {action}: another thread is inside {self._inside or 'a call'} on this "
                f"channel; a channel takes one call at a time (give each thread its own channel)"
            )
        if self._closed:
            self._lock.release()
            reason = f" (aborted: {self._abort_reason})" if self._abort_reason is not None else ""
            raise ProtocolError(f"{self._name()}: cannot {action}: the channel was closed{reason}")
        self._inside = action

    def _leave(self) -> None:
        self._inside = None
        try:
            if self._closed and not self._released:  # closed by another thread while this call was inside
                with contextlib.suppress(Exception):
                    self._release()
        finally:
            self._lock.release()

    def _shut_down(self, abort_reason: str | None) -> None:
        with self._shutdown_lock:
            if self._closed:
                return
            self._abort_reason = abort_reason
            self._closed = True
        if abort_reason is not None:
            with contextlib.suppress(Exception):  # the peer may be gone; this end is released all the same
                self._signal_abort(abort_reason)
        if not self._lock.acquire(blocking=False):
            self._interrupt()
            if not self._lock.acquire(timeout=_SHUTDOWN_WAIT_SECONDS):
                return  # the call inside releases the channel when it leaves
        try:
            if not self._released:
                self._release()
        finally:
            self._lock.release()

    def _release(self) -> None:
        self._released = True
        if self._abort_reason is None:
            self._close()
        else:
            self._abort(self._abort_reason)

    def _wait_pending(self, handle: Handle) -> None:
        self._enter("wait")
        try:
            self._receive_through(handle)
        finally:
            self._leave()

    def _receive_through(self, handle: Handle) -> None:
        # Messages are matched to receives in posting order, whatever order the handles are waited in.
        while not handle._done:
            front = self._pending_recvs.popleft()
            try:
                message = self._recv()
                if front._out is not None:
                    message = self._fill(front._out, message)
            except BaseException as error:
                front._settle(error=error)
                raise
            front._settle(message)

    def _fill(self, out, message: tuple) -> tuple:
        _copy_into(message, out, self._describe_direction("receive"))
        return tuple(out)

    def _refuse_message(self, tensors) -> None:
        hint = " (wrap a single tensor as [tensor])" if isinstance(tensors, torch.Tensor) else ""
        raise TypeError(
            f"{self._describe_direction('send')}: send takes a tuple or list of tensors (None entries allowed), "
            f"not a {type(tensors).__name__}{hint}"
        )

    def _name(self) -> str:
        return f"pipecomm {self.backend} channel rank {self.rank} <-> rank {self.peer_rank}"

    def _describe_direction(self, action: str) -> str:
        source, target = (self.rank, self.peer_rank) if action == "send" else (self.peer_rank, self.rank)
        return f"pipecomm {self.backend} channel rank {source} -> rank {target}"

    def _send(self, tensors: Sequence) -> None:
        raise NotImplementedError

    def _recv(self) -> tuple:
        raise NotImplementedError

    def _shrink(self, slot_bytes: int) -> bool:
        raise NotImplementedError

    def _close(self) -> None:
        """Releases this end in order (close)."""
        raise NotImplementedError

    def _abort(self, reason: str) -> None:
        """Releases this end at once, the peer told why (abort); bounded in time."""
        raise NotImplementedError

    def _signal_abort(self, reason: str) -> None:
        """Tells the peer of an abort before this end is released, while a call may still be inside."""

    def _interrupt(self) -> None:
        """Makes a call waiting in another thread raise now, where the backend can."""


class ShmChannel(Channel):
    """CPU tensors between processes of one host, through shared-memory rings; each message is one native call."""

    backend = "shm"

    def __init__(self, rank, peer_rank, device, timeout, native):
        super().__init__(rank, peer_rank, device, timeout)
        self._native = native
        self._send = native.send
        self._recv = native.recv
        self._interrupt = native.interrupt

    def _close(self):
        self._native.close()

    def _abort(self, reason):
        self._native.close(reason)

    def _shrink(self, slot_bytes):
        return self._native.shrink(slot_bytes)


class DistChannel(Channel):
    """Any two ranks through torch.distributed: a header on the host per message, the metadata only when it
    changes, one packed payload.

    The channel opens two-rank process groups of its own from the default store, so that its messages never
    mix with another channel's or the program's (NCCL matches a send to a receive by order alone, whatever
    the tag). A gloo group carries the headers, and the data too, except for CUDA tensors where ``group`` is
    an NCCL group: those go over one NCCL group per direction, so that a send waiting for its receiver never
    holds up a receive queued behind it on one NCCL stream, whatever order the two ranks post them in. The
    receiver reads each header on the host and posts the payload's receive at once: over NCCL, no receive
    waits for the GPU and the data never leaves it. The frames are the native codec's (``_C.MessageCodec``).
    """

    backend = "dist"

    def __init__(self, rank, peer_rank, device, timeout, group, rendezvous, num_slots):
        super().__init__(rank, peer_rank, device, timeout)
        self._codec = _C.MessageCodec(str(device), self._describe_direction("send"), self._describe_direction("receive"))
        self._pair_rank = 0 if rank < peer_rank else 1
        self._rendezvous = rendezvous
        store = rendezvous.store
        wait = datetime.timedelta(seconds=timeout)
        self._control = dist.ProcessGroupGloo(dist.PrefixStore(f"{rendezvous.prefix}/gloo", store), self._pair_rank, 2, wait)
        self._nccl = device.type == "cuda" and "nccl" in str(dist.get_backend(group))
        if self._nccl:
            self._outgoing = _nccl_group(store, rendezvous.prefix, rank, peer_rank, wait)
            self._incoming = _nccl_group(store, rendezvous.prefix, peer_rank, rank, wait)
            self._connect_nccl()
        else:
            self._outgoing = self._incoming = self._control
        self._wire_device = device if self._nccl else torch.device("cpu")
        # Past this many messages in flight, a send waits for the oldest: gloo's sends report completion only
        # to wait(), and the buffers of a peer that stopped receiving would otherwise pile up.
        self._window = num_slots
        # (seq, host works, NCCL works, buffers) of sends not known to be complete; the buffers must outlive them.
        self._in_flight: collections.deque = collections.deque()
        self._send_seq = 0
        self._recv_seq = 0
        # Over gloo a send waits for its receive to be posted, and is then written by the sending process's
        # I/O thread, which a busy compute thread may keep off the core for milliseconds. So each header's
        # receive is posted as the previous one arrives, and, where the last payload had n > 0 bytes, a
        # receive of n bytes (a slot): a payload of 1 to n bytes goes into it, any other sends the slot a
        # filler and goes on its own. Both ends know n, so no header needs to say which.
        self._header: tuple | None = None  # (buffer, work) of the next header's receive, once posted
        self._slot: tuple | None = None  # (buffer, work) of the next payload's slot, once posted
        self._slot_bytes = 0  # the slot the peer posts for this end's next message
        self._peer_gone: str | None = None  # why the peer takes no more messages, once known

    def _connect_nccl(self) -> None:
        """Creates both directions' NCCL communicators now, in the same order on both ranks: created on first use,
        a send's communicator would hold its host until the peer posted the matching receive."""
        for source in sorted((self.rank, self.peer_rank)):
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            direction = "send" if source == self.rank else "receive"
            self._post(self._outgoing if source == self.rank else self._incoming, probe, _PAYLOAD_TAG,
                       "the communicator's first message", direction).wait()
        torch.cuda.current_stream(self.device).synchronize()

    def _send(self, tensors):
        if self._peer_gone is not None:
            raise ProtocolError(f"{self._describe_direction('send')}: cannot send message {self._send_seq}: {self._peer_gone}")
        self._retire_sends()
        header, meta, payload = self._codec.encode(tensors)
        what = f"message {self._send_seq}"
        host = [self._post(self._control, header, _HEADER_TAG, what, "send")]
        if meta is not None:
            host.append(self._post(self._control, meta, _META_TAG, what, "send"))
        device_works = []
        if self._nccl:
            if payload is not None:
                device_works.append(self._post(self._outgoing, payload, _PAYLOAD_TAG, what, "send"))
        else:
            payload_bytes = 0 if payload is None else payload.numel()
            payload = None if payload is None else payload.cpu()
            fits = _fits_slot(payload_bytes, self._slot_bytes)
            if self._slot_bytes:  # the receiver posted a slot for this message: it gets the payload or a filler
                host.append(self._post(self._control, payload if fits else _FILLER, _SLOT_TAG, what, "send"))
            if payload_bytes and not fits:
                host.append(self._post(self._control, payload, _PAYLOAD_TAG, what, "send"))
            self._slot_bytes = payload_bytes
        self._in_flight.append((self._send_seq, host, device_works, (header, meta, payload)))
        self._send_seq += 1

    def _retire_sends(self) -> None:
        while self._in_flight and all(work.is_completed() for work in self._in_flight[0][1] + self._in_flight[0][2]):
            self._in_flight.popleft()
        while len(self._in_flight) >= self._window:
            self._complete_oldest_send()

    def _complete_oldest_send(self) -> None:
        seq, host, device_works, _ = self._in_flight.popleft()
        what = f"rank {self.rank} was waiting to send message {seq}"
        for work in host:
            self._wait(work, what, "send")
        deadline = time.monotonic() + self.timeout
        for work in device_works:
            # A wait() would only make this stream wait; the buffers' memory needs the GPU done with them.
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise ChannelTimeoutError(f"{self._describe_direction('send')}: timed out after {self.timeout:g} s "
                                              f"while {what} (the peer has not received it)")
                time.sleep(1e-4)

    def _post(self, group, tensor: torch.Tensor, tag: int, what: str, direction: str):
        # In a direction's NCCL group the sender is rank 0; the gloo group has the ranks in the pair's order.
        peer = 1 - self._pair_rank if group is self._control else int(direction == "send")
        try:
            return (group.send if direction == "send" else group.recv)([tensor], peer, tag)
        except RuntimeError as error:
            doing = "sending" if direction == "send" else "receiving"
            raise self._failure(error, f"rank {self.rank} was {doing} {what}", direction) from error

    def _post_receive(self, buffer: torch.Tensor, tag: int, seq: int, part: str) -> tuple:
        return buffer, self._post(self._control, buffer, tag, f"the {part} of message {seq}", "receive")

    def _post_header_receive(self, seq: int) -> tuple:
        return self._post_receive(torch.empty(_C.FRAME_HEADER_FIELDS, dtype=torch.int64), _HEADER_TAG, seq, "header")

    def _recv(self):
        seq = self._recv_seq
        if self._peer_gone is not None:
            raise ProtocolError(f"{self._describe_direction('receive')}: cannot receive message {seq}: {self._peer_gone}")
        if self._header is None:
            self._header = self._post_header_receive(seq)
        header = self._await(self._header, seq, "header")
        self._header = None
        kind, follow, payload_bytes = self._codec.read_header(header)
        if kind == "abort":
            reason = _decode(self._await(self._post_receive(torch.empty(follow, dtype=torch.uint8), _META_TAG, seq,
                                                            "reason"), seq, "reason"))
            self._peer_gone = f"peer rank {self.peer_rank} aborted the channel: {reason}"
            raise ProtocolError(f"{self._describe_direction('receive')}: {self._peer_gone} (rank {self.rank} was waiting "
                                f"to receive message {seq})")
        if self._closed:
            raise ProtocolError(f"{self._describe_direction('receive')}: rank {self.rank} stopped waiting to receive "
                                f"message {seq}: another thread closed the channel")
        # The next header's receive goes out now, so that the peer's send of it finds it posted.
        self._header = self._post_header_receive(seq + 1)
        meta = self._await(self._post_receive(torch.empty(follow, dtype=torch.uint8), _META_TAG, seq, "metadata"), seq,
                           "metadata") if follow else None
        message = self._codec.allocate(meta, payload_bytes)
        payload = self._nccl_payload(payload_bytes, seq) if self._nccl else self._host_payload(payload_bytes, seq)
        if payload is not None:
            self._codec.unpack_payload(payload)
        self._recv_seq += 1
        return message

    def _nccl_payload(self, payload_bytes: int, seq: int) -> torch.Tensor | None:
        if not payload_bytes:
            return None
        payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
        self._post(self._incoming, payload, _PAYLOAD_TAG, f"the payload of message {seq}", "receive").wait()
        return payload  # the wait above only ordered this stream after the receive: the host goes on

    def _host_payload(self, payload_bytes: int, seq: int) -> torch.Tensor | None:
        """Over gloo, a payload of 1 to n bytes, n the last one's size, arrives in the slot posted for it, else on its own."""
        payload = None
        if self._slot is not None:
            slot, self._slot = self._slot, None
            received = self._await(slot, seq, "payload")
            if _fits_slot(payload_bytes, received.numel()):
                payload = received[:payload_bytes]
        if payload is None and payload_bytes:
            payload = self._await(self._post_receive(torch.empty(payload_bytes, dtype=torch.uint8), _PAYLOAD_TAG, seq,
                                                     "payload"), seq, "payload")
        if payload_bytes:
            self._slot = self._post_receive(torch.empty(payload_bytes, dtype=torch.uint8), _SLOT_TAG, seq + 1, "payload")
        return payload

    def _await(self, posted: tuple, seq: int, part: str) -> torch.Tensor:
        buffer, work = posted
        self._wait(work, f"rank {self.rank} was waiting to receive the {part} of message {seq}", "receive")
        return buffer

    def _wait(self, work, what, direction):
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise self._failure(error, what, direction) from error

    def _failure(self, error: RuntimeError, what: str, direction: str) -> ChannelError:
        """The channel error a torch.distributed error stands for; notes a peer that is gone."""
        text = str(error)
        channel = self._describe_direction(direction)
        if any(sign in text for sign in _PEER_GONE_SIGNS):
            if self._rendezvous.peer_has("closed"):
                self._peer_gone = f"peer rank {self.peer_rank} closed the channel"
                return ProtocolError(f"{channel}: {self._peer_gone} while {what}")
            self._peer_gone = f"peer rank {self.peer_rank} died"
            return PeerDiedError(f"{channel}: {self._peer_gone} while {what} ({text})")
        if "timed out" in text.lower():
            return ChannelTimeoutError(f"{channel}: timed out after {self.timeout:g} s while {what} ({text})")
        return ChannelError(f"{channel}: failed while {what}: {text}")

    def _shrink(self, slot_bytes):
        return False  # no slots: every message's buffers are allocated for it

    def _close(self):
        try:
            while self._in_flight and self._peer_gone is None:
                self._complete_oldest_send()
        finally:
            # Read by the peer when its connection closes: a close, not a death.
            with contextlib.suppress(Exception):
                self._rendezvous.set("closed", "1")
            groups = [self._control] if self._outgoing is self._control else [self._control, self._outgoing, self._incoming]
            for group in groups:
                with contextlib.suppress(Exception):
                    group.shutdown()
            # Never destroyed: a gloo group or receive destroyed while the interpreter finalizes can abort the process.
            keep_forever([*groups, *(self._header or ()), *(self._slot or ())])

    def _signal_abort(self, reason):
        if self._peer_gone is not None:
            return  # it receives nothing more
        header, data = self._codec.encode_abort(reason)
        works = [self._control.send([header], 1 - self._pair_rank, _HEADER_TAG),
                 self._control.send([data], 1 - self._pair_rank, _META_TAG)]
        # Never waited for: a thread left waiting in gloo at exit aborts the process. gloo's own thread sends
        # them once the peer receives; until the process ends, the sends, their buffers and the group stay.
        keep_forever([*works, header, data, self._control])

    def _abort(self, reason):
        if self._nccl:
            # The peer will not post receives for sends this end queued: ncclCommAbort frees this GPU of them.
            for group in (self._outgoing, self._incoming):
                with contextlib.suppress(Exception):
                    group.abort()


# The gloo tags of a dist channel's parts: each is matched in order within its tag.
_HEADER_TAG, _META_TAG, _SLOT_TAG, _PAYLOAD_TAG = 0, 1, 2, 3
_FILLER = torch.empty(0, dtype=torch.uint8)  # what a slot gets when the payload does not go into it


def _fits_slot(payload_bytes: int, slot_bytes: int) -> bool:
    return 0 < payload_bytes <= slot_bytes


def keep_forever(objects: Sequence) -> None:
    """Keeps objects alive until the process ends, never destroyed: the tensors of a collective or send left
    running, or a process group, which a gloo worker or the interpreter's finalization would otherwise free at
    a moment that aborts the process (a worker holds no GIL; a group destroyed late joins its own threads)."""
    for item in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))


def _nccl_group(store, prefix: str, source: int, target: int, timeout: datetime.timedelta):
    """A two-rank NCCL group that carries one direction of a channel: the sender is its rank 0."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.global_ranks_in_group = [source, target]
    options.group_name = f"{prefix}/nccl/{source}to{target}"
    own = 0 if dist.get_rank() == source else 1
    return dist.ProcessGroupNCCL(dist.PrefixStore(options.group_name, store), own, 2, options)


def _decode(reason: torch.Tensor) -> str:
    return reason.numpy().tobytes().decode(errors="replace")


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
    pretended = os.environ.get("PIPECOMM_HOST_ID")
    if pretended:
        return f"PIPECOMM_HOST_ID={pretended}"  # never equal to a real identity below
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            boot = boot_id.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


class _Rendezvous:
    """The store keys of one channel: both ends of the n-th connect() between two ranks share them."""

    def __init__(self, rank: int, peer_rank: int, timeout: float, peer_failure: Callable[[], str] | None = None):
        low, high = sorted((rank, peer_rank))
        _connections_per_pair[low, high] += 1
        self.number = _connections_per_pair[low, high]
        self.prefix = f"pipecomm/channel/{low}-{high}/{self.number}"
        self.rank = rank
        self.peer_rank = peer_rank
        self.is_low = rank == low
        self.timeout = datetime.timedelta(seconds=timeout)
        self.peer_failure = peer_failure
        self.store = dist.distributed_c10d._get_default_store()

    def set(self, name: str, value: bytes | str) -> None:
        self.store.set(f"{self.prefix}/{name}/{self.rank}", value)

    def get_peer(self, name: str) -> bytes:
        key = f"{self.prefix}/{name}/{self.peer_rank}"
        if self.peer_failure is None:
            try:
                self.store.wait([key], self.timeout)
            except RuntimeError as error:
                raise self._timed_out(name) from error
            return self.store.get(key)
        # check() and a short sleep rather than wait() slices, which TCPStore logs a warning for each time.
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([key]):
            reason = self.peer_failure()
            if reason:
                raise ChannelError(f"pipecomm channel rank {self.rank} <-> rank {self.peer_rank}: rank {self.rank} "
                                   f"stopped waiting for rank {self.peer_rank} to publish {name!r}: {reason}")
            if time.monotonic() >= deadline:
                raise self._timed_out(name)
            time.sleep(0.1)  # two store round trips a turn: few enough for thousands of ranks connecting at once
        return self.store.get(key)

    def _timed_out(self, name: str) -> ChannelTimeoutError:
        return ChannelTimeoutError(
            f"pipecomm channel rank {self.rank} <-> rank {self.peer_rank}: rank {self.rank} timed out after "
            f"{self.timeout.total_seconds():g} s waiting for rank {self.peer_rank} to publish {name!r} "
            f"(did it call connect({self.rank})?)"
        )

    def peer_has(self, name: str) -> bool:
        """Whether the peer published ``name``; False also when the store cannot be reached."""
        try:
            return self.store.check([f"{self.prefix}/{name}/{self.peer_rank}"])
        except RuntimeError:
            return False

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
