"""Random numbers in a stage's CUDA graphs: a backward that recomputes its forward draws the forward's numbers again."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from pipecomm.runtime.graph_capture import capture_into

__all__: list[str] = []


class ForwardRandomStates:
    """Where each micro-batch's forward replay began on the device's generator, for its backward passes to begin there.

    A recomputation (``torch.utils.checkpoint``: ``recompute=``, or the model's own) rewinds the generator to where its
    forward region drew, so that a dropout draws the same mask again. Captured, that rewind is to an offset within the
    graph being captured, added at replay to the generator's offset that the last graph launched with random numbers
    of its own left on the device: a backward graph whose only draws are a recomputation's leaves it to the last
    forward replayed, another micro-batch's wherever the schedule runs forwards between a micro-batch's forward and its
    backward. So a stage whose forwards draw random numbers captures each backward pass (B, I, W) with one number drawn
    of its own, which makes its replay set that offset, and replays it from its forward's state, putting the generator
    back afterwards as eager's recomputation does. A backward graph that leaves the generator moved (numbers drawn
    outside a recomputation) cannot be replayed both ways at once: refused at capture, as is a torch whose graphs
    fail a small test of this at the first capture that needs it (``rewinds_redraw``).
    """

    def __init__(self, device: torch.device | None, stage: int):
        self._device = device
        self._stage = stage
        self._forward_draws = False
        self._backward_draws: list[str] = []  # "B3": backward passes whose graphs leave the generator moved
        self._states: dict[int, torch.Tensor] = {}  # by micro-batch: the generator's state at its forward replay

    def note_capture(self, kind: str, micro_batch: int) -> None:
        """Called at the end of a pass's capture, inside it: whether its graph moved the generator; a backward
        pass's of a stage whose forwards draw gets its one number drawn (each forward is captured before its
        backward, and the stage's forwards all draw alike)."""
        offset = _capture_offset(self._device)
        if kind == "F":
            self._forward_draws = self._forward_draws or offset > 0
            return
        if offset:
            self._backward_draws.append(f"{kind}{micro_batch}")
        if self._forward_draws:
            torch.rand(1, device=self._device)

    def check_captured(self) -> None:
        """After every pass's capture: refuses what the replays could not draw as eager does."""
        if not self._forward_draws:
            return
        if self._backward_draws:
            raise ValueError(f"cuda_graphs: stage {self._stage}'s forward and backward passes "
                             f"({', '.join(self._backward_draws)}) both draw random numbers: a replayed backward "
                             "begins where its forward did, for a recomputation to draw the forward's numbers again, "
                             "and could not also draw its own where eager does")
        if not rewinds_redraw(self._device):
            raise ValueError(f"cuda_graphs: stage {self._stage}'s forward draws random numbers, and this torch's CUDA "
                             "graphs did not draw a recomputed dropout's masks again in a test of the replays "
                             "(pipecomm.runtime.graph_random); run it eagerly (cuda_graphs=False)")

    def replayed(self, kind: str, micro_batch: int, replay: Callable[..., None], *args) -> None:
        """``replay(*args)``, the launch of the micro-batch's ``kind`` pass, from the generator state it needs."""
        kept = self._before(kind, micro_batch)
        try:
            replay(*args)
        finally:
            if kept is not None:
                torch.cuda.set_rng_state(kept, self._device)

    def _before(self, kind: str, micro_batch: int) -> torch.Tensor | None:
        """Before replaying a pass: a forward's state is kept; a backward pass starts from its forward's, and the
        state to put back after it is returned. None where nothing needs putting back."""
        if not self._forward_draws:
            return None
        state = torch.cuda.get_rng_state(self._device)
        if kind == "F":
            self._states[micro_batch] = state
            return None
        forward = self._states[micro_batch] if kind == "I" else self._states.pop(micro_batch)
        torch.cuda.set_rng_state(forward, self._device)
        return state


def _capture_offset(device: torch.device) -> int:
    """The device generator's offset within the graph being captured (its state's 8 bytes after the seed's)."""
    return torch.cuda.get_rng_state(device)[8:16].view(torch.int64).item()


@functools.cache
def rewinds_redraw(device: torch.device) -> bool:
    """Whether graphs captured and replayed as ``ForwardRandomStates`` does redraw a recomputed dropout's mask: two
    micro-batches' checkpointed forwards replayed, then their backwards, each from its forward's state. It rests on
    how torch's generator hands offsets to graphs, which no API promises. Once per device and process."""
    kept = torch.cuda.get_rng_state(device)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    inputs = [torch.ones(4096, device=device, requires_grad=True) for _ in range(2)]
    randoms = ForwardRandomStates(device, stage=-1)
    forwards, backwards, outputs, grads = [], [], [], []
    try:
        for kind, index in (("F", 0), ("F", 1), ("B", 0), ("B", 1)):
            graph = torch.cuda.CUDAGraph()
            capture_into(graph, functools.partial(_test_pass, kind, index, inputs, outputs, grads, randoms), pool,
                         stream)
            (forwards if kind == "F" else backwards).append(graph)
        masks = []
        for index, graph in enumerate(forwards):
            randoms.replayed("F", index, graph.replay)
            masks.append(outputs[index] != 0)
        for index, graph in enumerate(backwards):
            randoms.replayed("B", index, graph.replay)
        return all(bool(((grad != 0) == mask).all()) for grad, mask in zip(grads, masks))
    finally:
        torch.cuda.set_rng_state(kept, device)


def _test_pass(kind: str, index: int, inputs: list, outputs: list, grads: list, randoms: ForwardRandomStates) -> None:
    """One pass of ``rewinds_redraw``'s test, to capture: a checkpointed dropout's forward, or its backward."""
    if kind == "F":
        outputs.append(checkpoint(lambda x: torch.nn.functional.dropout(x * 1.0, 0.5), inputs[index],
                                  use_reentrant=False))
    else:
        grads.append(torch.autograd.grad(outputs[index], inputs[index], torch.ones_like(inputs[index]))[0])
    randoms.note_capture(kind, index)
