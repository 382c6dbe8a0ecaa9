"""Where the two ends of a channel meet: the default store's keys of one connection, and which host a rank is on."""

from __future__ import annotations

import collections
import datetime
import os
import socket
import time
import uuid
from collections.abc import Callable

import torch.distributed as dist

from pipecomm.transport.channel import ChannelError, ChannelTimeoutError

__all__ = ["SEGMENT_PREFIX", "Rendezvous", "host_identity"]

# Every shared-memory segment of a channel (its rings' control and data generations, the IPC channel's
# host and post rings) is named from this prefix.
SEGMENT_PREFIX = "/pipecomm."

# Per (low rank, high rank) pair, how many channels this process has opened, so that both ends of
# the n-th connect() between two ranks agree on its store keys without talking first.
_connections_per_pair: collections.Counter = collections.Counter()


def host_identity() -> str:
    """This rank's host: its machine and boot, or the PIPECOMM_HOST_ID it pretends."""
    pretended = os.environ.get("PIPECOMM_HOST_ID")
    if pretended:
        return f"PIPECOMM_HOST_ID={pretended}"  # never equal to a real identity below
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            boot = boot_id.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


class Rendezvous:
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
        pause = 0.001  # a peer a moment behind is found at once; one far behind costs two store round trips each 0.1 s
        while not self.store.check([key]):
            reason = self.peer_failure()
            if reason:
                raise ChannelError(f"pipecomm channel rank {self.rank} <-> rank {self.peer_rank}: rank {self.rank} "
                                   f"stopped waiting for rank {self.peer_rank} to publish {name!r}: {reason}")
            if time.monotonic() >= deadline:
                raise self._timed_out(name)
            time.sleep(pause)  # few enough round trips for thousands of ranks connecting at once
            pause = min(2 * pause, 0.1)
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

    def segment_names(self) -> tuple[str, str]:
        """The incoming and outgoing rings' shared-memory names, unique to this pair and connection."""
        token = self.token()
        return (f"{SEGMENT_PREFIX}{token}.{self.peer_rank}to{self.rank}",
                f"{SEGMENT_PREFIX}{token}.{self.rank}to{self.peer_rank}")
