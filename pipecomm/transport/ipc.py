"""The CUDA-IPC backend's Python side: opening it, and a bounded close and abort.

Everything else is native (csrc/transport/ipc_channel.cpp), the control plane included: a send that needs
bigger slots asks the peer on the host ring and waits for the grown generation on the post ring, while
every waiting channel call of this process answers such requests for all of its channels.
"""

from __future__ import annotations

import time

import torch

from pipecomm import _C
from pipecomm.transport.channel import ChannelTimeoutError, NativeChannel
from pipecomm.transport.rendezvous import Rendezvous

__all__ = ["IpcChannel"]

# How long an abort waits for the copies queued on the channel's stream.
_ABORT_PATIENCE_SECONDS = 0.5


class IpcChannel(NativeChannel):
    """CUDA tensors between processes of one host.

    Once a receiver has seen a layout twice in a row, it posts buffers of that layout for the next
    messages; a send that finds its buffer posted copies straight into it (copy engines, no SMs) and
    the receive returns views of it without a copy. Otherwise a send copies into the peer's slot
    after a wait until the peer has consumed it, and the receive copies out. Flags written and waited
    on by the streams order everything; the host never waits on the GPU. A shrink takes effect after
    the next num_slots messages (the peer may already be sending those into the old slots), and the
    old memory then goes back to torch's caching allocator; the receiver shrinks its grown slots by itself
    after a run of messages that all went into posted buffers. A receive given a ``layout_key`` whose layout
    is the one posted for returns before the peer's note arrives (``Channel.recv``).
    """

    backend = "ipc"

    def __init__(self, rank: int, peer_rank: int, device: torch.device, timeout: float, native):
        super().__init__(rank, peer_rank, device, timeout, native)
        self._copy_stream: torch.cuda.Stream | None = None  # the native channel's, once an event is recorded on it

    @classmethod
    def open(cls, rendezvous: Rendezvous, device: torch.device, timeout: float, num_slots: int,
             slot_bytes: int) -> IpcChannel:
        """Creates this end's rings, named through ``rendezvous``, and maps the peer's from the handles it publishes."""
        rank, peer_rank = rendezvous.rank, rendezvous.peer_rank
        native = _C.IpcChannel(*rendezvous.segment_names(), rank, peer_rank, device.index, num_slots, slot_bytes,
                               timeout)
        rendezvous.set("ipc", native.handles())
        native.connect(rendezvous.get_peer("ipc"))
        return cls(rank, peer_rank, device, timeout, native)

    @property
    def direct_messages(self) -> tuple[int, int]:
        """How many messages went straight into posted buffers: (sent, received)."""
        return self._native.direct_sends, self._native.direct_recvs

    @property
    def received_ahead(self) -> int:
        """How many receives returned before the peer's note (``Channel.recv``'s ``layout_key``)."""
        return self._native.ahead_recvs

    def host_phase_times(self) -> dict[str, list[tuple[str, float, int]]]:
        """With PIPECOMM_IPC_HOST_TIMING=1 set before connect: for send and for recv, each phase's name,
        total host microseconds and calls (Python's own share is not in them). Empty lists otherwise."""
        return self._native.host_phase_times()

    def _send_read_event(self):
        # A large message is copied on the channel's stream, ordered after the caller's: the event follows it there.
        # A small one goes on the caller's stream, which then orders it by itself; the event costs it nothing.
        if self._copy_stream is None:
            stream_id, device_index, device_type = self._native.channel_stream()
            self._copy_stream = torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                                                  device_type=device_type)
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def _recv_keyed(self, layout_key):
        return self._native.recv(layout_key)

    def _settle(self):
        self._native.settle()

    def _close(self):
        if not self._release_native("", self.timeout):
            raise ChannelTimeoutError(
                f"{self._name()}: transfers still pending {self.timeout:g} s after close; the peer is gone or "
                f"stopped receiving"
            )

    def _abort(self, reason):
        self._release_native(reason, _ABORT_PATIENCE_SECONDS)

    def _release_native(self, reason: str, transfer_patience: float) -> bool:
        """Closes the native channel; returns whether the copies queued on it finished in time."""
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
