"""One rank's channels to the ranks of its neighbouring stages: opened in one global order, closed in it, or aborted."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from pipecomm import transport
from pipecomm.runtime import boundary
from pipecomm.parallel.mesh import global_rank
from pipecomm.schedules.schedule import Schedule
from pipecomm.transport.loopback import LoopbackChannel

__all__: list[str] = []


class NeighbourLinks:
    """Two channels (activations, gradients) to every rank holding a stage next to one of this rank's, by
    (peer's pipeline rank, "act" or "grad"); activations cross as structures, gradients flat."""

    def __init__(self):
        self.channels: dict[tuple[int, str], object] = {}

    def connect(self, schedule: Schedule, rank: int, group: dist.ProcessGroup | None, device: torch.device,
                backend: str, timeout: float, peer_failure: Callable[[], str]) -> None:
        """Opens the channels in one global order of rank pairs, so that no two ranks wait on each other's connect;
        each is kept as it opens, so that a failure midway aborts the ones already open."""
        peers = set()
        for stage in schedule.stages_of(rank):
            for neighbour in (stage - 1, stage + 1):
                if 0 <= neighbour < schedule.num_stages:
                    peers.add(schedule.stage_rank(neighbour))
        mine = global_rank(group, rank)
        for peer in sorted(peers, key=lambda peer: (min(peer, rank), max(peer, rank))):
            for kind in ("act", "grad"):
                if peer == rank:
                    channel = LoopbackChannel(mine, device, timeout)
                else:
                    channel = transport.connect(global_rank(group, peer), group, backend, device=device,
                                                timeout=timeout, peer_failure=peer_failure)
                self.channels[(peer, kind)] = boundary.StructureChannel(channel, device) if kind == "act" else channel

    def close(self) -> None:
        # In the order they opened (a dict's), the same on every rank: closing an NCCL-backed channel waits for its
        # peer to close the same one (a set's order, which differs between processes, hung two H100s so).
        for channel in self.channels.values():
            channel.close()

    def abort(self, reason: str) -> None:
        """Closes every channel at once, telling each peer why; never raises (peers may be gone)."""
        for channel in self.channels.values():
            with contextlib.suppress(Exception):
                channel.abort(reason)

