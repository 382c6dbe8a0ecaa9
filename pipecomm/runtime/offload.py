"""Activation offload at run time: the planned waits' tensors copied to host memory when the pass that saved them
ends, and back before the pass that reads them, on side streams the compute stream never waits for until then.

A forward's saved activations are caught by saved-tensor hooks (as ``torch.autograd.graph.save_on_cpu`` does, but
only for the planned micro-batches, with the copies asynchronous); the W pass's inputs are the tensors of its
deferred gradients. Parameters and buffers (and views of them) stay where they are: they live on the device anyway.
A tensor the backward reads before its copy back was started is copied back then, on the spot: a plan that timed
the passes wrongly costs a wait, never a wrong result. On the CPU the copies are host-to-host clones, which
exercises the same bookkeeping.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm.schedules.offload import Wait

__all__: list[str] = []

# Smaller tensors stay on the device: a copy each costs more launch time than their memory is worth.
_MIN_CUDA_BYTES = 1 << 16


class _Parked:
    """One tensor of a wait: on the device until its copy out, then in host memory until its copy back."""

    __slots__ = ("device_tensor", "host_tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.device_tensor: torch.Tensor | None = tensor
        self.host_tensor: torch.Tensor | None = None
        self.version = tensor._version  # as saved: autograd's own check of later in-place changes, which hooks skip

    def check_unchanged(self) -> None:
        if self.device_tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                f"after the forward saved it (a tensor of shape {list(self.device_tensor.shape)}, version "
                f"{self.device_tensor._version} instead of {self.version}); with offload the copy would carry the "
                "changed values into the backward, so it is refused, as autograd refuses it without offload")


class _WaitCopies:
    """A wait's parked tensors and the events that order their copies."""

    def __init__(self, wait: Wait):
        self.wait = wait
        self.parked: list[_Parked] = []
        self.by_id: dict[int, _Parked] = {}  # a tensor saved twice is parked once
        self.copied_out: torch.cuda.Event | None = None
        self.copied_back: torch.cuda.Event | None = None
        self.offloaded = False


