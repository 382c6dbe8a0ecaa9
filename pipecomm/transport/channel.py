"""The one base of every channel backend: the public calls, their locking and shutdown, and the hooks a backend implements."""

from __future__ import annotations

import abc
import collections
import contextlib
import threading
from collections.abc import Sequence

import torch

from pipecomm import _C

__all__ = ["Channel", "ChannelError", "ChannelTimeoutError", "Handle", "NativeChannel", "PeerDiedError", "ProtocolError"]

ChannelError = _C.ChannelError
ChannelTimeoutError = _C.ChannelTimeoutError
PeerDiedError = _C.PeerDiedError
ProtocolError = _C.ProtocolError

# How long close() and abort() wait for a call in another thread to leave before leaving the release to it.
_SHUTDOWN_WAIT_SECONDS = 1.0


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


class Channel(abc.ABC):
    """Both directions between this rank and one peer. Messages arrive in the order they were sent.

    Not thread-safe: a channel takes one call at a time. A call (send, recv, the notes, shrink, the
    async variants and their handles' ``wait``) made while another thread is inside one raises
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

    def recv(self, out: Sequence[torch.Tensor | None] | None = None, *,
             layout_key: int | None = None) -> tuple[torch.Tensor | None, ...]:
        """Receives the next message; into ``out`` if given, which must match it exactly.

        ``layout_key`` says the message has the layout (entries, shapes, dtypes) of the last message received with
        the same key. Over CUDA IPC with PIPECOMM_RUN_AHEAD=1 the receive may then return before the peer's note,
        the caller's stream waiting on the device for the data, and the note is checked at the next receive in
        order, ``recv_note``, ``shrink``, ``settle`` or ``close``: a message the peer sent otherwise raises
        ProtocolError there, and the stream will have read something else, so the key must be one the caller can
        vouch for. Ignored elsewhere.
        """
        self._enter("recv")
        try:
            if self._pending_recvs:
                self._receive_through(self._pending_recvs[-1])
            message = self._recv() if layout_key is None else self._recv_keyed(layout_key)
        finally:
            self._leave()
        return message if out is None else self._fill(out, message)

    def settle(self) -> None:
        """Returns once every message received ahead of its note (``recv``'s ``layout_key``) has been checked
        against it; raises ProtocolError for one the peer sent otherwise."""
        self._enter("settle")
        try:
            self._settle()
        finally:
            self._leave()

    def send_read_event(self) -> torch.cuda.Event | None:
        """An event after which the device has read the tensors of the last message sent, for a caller that writes
        them again (a CUDA graph's landing buffer) while that copy may still be in flight: its stream waits on the
        event before it writes. None where nothing is left to wait for (the send has read them, or reads them on the
        caller's stream, as the backends but CUDA IPC do)."""
        self._enter("send_read_event")
        try:
            return self._send_read_event()
        finally:
            self._leave()

    def send_note(self, data: bytes) -> None:
        """Sends ``data`` on the host with this end's next message, for the peer's ``recv_note`` once it has received
        that message: no device copy or wait for the GPU at either end (a stage boundary's structure header goes so)."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"{self._describe_direction('send')}: send_note takes bytes, not a {type(data).__name__}")
        self._enter("send_note")
        try:
            self._send_note(bytes(data))
        finally:
            self._leave()

    def recv_note(self) -> bytes:
        """The oldest note not taken yet of those that came with the messages received so far; notes come out in the
        order they were sent, each once. If there is none, a ProtocolError, except over torch.distributed, which
        cannot tell: there the call waits for the peer's next note, up to the timeout."""
        self._enter("recv_note")
        try:
            note = self._recv_note()
        finally:
            self._leave()
        if note is None:
            raise ProtocolError(f"{self._describe_direction('receive')}: recv_note: no note came with the messages "
                                f"received so far, or each was taken already")
        return note

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

    # The hooks every backend implements; the public methods above call them with the channel entered.

    @abc.abstractmethod
    def _send(self, tensors: Sequence) -> None:
        """Sends one message; returns once its tensors may be reused."""

    @abc.abstractmethod
    def _recv(self) -> tuple:
        """Receives the next message."""

    def _recv_keyed(self, layout_key: int) -> tuple:
        """Receives the next message, whose layout ``layout_key`` names (see ``recv``)."""
        return self._recv()

    def _settle(self) -> None:
        """Checks the messages received ahead of their notes."""

    def _send_read_event(self) -> torch.cuda.Event | None:
        """``send_read_event``'s event; None for a backend whose sends read their tensors before they return or on the
        caller's stream."""
        return None

    @abc.abstractmethod
    def _send_note(self, data: bytes) -> None:
        """Sends a note with the next message."""

    @abc.abstractmethod
    def _recv_note(self) -> bytes | None:
        """Takes the oldest note that came with the messages received; None if there is none."""

    @abc.abstractmethod
    def _shrink(self, slot_bytes: int) -> bool:
        """Shrinks this end's incoming slots to ``slot_bytes``; returns whether they shrank."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Releases this end in order (close)."""

    @abc.abstractmethod
    def _abort(self, reason: str) -> None:
        """Releases this end at once, the peer told why (abort); bounded in time."""

    def _signal_abort(self, reason: str) -> None:
        """Tells the peer of an abort before this end is released, while a call may still be inside."""

    def _interrupt(self) -> None:
        """Makes a call waiting in another thread raise now, where the backend can."""


class NativeChannel(Channel):
    """A backend whose every message is one call of a native channel (shm, IPC): send, recv, the notes, shrink and
    interrupt go straight to it; opening, close and abort stay the backend's own."""

    def __init__(self, rank: int, peer_rank: int, device: torch.device, timeout: float, native):
        super().__init__(rank, peer_rank, device, timeout)
        self._native = native

    def _send(self, tensors):
        self._native.send(tensors)

    def _recv(self):
        return self._native.recv()

    def _send_note(self, data):
        self._native.send_note(data)

    def _recv_note(self):
        return self._native.recv_note()

    def _shrink(self, slot_bytes):
        return self._native.shrink(slot_bytes)

    def _interrupt(self):
        self._native.interrupt()


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
