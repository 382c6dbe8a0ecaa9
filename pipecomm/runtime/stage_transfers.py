"""A rank's transfers across its stage boundaries: activations as structures and gradients flat, on the channel to
the peer stage's rank, each failure named with the rank, stage, micro-batch and action."""

from __future__ import annotations

import contextlib
import os

import torch

from pipecomm.runtime import boundary
from pipecomm.schedules.schedule import Schedule
from pipecomm.transport.channel import Channel, ChannelError

__all__: list[str] = []


class StageTransfers:
    """The sends and receives of one rank's stages. A gradient is received with a layout key, the tensors its stage
    sent for that micro-batch: a CUDA IPC channel may then return before the peer's host gets there, and
    ``settle_gradients`` checks those before the step's gradients are used."""

    def __init__(self, rank: int, schedule: Schedule,
                 channels: dict[tuple[int, str], boundary.StructureChannel | Channel]):
        self.rank = rank
        self.placement = schedule.placement  # a schedule switch keeps it
        self.channels = channels
        # Read as the channels read it (csrc/transport/ipc_channel.cpp): without it, no key is computed on the send
        # path and nothing is settled at the step's end.
        self.run_ahead = os.environ.get("PIPECOMM_RUN_AHEAD") == "1"
        self._gradient_layouts: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> its gradient's layout key

    def start(self, training: bool) -> None:
        self._gradient_layouts = {}
        self._training = training

    def send_activation(self, stage: int, micro_batch: int, outputs: boundary.Flat, micro_batches: int,
                        batch_size: int | None = None) -> None:
        with self._naming(stage, micro_batch, "send", "activation", stage + 1):
            self._channel(stage + 1, "act").send(outputs, micro_batches, batch_size, training=self._training)
        if not self.run_ahead:
            return
        # The gradient that comes back has an entry per tensor sent, of its shape and dtype where it required grad:
        # the same tensors sent, the same gradient layout (but for gradients that autograd leaves None, which the
        # channel's check of a layout received ahead then reports).
        self._gradient_layouts[(stage, micro_batch)] = hash(
            (stage, tuple((tensor.shape, tensor.dtype, tensor.requires_grad) for tensor in outputs.tensors)))

    def recv_activation(self, stage: int, micro_batch: int) -> boundary.Received:
        with self._naming(stage, micro_batch, "recv", "activation", stage - 1):
            received = self._channel(stage - 1, "act").recv()
            if received.training != self._training:
                # Ranks whose calls differ (a forward on one rank alone, to evaluate) would go on out of step, each
                # reading what another call sent: refused at the first activation that crosses.
                calls = ("step", "forward") if self._training else ("forward", "step")
                raise ValueError(f"this rank is in {calls[0]} but stage {stage - 1} sent the activation of a "
                                 f"{calls[1]}: every rank of the pipeline must make the same Pipeline calls in the "
                                 "same order (step, forward, clip_grad_norm_, trace)")
            return received

    def send_gradient(self, stage: int, micro_batch: int, grads) -> None:
        with self._naming(stage, micro_batch, "send", "gradient", stage - 1):
            self._channel(stage - 1, "grad").send(grads)

    def send_read_event(self, stage: int, kind: str) -> torch.cuda.Event | None:
        """``Channel.send_read_event`` of the last send of ``stage``'s ``kind`` ("act" or "grad")."""
        return self._channel(stage + 1 if kind == "act" else stage - 1, kind).send_read_event()

    def recv_gradient(self, stage: int, micro_batch: int) -> tuple:
        key = self._gradient_layouts.pop((stage, micro_batch), None)
        with self._naming(stage, micro_batch, "recv", "gradient", stage + 1):
            channel = self._channel(stage + 1, "grad")
            return channel.recv() if key is None else channel.recv(layout_key=key)

    def settle_gradients(self) -> None:
        """Before the step's gradients are used: every gradient received ahead of its note checked against it."""
        if not self.run_ahead:
            return
        for (peer, kind), channel in self.channels.items():
            if kind == "grad":
                try:
                    channel.settle()
                except (ChannelError, TimeoutError) as error:
                    raise type(error)(f"pipeline rank {self.rank}, at the step's end, checking the gradients received "
                                      f"from rank {peer}: {error}") from error

    def _channel(self, peer_stage: int, kind: str):
        return self.channels[(self.placement[peer_stage], kind)]

    @contextlib.contextmanager
    def _naming(self, stage: int, micro_batch: int, direction: str, what: str, peer_stage: int):
        """Channel errors and timeouts inside get the rank, stage, micro-batch and action in front of their message."""
        try:
            yield
        except (ChannelError, TimeoutError) as error:
            action = f"{direction} of the {what} {'to' if direction == 'send' else 'from'} stage {peer_stage}"
            raise type(error)(f"pipeline rank {self.rank}, stage {stage}, micro-batch {micro_batch}, {action}: "
                              f"{error}") from error
