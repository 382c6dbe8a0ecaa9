"""The stage-boundary encoding: any structure round-trips through a channel of flat tensor tuples, its header sent only when it changes."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from pipecomm.runtime import boundary

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
    """A channel that hands back, in order, copies of what was sent, and keeps the messages."""

    carries_notes = False

    def __init__(self):
        self.sent: list[tuple] = []
        self._queue: collections.deque = collections.deque()

    def send(self, tensors) -> None:
        self.sent.append(tuple(tensors))
        self._queue.append(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors))

    def recv(self) -> tuple:
        return self._queue.popleft()

    def close(self) -> None:
        self._queue.clear()


class NoteRecording(Recording):
    """The same, with notes on the host beside the messages, as the dist channel carries them."""

    carries_notes = True

    def __init__(self):
        super().__init__()
        self.notes: list[bytes] = []
        self._unread_notes: collections.deque = collections.deque()

    def send_note(self, data: bytes) -> None:
        self.notes.append(data)
        self._unread_notes.append(data)

    def recv_note(self) -> bytes:
        return self._unread_notes.popleft()


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


@pytest.mark.parametrize("raw", [Recording(), NoteRecording()], ids=["in-the-message", "as-a-note"])
def test_the_header_is_sent_only_when_it_changes(raw):
    channel = boundary.StructureChannel(raw, torch.device("cpu"))
    x, y, w = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)
    messages = [
        ((x, 1), 4),  # the first message carries its header
        ((y, 1), 4),  # other values, same layout: no header
        ((x, 2), 4),  # a constant changed
        ((x, 2), 4),
        ((x, 2.0), 4),  # equal, but another type
        ((x, True), 4),
        ((w, True), 4),  # requires_grad changed
        ((x, True), 2),  # the micro-batch count changed
        ([x, True], 2),  # the structure changed
        ([x.to(torch.float64), True], 2),  # a dtype or shape is the channel's business, not the header's
    ]
    for structure, micro_batches in messages:
        channel.send(boundary.flatten(structure), micro_batches)
        received = channel.recv()
        assert received.micro_batches == micro_batches
        assert type(received.structure) is type(structure)
        assert received.structure[1] == structure[1] and type(received.structure[1]) is type(structure[1])
        assert received.tensors[0].requires_grad == structure[0].requires_grad
    assert [message[0] is not None for message in raw.sent] == [True, False, True, False, True, True, True, True,
                                                                 True, False]
    assert all(message[0] is None or message[0].dtype == torch.uint8 for message in raw.sent)
    if raw.carries_notes:  # the header went as a note; the message only says that one came
        assert len(raw.notes) == 7 and all(message[0] is None or message[0].numel() == 0 for message in raw.sent)


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
