"""The collectives of a pipeline's ranks: the loss and the inference result broadcast from the last stage, the
all-reduces of the gradient norm and the measured costs, each bounded by the fail-fast protocol; the trace's gather.

On CPU the broadcasts take the channels the step already uses (``LinkTree``) instead of a gloo collective: a 0-d
loss then costs one shared-memory message per rank, which the last stage sends as soon as its step is done and its
neighbour finds waiting at the end of its own (a gloo broadcast costs every rank a rendezvous, a hand-off to gloo's
thread and back, and the wait for the slowest rank). A peer that fails aborts those channels, so a rank waiting in
the broadcast raises at once with the cause, as in any receive of the step.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pipecomm.runtime import boundary
from pipecomm.runtime.fail_fast import CallProtocol
from pipecomm.runtime.failure import Collective
from pipecomm.parallel.backend import uses_nccl
from pipecomm.parallel.mesh import global_rank
from pipecomm.schedules.schedule import Schedule
from pipecomm.transport.channel import ChannelError
from pipecomm.transport.lifetime import keep_forever

__all__: list[str] = []


def broadcast_parents(schedule: Schedule, root: int) -> dict[int, int | None]:
    """Every pipeline rank's parent in a breadth-first tree from ``root`` over the links between the ranks of
    neighbouring stages (None for ``root``); the same on every rank, and reaching every rank, since consecutive
    stages' ranks are linked and every rank holds a stage."""
    neighbours: dict[int, set[int]] = {rank: set() for rank in range(schedule.num_ranks)}
    for stage in range(schedule.num_stages - 1):
        lower, upper = schedule.stage_rank(stage), schedule.stage_rank(stage + 1)
        if lower != upper:
            neighbours[lower].add(upper)
            neighbours[upper].add(lower)
    parents: dict[int, int | None] = {root: None}
    frontier = [root]
    while frontier:
        reached = []
        for rank in frontier:
            for peer in sorted(neighbours[rank]):
                if peer not in parents:
                    parents[peer] = rank
                    reached.append(peer)
        frontier = reached
    return parents


class LinkTree:
    """A broadcast from the last stage's rank over the links (``channels``, by (peer's pipeline rank, kind)): each rank
    receives from its parent in ``broadcast_parents``'s tree, then sends to its children. Every message of a step is
    received within the step, so the broadcast's message is the next one each receiving rank takes from its parent."""

    def __init__(self, schedule: Schedule, rank: int, root: int, channels: dict):
        parents = broadcast_parents(schedule, root)
        self.rank = rank
        self.parent = parents[rank]
        self.children = [peer for peer, parent in sorted(parents.items()) if parent == rank]
        self.channels = channels

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """``tensor`` in place from the root to every rank; channel errors name ``what`` and the peer."""
        if self.parent is not None:
            with _naming(what, f"receiving it from pipeline rank {self.parent}"):
                self.channels[(self.parent, "grad")].recv(out=[tensor])
        for child in self.children:
            with _naming(what, f"sending it to pipeline rank {child}"):
                self.channels[(child, "grad")].send([tensor])


@contextlib.contextmanager
def _naming(what: str, doing: str) -> Iterator[None]:
    """Channel errors and timeouts inside get the broadcast and the peer in front of their message."""
    try:
        yield
    except (ChannelError, TimeoutError) as error:
        raise type(error)(f"{what}, {doing}: {error}") from error


