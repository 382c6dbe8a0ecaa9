"""The torch.distributed backend: any two ranks, through two-rank gloo and NCCL groups of the channel's own."""

from __future__ import annotations

import collections
import contextlib
import datetime
import time

import torch
import torch.distributed as dist

from pipecomm import _C
from pipecomm.parallel.backend import uses_nccl
from pipecomm.transport.channel import Channel, ChannelError, ChannelTimeoutError, PeerDiedError, ProtocolError
from pipecomm.transport.lifetime import keep_forever

__all__ = ["DistChannel"]

# How gloo words a connection the peer's process closed, by dying or exiting.
_PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# The gloo tags of a dist channel's parts: each is matched in order within its tag.
_HEADER_TAG, _META_TAG, _SLOT_TAG, _PAYLOAD_TAG, _NOTE_TAG = 0, 1, 2, 3, 4
_FILLER = torch.empty(0, dtype=torch.uint8)  # what a slot gets when the payload does not go into it


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
        self._nccl = device.type == "cuda" and uses_nccl(group)
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
        # (work, buffer) of each note part sent since the last message: they complete with the next one's sends.
        self._notes: list[tuple] = []

    def _send_note(self, data):
        # Over gloo, in order on their own tag: a note's length, then its bytes.
        length = torch.tensor([len(data)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else _FILLER
        what = f"a note with message {self._send_seq}"
        self._notes += [(self._post(self._control, part, _NOTE_TAG, what, "send"), part) for part in (length, body)]

    def _recv_note(self):
        seq = self._recv_seq - 1
        length = self._await(self._post_receive(torch.empty(1, dtype=torch.int64), _NOTE_TAG, seq, "note"), seq,
                             "note's length")
        body = self._await(self._post_receive(torch.empty(int(length), dtype=torch.uint8), _NOTE_TAG, seq, "note"),
                           seq, "note")
        return body.numpy().tobytes()

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
        notes, self._notes = self._notes, []
        host = [*(work for work, _ in notes), self._post(self._control, header, _HEADER_TAG, what, "send")]
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
        buffers = (header, meta, payload, *(part for _, part in notes))
        self._in_flight.append((self._send_seq, host, device_works, buffers))
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
            groups = [self._control, *self._nccl_groups_in_pair_order()]
            for group in groups:
                with contextlib.suppress(Exception):
                    # Shutting an NCCL communicator down waits for the peer to shut the same one down: a dead
                    # peer never will, so its groups are aborted instead.
                    if group is not self._control and self._peer_gone is not None:
                        group.abort()
                    else:
                        group.shutdown()
            # Never destroyed: a gloo group or receive destroyed while the interpreter finalizes can abort the process.
            keep_forever([*groups, *(self._header or ()), *(self._slot or ())])

    def _nccl_groups_in_pair_order(self) -> list:
        """The two NCCL groups, the lower rank's outgoing one first, on both ends. Destroying a communicator is
        collective among the GPUs of one host: with each end shutting its own outgoing group down first, each
        would wait for the other (both ends hung so on 2 H100s, torch 2.11, NCCL 2.28)."""
        if not self._nccl:
            return []
        return [self._outgoing, self._incoming] if self._pair_rank == 0 else [self._incoming, self._outgoing]

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
            for group in self._nccl_groups_in_pair_order():
                with contextlib.suppress(Exception):
                    group.abort()


def _fits_slot(payload_bytes: int, slot_bytes: int) -> bool:
    return 0 < payload_bytes <= slot_bytes


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