class ActivationOffloader:
    """One rank's offload: which waits go to host memory (``offloaded``), their tensors while they do, and the copies.

    ``saving(wait)`` around a forward parks its saved activations; ``offload(wait)`` after it starts their copies out;
    ``park(wait, tensors)`` and ``unpark(wait)`` do the same for the W pass's inputs; ``reload(wait)`` starts the
    copies back. Holds nothing between steps.
    """

    def __init__(self, device: torch.device, offloaded: Iterable[Wait], modules: Iterable[nn.Module], *,
                 measure_only: bool = False):
        """``modules``: the stages, whose parameters and buffers stay on the device. ``measure_only``: the waits'
        tensors are parked and counted (``parked_bytes``) but never copied."""
        self.device = device
        self.offloaded = frozenset(offloaded)
        self.measure_only = measure_only
        self.parked_bytes: dict[Wait, int] = {}
        self._resident_storages = _storage_pointers(modules)
        self._waits: dict[Wait, _WaitCopies] = {}
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._to_host = torch.cuda.Stream(device)
            self._to_device = torch.cuda.Stream(device)

    def start(self) -> None:
        """A new step: nothing parked."""
        self._waits = {}

    def saving(self, wait: Wait):
        """The context of a forward whose saved activations may wait in host memory (a no-op for other waits)."""
        if wait not in self.offloaded:
            return _NO_HOOKS
        copies = self._waits[wait] = _WaitCopies(wait)
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self._pack(copies, tensor), self._unpack)

    def offload(self, wait: Wait) -> None:
        """Starts the copies out of ``wait``'s parked tensors (the pass that saved them was just issued)."""
        copies = self._waits.get(wait)
        if copies is None or copies.offloaded:
            return
        for parked in copies.parked:
            parked.check_unchanged()
        if self.measure_only:
            self.parked_bytes[wait] = sum(parked.device_tensor.nbytes for parked in copies.parked)
            return
        copies.offloaded = True
        if not self._cuda:
            for parked in copies.parked:
                parked.host_tensor, parked.device_tensor = parked.device_tensor.clone(), None
            return
        compute = torch.cuda.current_stream(self.device)
        self._to_host.wait_stream(compute)
        with torch.cuda.stream(self._to_host):
            for parked in copies.parked:
                tensor = parked.device_tensor
                parked.host_tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                parked.host_tensor.copy_(tensor, non_blocking=True)
                # Its memory goes back to the allocator when the copy is done, not before.
                tensor.record_stream(self._to_host)
                parked.device_tensor = None
            copies.copied_out = torch.cuda.Event()
            copies.copied_out.record(self._to_host)

    def holding(self, wait: Wait) -> set[int]:
        """The ids of the tensors of ``wait`` held as they were saved, whose data the backward reads through this
        offloader (all of them while measuring; none once copied out): whoever else frees data must leave them."""
        copies = self._waits.get(wait)
        return {id(parked.device_tensor) for parked in copies.parked} if copies and not copies.offloaded else set()

    def reload(self, wait: Wait) -> None:
        """Starts the copies back of ``wait``'s tensors, ahead of the pass that reads them."""
        copies = self._waits.get(wait)
        if copies is None or not copies.offloaded or copies.copied_back is not None:
            return
        if not self._cuda:
            for parked in copies.parked:
                parked.device_tensor, parked.host_tensor = parked.host_tensor, None
            copies.copied_back = _DONE
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._to_device):
            self._to_device.wait_event(copies.copied_out)
            for parked in copies.parked:
                tensor = torch.empty(parked.host_tensor.shape, dtype=parked.host_tensor.dtype, device=self.device)
                tensor.copy_(parked.host_tensor, non_blocking=True)
                # Allocated on the side stream, read on the compute stream.
                tensor.record_stream(compute)
                parked.device_tensor = tensor
            copies.copied_back = torch.cuda.Event()
            copies.copied_back.record(self._to_device)

    def park(self, wait: Wait, tensors: Sequence[torch.Tensor]) -> list:
        """``tensors`` (the W pass's inputs) parked for ``wait``, their copies out started: what ``unpark`` takes."""
        copies = self._waits[wait] = _WaitCopies(wait)
        parked = [self._pack(copies, tensor) for tensor in tensors]
        self.offload(wait)
        return parked

    def unpark(self, wait: Wait, parked: Sequence) -> list[torch.Tensor]:
        """The tensors ``park`` parked, on the device for the compute stream."""
        return [self._unpack(entry) for entry in parked]

    def forget(self, wait: Wait) -> None:
        """The pass that read ``wait``'s tensors ran: nothing of it is kept."""
        self._waits.pop(wait, None)

    def _pack(self, copies: _WaitCopies, tensor: torch.Tensor):
        if not self._worth_parking(tensor):
            return tensor
        parked = copies.by_id.get(id(tensor))
        if parked is None:
            parked = copies.by_id[id(tensor)] = _Parked(tensor)
            copies.parked.append(parked)
        return (copies, parked)

    def _worth_parking(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return False  # parameters stay (FSDP's gathered ones too, Parameters while the forward runs)
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.device != self.device:
            return False  # so do tensor subclasses (DTensor's local shard is what a copy would need) and sparse ones
        if self._cuda and tensor.nbytes < _MIN_CUDA_BYTES:
            return False
        return tensor.untyped_storage().data_ptr() not in self._resident_storages

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        copies, parked = packed
        if copies.offloaded and copies.copied_back is None:
            self.reload(copies.wait)  # not started in time: now, and the compute stream waits for it
        if self._cuda and copies.copied_back is not None:
            torch.cuda.current_stream(self.device).wait_event(copies.copied_back)
        if not copies.offloaded:
            parked.check_unchanged()
        return parked.device_tensor


def _storage_pointers(modules: Iterable[nn.Module]) -> set[int]:
    """Where the modules' parameters and buffers live (a DTensor's: its local shard's): they stay on the device
    anyway, so a copy of them would free nothing."""
    pointers = set()
    for module in modules:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            pointers.add(local.untyped_storage().data_ptr())
    return pointers


class _NoHooks:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        pass


_NO_HOOKS = _NoHooks()
_DONE = object()  # a CPU wait's copies back: done at once
