"""The shared-memory backend: CPU tensors between processes of one host, each message one native call."""

from __future__ import annotations

import torch

from pipecomm import _C
from pipecomm.transport.channel import NativeChannel
from pipecomm.transport.rendezvous import Rendezvous

__all__ = ["ShmChannel"]


class ShmChannel(NativeChannel):
    """CPU tensors between processes of one host, through shared-memory rings; each message is one native call."""

    backend = "shm"

    @classmethod
    def open(cls, rendezvous: Rendezvous, device: torch.device, timeout: float, num_slots: int,
             slot_bytes: int) -> ShmChannel:
        """Opens this end's rings, named through ``rendezvous``, and waits until both directions are connected."""
        rank, peer_rank = rendezvous.rank, rendezvous.peer_rank
        native = _C.ShmChannel(*rendezvous.segment_names(), rank, peer_rank, num_slots, slot_bytes, timeout)
        native.connect()
        return cls(rank, peer_rank, device, timeout, native)

    def _close(self):
        self._native.close()

    def _abort(self, reason):
        self._native.close(reason)
