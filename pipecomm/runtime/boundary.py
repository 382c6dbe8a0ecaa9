"""How a structure crosses ranks: its tensors as one message or payload, the rest pickled on the host."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from pipecomm import _C
from pipecomm.parallel.mesh import named_mesh

__all__: list[str] = []


class _Tensor:
    """Marks where a tensor leaf goes among a structure's leaves (a class, so that it survives pickling as itself)."""


class _DTensorLeaf(NamedTuple):
    """Marks where a DTensor goes: it crosses as its local shard and is rebuilt with these on the receiving rank's
    mesh of the same dimension names (``pipecomm.init``'s)."""

    mesh_dim_names: tuple[str, ...]
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


class Layout(NamedTuple):
    """Everything of a structure but its tensors: the pytree spec and every leaf, ``_Tensor`` where a tensor goes."""

    spec: pytree.TreeSpec
    leaves: tuple


class Flat(NamedTuple):
    """A structure taken apart: its tensor leaves, in order, and the rest."""

    tensors: list[torch.Tensor]
    layout: Layout


def detached_copy(flat: Flat, keep_requires_grad: bool = False) -> Flat:
    """``flat`` with copies of its tensors, without their autograd history (leaves requiring grad where the tensors
    do, with ``keep_requires_grad``)."""
    return flat._replace(tensors=[tensor.detach().clone().requires_grad_(keep_requires_grad and tensor.requires_grad)
                                  for tensor in flat.tensors])


