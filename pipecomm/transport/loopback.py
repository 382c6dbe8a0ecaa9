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
        self._messages: collections.deque[tuple] = collections.deque()

    def _send(self, tensors):
        self._messages.append(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors))

    def _recv(self):
        if not self._messages:
            # Nothing will come: only this rank sends here, and it is inside this call.
            raise ProtocolError(f"{self._describe_direction('receive')}: nothing was sent before this receive")
        return self._messages.popleft()

    def _shrink(self, slot_bytes):
        return False  # no slots: every message is its own copy

    def _close(self):
        self._messages.clear()

    def _abort(self, reason):
        self._messages.clear()
