"""The shared-memory backend: CPU tensors between processes of one host, each message one native call."""

from __future__ import annotations

import torch

from pipecomm import _C
from pipecomm.transport.channel import Channel
from pipecomm.transport.rendezvous import Rendezvous

__all__ = ["ShmChannel"]


class ShmChannel(Channel):
    """CPU tensors between processes of one host, through shared-memory rings; each message is one native call."""

    backend = "shm"

    def __init__(self, rank, peer_rank, device, timeout, native):
        super().__init__(rank, peer_rank, device, timeout)
        self._native = native

    @classmethod
    def open(cls, rendezvous: Rendezvous, device: torch.device, timeout: float, num_slots: int,
             slot_bytes: int) -> ShmChannel:
        """Opens this end's rings, named through ``rendezvous``, and waits until both directions are connected."""
        rank, peer_rank = rendezvous.rank, rendezvous.peer_rank
        native = _C.ShmChannel(*rendezvous.segment_names(), rank, peer_rank, num_slots, slot_bytes, timeout)
        native.connect()
        return cls(rank, peer_rank, device, timeout, native)

    def _send(self, tensors):
        self._native.send(tensors)

    def _recv(self):
        return self._native.recv()

    def _interrupt(self):
        self._native.interrupt()

    def _close(self):
        self._native.close()

    def _abort(self, reason):
        self._native.close(reason)

    def _shrink(self, slot_bytes):
        return self._native.shrink(slot_bytes)