# What a loss may be, by its index on the wire.
_LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class PipelineCollectives:
    """Collectives over the pipeline group (None: the world) from pipeline rank ``rank``; ``last_rank`` holds the
    last stage. Tensors live on ``device`` on NCCL groups, on the CPU on gloo ones (``wire_device``). With ``links``
    (the channels to the neighbour stages' ranks, as ``NeighbourLinks`` keeps them, for ``schedule``'s placement)
    and stages on the CPU, the broadcasts go over them (``LinkTree``)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, last_rank: int, device: torch.device,
                 calls: CallProtocol, timeout: float, links: dict | None = None, schedule: Schedule | None = None):
        self.group = group
        self.rank = rank
        self.last_rank = last_rank
        self.device = device
        self.calls = calls
        self.timeout = timeout
        self._loss_wire: torch.Tensor | None = None
        self._loss_dtype: torch.dtype | None = None
        on_links = links is not None and schedule is not None and device.type == "cpu" and schedule.num_ranks > 1
        self._tree = LinkTree(schedule, rank, last_rank, links) if on_links else None

    def wire_device(self) -> torch.device:
        """Where collectives over the pipeline group need their tensors."""
        if dist.is_initialized() and uses_nccl(self.group):
            return self.device
        return torch.device("cpu")

    def broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss (None elsewhere) on every rank, on ``device``, in the loss's dtype. Its value travels
        as float64, which holds every floating value exactly (a float64 model's loss is not rounded), its dtype
        beside it. Reading the dtype back waits for the broadcast, which on a GPU would hold the host back every
        step: there, ranks learn it at the first step, and a loss whose dtype changes later is refused."""
        if self._loss_wire is None:  # one buffer for every step's broadcast: see transport.keep_forever
            self._loss_wire = torch.zeros(2, dtype=torch.float64, device=self.wire_device())
            keep_forever([self._loss_wire])
        if loss is not None:
            if self._loss_dtype is not None and loss.dtype != self._loss_dtype and self._loss_wire.is_cuda:
                raise TypeError(f"Pipeline rank {self.rank}: loss_fn returned a {loss.dtype} loss where the first "
                                f"step's was {self._loss_dtype}; the other ranks return the loss in the first "
                                "step's dtype (they do not wait for the GPU to learn it each step): keep the loss's "
                                "dtype (e.g. .float()) or build a new Pipeline")
            if loss.dtype not in _LOSS_DTYPES:
                raise TypeError(f"Pipeline rank {self.rank}: loss_fn returned a {loss.dtype} loss; a loss is one of "
                                f"{', '.join(str(dtype) for dtype in _LOSS_DTYPES)}")
            self._loss_wire[0].copy_(loss.detach())
            self._loss_wire[1].fill_(_LOSS_DTYPES.index(loss.dtype))
        self.broadcast(self._loss_wire, "the loss")
        if loss is not None:
            self._loss_dtype = loss.dtype
        elif self._loss_dtype is None or not self._loss_wire.is_cuda:
            self._loss_dtype = _LOSS_DTYPES[int(self._loss_wire[1])]
        return self._loss_wire[0].to(self.device, self._loss_dtype, copy=True)

    def check_built_alike(self, schedule: Schedule) -> None:
        """Raises where this rank's Pipeline was built for another schedule than the last stage's rank's (name, stages,
        placement, micro-batches or actions): such ranks would wait on messages the other never sends until the
        timeout, whose error blames a receive (measured, 2 CPU ranks, "1f1b" against "gpipe": a ChannelTimeoutError
        after the whole timeout)."""
        if schedule.num_ranks == 1:
            return
        mine = _built_for(schedule).encode()[:_BUILT_FOR_BYTES]
        wire = torch.zeros(_BUILT_FOR_BYTES, dtype=torch.uint8)
        if self.rank == self.last_rank:
            wire[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        theirs = self._broadcast_host(wire, self.wire_device(), "what the Pipeline was built for").numpy().tobytes()
        theirs = theirs.rstrip(b"\0")
        # Every rank learns whether any differs, and all raise together: a rank that went on would wait in the next
        # collective of the Pipeline's building for one that raised.
        differs = torch.tensor([int(theirs != mine)], dtype=torch.int64, device=self.wire_device())
        self.all_reduce(differs, dist.ReduceOp.MAX, "whether the Pipelines were built alike")
        if theirs != mine:
            raise ValueError(
                f"Pipeline on pipeline rank {self.rank} was built for {mine.decode()}, but the last stage's rank "
                f"(pipeline rank {self.last_rank}) for {theirs.decode(errors='replace')}: every rank must pass the "
                "same schedule, num_stages and micro_batches")
        if int(differs):
            raise ValueError(
                f"Pipeline on pipeline rank {self.rank} was built for {mine.decode()}, and another rank for something "
                "else (its own error says what): every rank must pass the same schedule, num_stages and "
                "micro_batches")

    def broadcast_result(self, result):
        """The last stage's inference output on every rank: the length and bytes of its host description
        (``boundary.encode``), then its tensors packed into one payload."""
        what = "the inference output"
        wire = self.wire_device()
        if self.rank == self.last_rank:
            description, payload = boundary.encode(result, self.device, what)
            self._broadcast_host(torch.tensor([len(description)]), wire, f"the size of {what}'s description")
            self._broadcast_host(torch.frombuffer(bytearray(description), dtype=torch.uint8), wire,
                                 f"{what}'s description")
            if payload is not None:
                self.broadcast(payload.to(wire), f"{what}'s tensors")
            return result
        size = self._broadcast_host(torch.zeros(1, dtype=torch.int64), wire, f"the size of {what}'s description")
        description = self._broadcast_host(torch.empty(int(size), dtype=torch.uint8), wire, f"{what}'s description")

        def receive_payload(payload_bytes: int) -> torch.Tensor:
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=wire)
            self.broadcast(payload, f"{what}'s tensors")
            return payload

        return boundary.decode(description.numpy().tobytes(), self.device, what, receive_payload)

    def gather_at_first_rank(self, value, num_ranks: int) -> list | None:
        """Every rank's picklable ``value``, in rank order, on pipeline rank 0 (None on the others)."""
        if num_ranks == 1:
            return [value]
        gathered = [None] * num_ranks if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=global_rank(self.group, 0), group=self.group)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, what: str) -> None:
        """In place, over the pipeline group."""
        self.wait(Collective.all_reduce(tensor, self.group, f"pipeline rank {self.rank}: {what}", self.timeout, op))

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """From the last stage's rank to every rank of the pipeline."""
        source = global_rank(self.group, self.last_rank)
        described = f"pipeline rank {self.rank}: the broadcast of {what} from the last stage (rank {source})"
        if self._tree is not None:
            self._tree.broadcast(tensor, described)
            return
        self.wait(Collective.broadcast(tensor, source, self.group, described, self.timeout))

    def wait(self, collective: Collective) -> None:
        """Waits for any collective of the Pipeline: at most its timeout, and not once another rank failed."""
        self.calls.wait(collective, self.timeout)

    def _broadcast_host(self, tensor: torch.Tensor, wire: torch.device, what: str) -> torch.Tensor:
        """A broadcast of host data, read back on the host."""
        tensor = tensor.to(wire)
        self.broadcast(tensor, what)
        return tensor.cpu()


_BUILT_FOR_BYTES = 512  # ``check_built_alike``'s message: a description, the actions' digest within it


def _built_for(schedule: Schedule) -> str:
    """What ranks must agree on, said, with a digest of every rank's actions (a Schedule built by hand, too)."""
    digest = hashlib.sha256(repr(schedule.actions).encode()).hexdigest()[:12]
    # The digest before the placement, which may be long: what does not fit the message is cut from its end.
    return (f"schedule {schedule.name!r} (actions {digest}, {schedule.num_stages} stages on {schedule.num_ranks} "
            f"ranks, {schedule.micro_batches} micro-batches, placement {list(schedule.placement)})")
