"""The stage-boundary encoding: any structure round-trips through a channel of flat tensor tuples, its header sent only when it changes."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from ranks import needs_cuda, rank_device, run_ranks

import pipecomm.transport as transport
from pipecomm.runtime import boundary
from pipecomm.transport.loopback import LoopbackChannel

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Sample:
    """Not a registered pytree node: taken apart by its init fields."""

    tokens: torch.Tensor
    length: int
    extra: dict = dataclasses.field(default_factory=dict)
    doubled: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.doubled = 2 * self.length


class Recording:
    """A channel that hands back, in order, copies of what was sent and the notes sent with it, and keeps them."""

    def __init__(self):
        self.sent: list[tuple] = []
        self.notes: list[bytes] = []
        self._queue: collections.deque = collections.deque()
        self._unread_notes: collections.deque = collections.deque()

    def send(self, tensors) -> None:
        self.sent.append(tuple(tensors))
        self._queue.append(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors))

    def recv(self) -> tuple:
        return self._queue.popleft()

    def send_note(self, data: bytes) -> None:
        self.notes.append(data)
        self._unread_notes.append(data)

    def recv_note(self) -> bytes:
        return self._unread_notes.popleft()

    def close(self) -> None:
        self._queue.clear()


def nested():
    from transformers.modeling_outputs import BaseModelOutput

    hidden = torch.randn(2, 3, requires_grad=True) * 1  # a non-leaf that requires grad, as a stage output is
    return {
        "tuple": (hidden, None, 3, "text"),
        "list": [torch.arange(4), torch.float16, torch.Size([2, 3]), 1.5, True],
        "point": Point(torch.ones(2, dtype=torch.bool), 7),
        "sample": Sample(torch.randint(0, 9, (2, 4)), 5, {"mask": torch.zeros(2, 4)}),
        "output": BaseModelOutput(last_hidden_state=hidden * 2, hidden_states=(torch.randn(2),)),
        "scalar": torch.tensor(0.5),
    }


def test_nested_structures_round_trip_with_their_types_constants_and_requires_grad():
    channel = boundary.StructureChannel(Recording(), torch.device("cpu"))
    structure = nested()
    flat = boundary.flatten(structure)
    channel.send(flat, micro_batches=4)
    received = channel.recv()

    assert received.micro_batches == 4
    again = boundary.flatten(received.structure)
    assert boundary.layout_mismatch(again.layout, flat.layout) is None
    assert [t.requires_grad for t in received.tensors] == [t.requires_grad for t in flat.tensors]
    assert sum(t.requires_grad for t in received.tensors) == 2  # the hidden state and its double
    assert all(t.is_leaf for t in received.tensors), "received tensors are leaves the receiver differentiates by"
    for got, sent in zip(again.tensors, flat.tensors):
        assert got.dtype == sent.dtype
        torch.testing.assert_close(got, sent.detach())
    output = received.structure
    assert type(output["point"]) is Point and type(output["sample"]) is Sample and output["sample"].doubled == 10
    assert type(output["output"]).__name__ == "BaseModelOutput" and output["output"].attentions is None
    assert output["list"][1:] == [torch.float16, torch.Size([2, 3]), 1.5, True]
    assert output["tuple"][1:] == (None, 3, "text")


def changing_structures(device: torch.device) -> list[tuple]:
    """(structure, micro-batch count, whether it needs a new header) per message, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 3, generator=generator).to(device) for _ in range(2))
    w = torch.randn(2, 3, generator=generator).to(device).requires_grad_()
    return [
        ((x, 1), 4, True),  # the first message carries its header
        ((y, 1), 4, False),  # other values, same layout: no header
        ((x, 2), 4, True),  # a constant changed
        ((x, 2), 4, False),
        ((x, 2.0), 4, True),  # equal, but another type
        ((x, True), 4, True),
        ((w, True), 4, True),  # requires_grad changed
        ((x, True), 2, True),  # the micro-batch count changed
        ([x, True], 2, True),  # the structure changed
        ([x.to(torch.float64), True], 2, False),  # a dtype or shape is the channel's business, not the header's
        ([x, "a" * 200_000], 2, True),  # a header far larger than a channel's slots
        ([y, "a" * 200_000], 2, False),
    ]


def check_received(received: boundary.Received, structure, micro_batches: int) -> None:
    assert received.micro_batches == micro_batches
    assert type(received.structure) is type(structure)
    assert received.structure[1] == structure[1] and type(received.structure[1]) is type(structure[1])
    assert torch.equal(received.tensors[0].detach(), structure[0].detach())
    assert received.tensors[0].requires_grad == structure[0].requires_grad