def flatten(structure: Any) -> Flat:
    """Takes any pytree apart (tuples, lists, dicts, None, dataclasses, transformers ModelOutputs, ...).

    A dataclass that is no pytree node is registered as one (``register_dataclass``, by its init
    fields) on first use, so that its tensors cross as tensors; its module must be importable by
    the receiving rank.
    """
    leaves, spec = pytree.tree_flatten(structure, is_leaf=_is_size)
    unregistered = {type(leaf) for leaf in leaves if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)}
    if unregistered:
        for cls in unregistered:
            pytree.register_dataclass(cls)
        return flatten(structure)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    marked = tuple(_Tensor if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    return Flat(tensors, Layout(spec, marked))


def stage_output(structure: Any) -> Flat:
    """A stage's output taken apart for the next stage: as ``flatten``, with each DTensor (a tensor-parallel layer's
    output kept as one) replaced by its local shard, differentiably, so that the shard is what is sent and what the
    returning gradient is for."""
    flat = flatten(structure)
    if not any(isinstance(tensor, DTensor) for tensor in flat.tensors):
        return flat
    tensors, leaves, remaining = [], [], iter(flat.tensors)
    for leaf in flat.layout.leaves:
        if leaf is _Tensor:
            tensor = next(remaining)
            if isinstance(tensor, DTensor):
                names = tensor.device_mesh.mesh_dim_names
                if names is None:
                    raise TypeError("a stage's output holds a DTensor on a mesh without dimension names: the next "
                                    "stage rebuilds it on its own mesh of the same names (pipecomm.init's)")
                leaf = _DTensorLeaf(tuple(names), tuple(tensor.placements), tensor.shape, tensor.stride())
                tensor = tensor.to_local()
            tensors.append(tensor)
        leaves.append(leaf)
    return Flat(tensors, Layout(flat.layout.spec, tuple(leaves)))


def _is_size(value: Any) -> bool:
    # A leaf here: torch registers torch.Size as a pytree node that unflattens into a plain tuple.
    return isinstance(value, torch.Size)


def unflatten(tensors: Sequence[torch.Tensor], layout: Layout) -> Any:
    remaining = iter(tensors)
    leaves = [next(remaining) if leaf is _Tensor else _rebuild(next(remaining), leaf) if isinstance(leaf, _DTensorLeaf)
              else leaf for leaf in layout.leaves]
    return pytree.tree_unflatten(leaves, layout.spec)


def _rebuild(local: torch.Tensor, leaf: _DTensorLeaf) -> DTensor:
    return DTensor.from_local(local, named_mesh(leaf.mesh_dim_names), leaf.placements, run_check=False,
                              shape=leaf.shape, stride=leaf.stride)


def as_arguments(structure: Any) -> tuple:
    """How a structure calls the next stage: a tuple is unpacked into positional arguments, anything else is the one."""
    return structure if isinstance(structure, tuple) else (structure,)


def layout_mismatch(layout: Layout, other: Layout) -> str | None:
    """What differs between two layouts, or None. Leaves compare with their types (True is not 1 here)."""
    if layout.spec != other.spec:
        return f"the structure {layout.spec} differs from {other.spec}"
    for index, (leaf, other_leaf) in enumerate(zip(layout.leaves, other.leaves)):
        if not (leaf is other_leaf or (type(leaf) is type(other_leaf) and (leaf == other_leaf) is True)):
            return f"leaf {index} is {_describe_leaf(leaf)}, not {_describe_leaf(other_leaf)}"
    return None


def serialize(layout: Layout, extra: Any, what: str) -> bytes:
    """A layout (and ``extra``, plain values) as bytes; a TypeError naming the part that cannot be pickled."""
    try:
        return pickle.dumps((_plain_spec(layout.spec), layout.leaves, extra))
    except Exception as error:
        raise TypeError(f"{what} cannot cross a stage boundary: {_unpicklable_part(layout)} cannot be pickled "
                        f"({type(error).__name__}: {error})") from error


def deserialize(data: bytes) -> tuple[Layout, Any]:
    plain_spec, leaves, extra = pickle.loads(data)
    spec = _spec(plain_spec)
    _register_dataclasses(spec)
    return Layout(spec, leaves), extra


class Encoded(NamedTuple):
    description: bytes  # for the host: the layout and the tensors' metadata
    payload: torch.Tensor | None  # the tensors' bytes packed on the device; None when they hold none


def encode(structure: Any, device: torch.device, what: str) -> Encoded:
    """A structure taken apart for a broadcast, by the channels' codec (``_C.MessageCodec``): ``decode`` rebuilds it."""
    flat = flatten(structure)
    _, meta, payload = _C.MessageCodec(str(device), what, what).encode(flat.tensors)
    payload_bytes = 0 if payload is None else payload.numel()
    return Encoded(serialize(flat.layout, (meta.numpy().tobytes(), payload_bytes), what), payload)


def decode(description: bytes, device: torch.device, what: str,
           receive_payload: Callable[[int], torch.Tensor]) -> Any:
    """The structure ``encode`` took apart, on ``device``; ``receive_payload(size)`` returns its payload, and is called
    only for a payload of some bytes."""
    layout, (meta, payload_bytes) = deserialize(description)
    codec = _C.MessageCodec(str(device), what, what)
    tensors = codec.allocate(torch.frombuffer(bytearray(meta), dtype=torch.uint8), payload_bytes)
    if payload_bytes:
        codec.unpack_payload(receive_payload(payload_bytes))
    return unflatten(tensors, layout)


class _Header(NamedTuple):
    layout: Layout
    requires_grad: tuple[bool, ...]
    micro_batches: int
    batch_size: int | None
    training: bool


class Received(NamedTuple):
    structure: Any
    tensors: list[torch.Tensor]  # the message's tensors, in order: the ones a gradient message answers
    micro_batches: int  # how many micro-batches the first stage split the batch into
    batch_size: int | None  # the whole batch's size on the first stage (None: not said)
    training: bool  # sent by a step (not an inference)


class StructureChannel:
    """Sends a structure as ``(marker, *tensors)`` over a channel of flat tensor tuples.

    The header (the layout, each tensor's ``requires_grad``, the micro-batch count and the batch size)
    is pickled only when it differs from the last one sent, and goes as a note on the host with the
    message (``Channel.send_note``), so that neither end copies it to or from the GPU; the marker, an
    empty tensor, says that one came (the receiver cannot tell otherwise over torch.distributed).
    Otherwise the marker is None, so a steady-state message costs one None entry and no pickling.
    Received tensors that required grad on the sender become leaves that require grad; only for those
    does the receiver compute gradients.
    """

    def __init__(self, channel, device: torch.device):
        self.channel = channel
        self.device = device
        self._sent: _Header | None = None
        self._received: _Header | None = None

    def send(self, flat: Flat, micro_batches: int, batch_size: int | None = None, training: bool = True) -> None:
        """``batch_size`` (the whole batch's, as the first stage got it) lets the last stage check its targets;
        ``training`` (a step's, not an inference's) lets the next stage check that it makes the same call."""
        header = _Header(flat.layout, tuple(tensor.requires_grad for tensor in flat.tensors), micro_batches, batch_size,
                         training)
        marker = None
        if not _same_header(header, self._sent):
            self.channel.send_note(serialize(header.layout, (header.requires_grad, micro_batches, batch_size, training),
                                             "a stage's output"))
            marker = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._sent = header
        self.channel.send((marker, *(tensor.detach() for tensor in flat.tensors)))

    def send_read_event(self) -> torch.cuda.Event | None:
        """``Channel.send_read_event`` of the last structure sent."""
        return self.channel.send_read_event()

    def recv(self) -> Received:
        marker, *tensors = self.channel.recv()
        if marker is not None:
            layout, (requires_grad, micro_batches, batch_size, training) = deserialize(self.channel.recv_note())
            self._received = _Header(layout, requires_grad, micro_batches, batch_size, training)
        header = self._received
        if header is None:
            raise RuntimeError("pipecomm: the first message on a stage boundary came without its header")
        for tensor, requires_grad in zip(tensors, header.requires_grad):
            if requires_grad:
                tensor.requires_grad_()
        return Received(unflatten(tensors, header.layout), tensors, header.micro_batches, header.batch_size,
                        header.training)

    def close(self) -> None:
        self.channel.close()

    def abort(self, reason: str) -> None:
        self.channel.abort(reason)


def _same_header(header: _Header, last: _Header | None) -> bool:
    return (last is not None and header.requires_grad == last.requires_grad
            and header.micro_batches == last.micro_batches and header.batch_size == last.batch_size
            and header.training == last.training
            and layout_mismatch(header.layout, last.layout) is None)


def _describe_leaf(leaf: Any) -> str:
    return "a tensor" if leaf is _Tensor else f"{leaf!r} ({type(leaf).__qualname__})"


# TreeSpecs travel as nested (type, context, children) tuples: unpickling a TreeSpec itself warns.
def _plain_spec(spec: pytree.TreeSpec):
    return None if spec.is_leaf() else (spec.type, spec.context, [_plain_spec(child) for child in spec.children()])


def _spec(plain) -> pytree.TreeSpec:
    if plain is None:
        return pytree.treespec_leaf()
    node_type, context, children = plain
    return pytree.TreeSpec(node_type, context, [_spec(child) for child in children])


def _register_dataclasses(spec: pytree.TreeSpec) -> None:
    """Registers the dataclasses the sender registered on first use, so that this rank can rebuild them."""
    if spec.is_leaf():
        return
    if spec.type not in pytree.SUPPORTED_NODES and dataclasses.is_dataclass(spec.type):
        pytree.register_dataclass(spec.type)
    for child in spec.children():
        _register_dataclasses(child)


def _unpicklable_part(layout: Layout) -> str:
    for index, leaf in enumerate(layout.leaves):
        if not _picklable(leaf):
            return f"non-tensor leaf {index}, {_describe_leaf(leaf)},"
    nodes = [layout.spec]
    while nodes:
        node = nodes.pop()
        if not node.is_leaf():
            if not _picklable((node.type, node.context)):
                return f"its {getattr(node.type, '__qualname__', node.type)} node"
            nodes.extend(node.children())
    return "its structure"


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
