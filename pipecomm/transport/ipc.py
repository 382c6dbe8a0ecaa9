"""The CUDA-IPC backend's Python side: opening it, growing the peer's slots through the store, and a bounded close and abort."""

from __future__ import annotations

import struct
import threading
import time

import torch

from pipecomm import _C
from pipecomm.transport.channel import Channel, ChannelTimeoutError
from pipecomm.transport.rendezvous import Rendezvous

__all__ = ["IpcChannel"]

_GROW_REQUEST = struct.Struct("<QQ")  # slot bytes needed, first message seq to use them
# How often the grow service looks for requests: fast right after one, backing off while idle.
_POLL_MIN_SECONDS = 0.001
_POLL_MAX_SECONDS = 0.05
# How long an abort waits for the grow service to stop, then for the copies queued on the channel's stream.
_ABORT_PATIENCE_SECONDS = 0.5


class IpcChannel(Channel):
    """CUDA tensors between processes of one host.

    Once a receiver has seen a layout twice in a row, it posts buffers of that layout for the next
    messages; a send that finds its buffer posted copies straight into it (copy engines, no SMs) and
    the receive returns views of it without a copy. Otherwise a send copies into the peer's slot
    after a wait until the peer has consumed it, and the receive copies out. Flags written and waited
    on by the streams order everything; the host never waits on the GPU.
    """

    backend = "ipc"

    def __init__(self, rank, peer_rank, device, timeout, native, rendezvous):
        super().__init__(rank, peer_rank, device, timeout)
        self._native = native
        self._rendezvous = rendezvous
        self._grow_requests = 0
        # The peer may need bigger slots while this rank is busy elsewhere: a thread answers at once,
        # so two ranks sending oversized messages to each other cannot deadlock.
        self._grow_service = threading.Thread(target=self._serve_grow_requests, daemon=True)
        self._grow_service.start()

    @classmethod
    def open(cls, rendezvous: Rendezvous, device: torch.device, timeout: float, num_slots: int,
             slot_bytes: int) -> IpcChannel:
        """Creates this end's rings, named through ``rendezvous``, and maps the peer's from the handles it publishes."""
        rank, peer_rank = rendezvous.rank, rendezvous.peer_rank
        native = _C.IpcChannel(*rendezvous.segment_names(), rank, peer_rank, device.index, num_slots, slot_bytes,
                               timeout)
        rendezvous.set("ipc", native.handles())
        native.connect(rendezvous.get_peer("ipc"))
        return cls(rank, peer_rank, device, timeout, native, rendezvous)

    def _shrink(self, slot_bytes):
        # The peer may already be sending the next num_slots messages into the old slots: the smaller
        # ones take over after those, and the old memory then goes back to torch's caching allocator.
        return self._native.shrink(slot_bytes)

    @property
    def direct_messages(self) -> tuple[int, int]:
        """How many messages went straight into posted buffers: (sent, received)."""
        return self._native.direct_sends, self._native.direct_recvs

    def host_phase_times(self) -> dict[str, list[tuple[str, float, int]]]:
        """With PIPECOMM_IPC_HOST_TIMING=1 set before connect: for send and for recv, each phase's name,
        total host microseconds and calls (Python's own share is not in them). Empty lists otherwise."""
        return self._native.host_phase_times()

    def _send(self, tensors):
        needed = self._native.send(tensors)
        if needed:
            self._request_growth(needed)
            self._native.send(tensors)

    def _recv(self):
        return self._native.recv()

    def _interrupt(self):
        self._native.interrupt()

    def _request_growth(self, needed: int) -> None:
        self._grow_requests += 1
        seq = self._native.next_send_seq
        self._rendezvous.set(f"grow/{self._grow_requests}", _GROW_REQUEST.pack(needed, seq))
        try:
            handles = self._rendezvous.get_peer(f"grown/{self._grow_requests}")
        except ChannelTimeoutError as error:
            raise ChannelTimeoutError(
                f"{self._describe_direction('send')}: rank {self.rank} timed out after {self.timeout:g} s waiting "
                f"for rank {self.peer_rank} to grow its slots to {needed} bytes for message {seq}"
            ) from error
        self._native.update(handles)

    def _serve_grow_requests(self) -> None:
        # Polls with check(), which holds the store client only briefly: a blocking wait() would hold
        # a TCPStore client's socket and stall the owner thread's own store calls.
        store = self._rendezvous.store
        request = 1
        pause = _POLL_MIN_SECONDS
        while not self._closed:
            key = f"{self._rendezvous.prefix}/grow/{request}/{self.peer_rank}"
            try:
                asked = store.check([key])
            except RuntimeError:  # the store is briefly unreachable
                asked = False
            if not asked:
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_SECONDS)
                continue
            needed, first_seq = _GROW_REQUEST.unpack(store.get(key))
            self._rendezvous.set(f"grown/{request}", self._native.grow(needed, first_seq))
            request += 1
            pause = _POLL_MIN_SECONDS

    def _close(self):
        if not self._release_native("", 5, self.timeout):
            raise ChannelTimeoutError(
                f"{self._name()}: transfers still pending {self.timeout:g} s after close; the peer is gone or "
                f"stopped receiving"
            )

    def _abort(self, reason):
        self._release_native(reason, _ABORT_PATIENCE_SECONDS, _ABORT_PATIENCE_SECONDS)

    def _release_native(self, reason: str, service_patience: float, transfer_patience: float) -> bool:
        """Closes the native channel; returns whether the copies queued on it finished in time."""
        # The grow service stops within a poll once the channel is closed; it must not grow a closed ring.
        self._grow_service.join(timeout=service_patience)
        self._native.close(reason)
        # The rings free their memory once the copies queued on them are done; a peer that died
        # mid-transfer would leave those waiting forever, so past the patience the memory is leaked.
        deadline = time.monotonic() + transfer_patience
        while not self._native.transfers_done():
            if time.monotonic() > deadline:
                self._native.abandon()
                return False
            time.sleep(0.001)
        return True