def test_the_header_is_sent_only_when_it_changes_as_a_note():
    raw = Recording()
    channel = boundary.StructureChannel(raw, torch.device("cpu"))
    messages = changing_structures(torch.device("cpu"))
    for structure, micro_batches, _ in messages:
        channel.send(boundary.flatten(structure), micro_batches)
        check_received(channel.recv(), structure, micro_batches)
    # The header goes on the host; the message's first entry only says whether one came.
    assert [message[0] is not None for message in raw.sent] == [changes for _, _, changes in messages]
    assert all(message[0] is None or message[0].numel() == 0 for message in raw.sent)
    assert len(raw.notes) == sum(changes for _, _, changes in messages)


def structures_cross(rank: int, world_size: int, backend: str, kind: str) -> int:
    device = rank_device(rank, kind)
    with transport.connect(1 - rank, backend=backend, device=device, timeout=30, slot_bytes=4096) as raw:
        channel = boundary.StructureChannel(raw, device)
        for structure, micro_batches, _ in changing_structures(device):
            if rank == 0:
                channel.send(boundary.flatten(structure), micro_batches)
            else:
                check_received(channel.recv(), structure, micro_batches)
    return rank


@pytest.mark.parametrize(("backend", "kind"), [
    pytest.param("shm", "cpu", id="shm-cpu"),
    pytest.param("dist", "cpu", id="dist-cpu"),
    pytest.param("ipc", "cuda", id="ipc-cuda", marks=needs_cuda),
])
def test_changed_headers_cross_every_backend(tmp_path, backend, kind):
    assert run_ranks(2, structures_cross, tmp_path, backend, kind) == [0, 1]


def test_changed_headers_cross_a_loopback_channel():
    channel = boundary.StructureChannel(LoopbackChannel(0, torch.device("cpu"), timeout=1), torch.device("cpu"))
    for structure, micro_batches, _ in changing_structures(torch.device("cpu")):
        channel.send(boundary.flatten(structure), micro_batches)
        check_received(channel.recv(), structure, micro_batches)


def test_encode_and_decode_rebuild_a_structure_from_its_description_and_payload():
    cpu = torch.device("cpu")
    asked = []

    def receive_payload(payload_bytes: int) -> torch.Tensor:
        asked.append(payload_bytes)
        return payload.clone()

    structure = nested()
    description, payload = boundary.encode(structure, cpu, "a test structure")
    decoded = boundary.decode(description, cpu, "a test structure", receive_payload)
    assert asked == [payload.numel()]
    flat, again = boundary.flatten(structure), boundary.flatten(decoded)
    assert boundary.layout_mismatch(again.layout, flat.layout) is None
    for got, sent in zip(again.tensors, flat.tensors, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent.detach())
    # No tensor bytes: no payload, and none asked for.
    description, payload = boundary.encode((None, 3, torch.empty(0, 2)), cpu, "a test structure")
    decoded = boundary.decode(description, cpu, "a test structure", receive_payload)
    assert payload is None and len(asked) == 1
    assert decoded[:2] == (None, 3) and decoded[2].shape == (0, 2)


def test_what_cannot_be_pickled_is_a_type_error_naming_it():
    @dataclasses.dataclass
    class Local:
        value: torch.Tensor

    channel = boundary.StructureChannel(Recording(), torch.device("cpu"))
    with pytest.raises(TypeError, match="its .*Local node cannot be pickled"):
        channel.send(boundary.flatten((Local(torch.ones(1)),)), 1)
    with pytest.raises(TypeError, match="non-tensor leaf 1, <function .*lambda.* cannot be pickled"):
        channel.send(boundary.flatten((torch.ones(1), lambda: 0)), 1)
    pytree._deregister_pytree_node(Local)


def test_a_message_before_any_header_is_an_error():
    raw = Recording()
    raw.send((None, torch.ones(1)))
    with pytest.raises(RuntimeError, match="without its header"):
        boundary.StructureChannel(raw, torch.device("cpu")).recv()


def test_a_tuple_is_unpacked_into_arguments_and_anything_else_is_the_one():
    x = torch.ones(1)
    assert boundary.as_arguments((x, 1)) == (x, 1)
    assert boundary.as_arguments(x) == (x,)
    structure = {"x": x}
    assert boundary.as_arguments(structure)[0] is structure
