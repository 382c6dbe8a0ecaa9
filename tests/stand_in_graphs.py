"""CUDA graphs stood in for on a CPU: a capture runs its pass once, eagerly, undoing what it wrote into tensors that
existed before it (a capture records kernels and runs none), and a replay runs it again; so ``GraphedStage`` (its
captures, landing buffers, replay order, accumulators and check) runs whole where no GPU is. What it cannot show is a
graph's own semantics (fixed addresses, kernels without Python): those are the GPU twins'."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipecomm.runtime import cuda_graphs, graph_random


class StandInGraph:
    """A graph whose replay runs its captured pass again (or, with ``inert``, does nothing: a stale graph). A real
    replay writes where its capture's kernels wrote: a replay writing other tensors that existed before it, or not
    the same ones, is refused (a gradient added into a ``.grad`` other than the accumulator captured)."""

    inert = False
    replays = 0

    def __init__(self) -> None:
        self.run = None
        self.written: set[int] = set()  # the storages the capture's run wrote that existed before it

    def replay(self) -> None:
        StandInGraph.replays += 1
        if StandInGraph.inert:
            return
        writes = _Writes(keep=False)
        with writes:
            self.run()
        assert writes.written == self.written, (
            f"a replay wrote {len(writes.written - self.written)} tensors its capture did not, and not "
            f"{len(self.written - writes.written)} it did: a real graph writes where it was captured")


class _StandInStream:
    def wait_stream(self, other) -> None:
        pass


class _Writes(TorchDispatchMode):
    """The storages a run writes that existed before it; with ``keep``, a copy of each tensor so written, taken at
    its first write, which ``undo`` puts back."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.written: set[int] = set()
        self._made: set[int] = set()  # storages the run allocated
        self._saved: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in tree_leaves(value):
                storage = tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None
                if storage is None or storage in self._made:
                    continue
                self.written.add(storage)
                key = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
                if self.keep and key not in self._saved:
                    self._saved[key] = (tensor, tensor.clone())
        result = func(*args, **kwargs)
        if all(returned.alias_info is None for returned in schema.returns):  # a new allocation, not a view
            for tensor in tree_leaves(result):
                if isinstance(tensor, torch.Tensor):
                    self._made.add(tensor.untyped_storage().data_ptr())
        return result

    def undo(self) -> None:
        with torch.no_grad():
            for tensor, value in reversed(list(self._saved.values())):
                tensor.copy_(value)


def _capture_into(graph: StandInGraph, run, pool, stream, empty_ok: bool = False) -> None:
    """A capture records kernels and runs none: the run's writes into what existed before it are undone."""
    graph.run = run
    writes = _Writes(keep=True)
    with writes:
        run()
    writes.undo()
    graph.written = writes.written


def stand_in_graphs(monkeypatch, inert: bool = False) -> None:
    """Streams, the random state and graph captures stood in for, until the test ends."""
    cuda = torch.cuda
    for name, value in [("Stream", lambda device=None: _StandInStream()),
                        ("current_stream", lambda device=None: _StandInStream()),
                        ("stream", lambda stream: contextlib.nullcontext()),
                        ("set_stream", lambda stream: None),
                        ("get_rng_state", lambda device=None: torch.get_rng_state()),
                        ("set_rng_state", lambda state, device=None: None),
                        ("graph_pool_handle", lambda: None),
                        ("CUDAGraph", StandInGraph)]:
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    monkeypatch.setattr(cuda_graphs, "capture_into", _capture_into)
    monkeypatch.setattr(cuda_graphs, "_release_random_state", lambda device, state: None)
    monkeypatch.setattr(graph_random, "_capture_offset", lambda device: 0)  # a CPU run draws from no CUDA generator
    monkeypatch.setattr(StandInGraph, "replays", 0)
    monkeypatch.setattr(StandInGraph, "inert", inert)
