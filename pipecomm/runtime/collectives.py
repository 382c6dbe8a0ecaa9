"""The collectives of a pipeline's ranks: the loss and the inference result broadcast from the last stage, the
all-reduces of the gradient norm and the measured costs, each bounded by the fail-fast protocol; the trace's gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipecomm import _C
from pipecomm.runtime import boundary
from pipecomm.runtime.fail_fast import CallProtocol
from pipecomm.runtime.failure import Collective
from pipecomm.parallel.mesh import global_rank, uses_nccl
from pipecomm.transport.lifetime import keep_forever

__all__: list[str] = []


class PipelineCollectives:
    """Collectives over the pipeline group (None: the world) from pipeline rank ``rank``; ``last_rank`` holds the
    last stage. Tensors live on ``device`` on NCCL groups, on the CPU on gloo ones (``wire_device``)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, last_rank: int, device: torch.device,
                 calls: CallProtocol, timeout: float):
        self.group = group
        self.rank = rank
        self.last_rank = last_rank
        self.device = device
        self.calls = calls
        self.timeout = timeout
        self._loss_wire: torch.Tensor | None = None

    def wire_device(self) -> torch.device:
        """Where collectives over the pipeline group need their tensors."""
        if dist.is_initialized() and uses_nccl(self.group):
            return self.device
        return torch.device("cpu")

    def broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss (None elsewhere) on every rank, on ``device``."""
        if self._loss_wire is None:  # one buffer for every step's broadcast: see transport.keep_forever
            self._loss_wire = torch.zeros((), dtype=torch.float32, device=self.wire_device())
            keep_forever([self._loss_wire])
        if loss is None:
            self._loss_wire.zero_()
        else:
            self._loss_wire.copy_(loss)
        self.broadcast(self._loss_wire, "the loss")
        return self._loss_wire.to(self.device, copy=True)

    def broadcast_result(self, result):
        """The last stage's inference output on every rank, as three broadcasts: the channels' frame header (with the
        layout's length), the tensors' metadata with the output's layout, and the packed payload."""
        wire = self.wire_device()
        codec = _C.MessageCodec(str(self.device), "the inference output", "the inference output")
        last = self.rank == self.last_rank
        if last:
            flat = boundary.flatten(result)
            header, meta, payload = codec.encode(flat.tensors)
            layout = boundary.serialize(flat.layout, None, "the inference output")
            sizes = torch.cat([header, torch.tensor([len(layout)])])
            described = torch.cat([meta, torch.frombuffer(bytearray(layout), dtype=torch.uint8)])
        else:
            sizes = torch.zeros(_C.FRAME_HEADER_FIELDS + 1, dtype=torch.int64)
        sizes = self._broadcast_host(sizes, wire, "the inference output's header")
        _, meta_bytes, payload_bytes = codec.read_header(sizes[:-1])
        if not last:
            described = torch.empty(meta_bytes + int(sizes[-1]), dtype=torch.uint8)
        described = self._broadcast_host(described, wire, "the inference output's layout")
        if last:
            if payload_bytes:
                self.broadcast(payload.to(wire), "the inference output's tensors")
            return result
        tensors = codec.allocate(described[:meta_bytes], payload_bytes)
        if payload_bytes:
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=wire)
            self.broadcast(payload, "the inference output's tensors")
            codec.unpack_payload(payload)
        layout, _ = boundary.deserialize(described[meta_bytes:].numpy().tobytes())
        return boundary.unflatten(tensors, layout)

    def gather_at_first_rank(self, value, num_ranks: int) -> list | None:
        """Every rank's picklable ``value``, in rank order, on pipeline rank 0 (None on the others)."""
        if num_ranks == 1:
            return [value]
        gathered = [None] * num_ranks if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=global_rank(self.group, 0), group=self.group)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, what: str) -> None:
        """In place, over the pipeline group."""
        self.wait(Collective(lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), [tensor],
                             self.group, f"pipeline rank {self.rank}: {what}"))

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """From the last stage's rank to every rank of the pipeline."""
        source = global_rank(self.group, self.last_rank)
        self.wait(Collective(lambda: dist.broadcast(tensor, src=source, group=self.group, async_op=True), [tensor],
                             self.group, f"pipeline rank {self.rank}: the broadcast of {what} from the last stage "
                                         f"(rank {source})"))

    def wait(self, collective: Collective) -> None:
        """Waits for any collective of the Pipeline: at most its timeout, and not once another rank failed."""
        self.calls.wait(collective, self.timeout)

    def _broadcast_host(self, tensor: torch.Tensor, wire: torch.device, what: str) -> torch.Tensor:
        """A broadcast of host data, read back on the host."""
        tensor = tensor.to(wire)
        self.broadcast(tensor, what)
        return tensor.cpu()

