"""The loopback backend: a channel from a rank to itself, for interleaved stages that follow each other on one rank."""

from __future__ import annotations

import collections

import torch

from pipecomm.transport.channel import Channel, ProtocolError

__all__ = ["LoopbackChannel"]


class LoopbackChannel(Channel):
    """Messages from this rank to itself, kept in order as detached copies (the sender may change its tensors)."""

    backend = "loopback"

    def __init__(self, rank: int, device: torch.device, timeout: float):
        super().__init__(rank, rank, device, timeout)
        self._messages: collections.deque[tuple | bytes] = collections.deque()  # the notes among them as bytes
        self._notes: collections.deque[bytes] = collections.deque()  # those that came with the messages received

    def _send(self, tensors):
        self._messages.append(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors))

    def _send_note(self, data):
        self._messages.append(data)

    def _recv(self):
        while self._messages and isinstance(self._messages[0], bytes):
            self._notes.append(self._messages.popleft())
        if not self._messages:
            # Nothing will come: only this rank sends here, and it is inside this call.
            raise ProtocolError(f"{self._describe_direction('receive')}: nothing was sent before this receive")
        return self._messages.popleft()

    def _recv_note(self):
        return self._notes.popleft() if self._notes else None

    def _shrink(self, slot_bytes):
        return False  # no slots: every message is its own copy

    def _close(self):
        self._messages.clear()
        self._notes.clear()

    def _abort(self, reason):
        self._close()
