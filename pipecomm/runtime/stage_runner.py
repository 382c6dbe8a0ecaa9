"""One stage's compute on its micro-batches, eagerly: forward, backward, backward-input, backward-weight (graphed:
``graph_runner``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipecomm.runtime import boundary
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.runtime.split_backward import DeferredGrad, Deferral, WeightGradStore, autograd_nodes, check_reported
from pipecomm.schedules.schedule import Schedule

__all__: list[str] = []


@dataclass
class MicroBatch:
    """What a stage holds of one micro-batch between its actions."""

    received: boundary.Received | None = None  # the message its forward reads (not on the first stage)
    inputs: list[torch.Tensor] = field(default_factory=list)  # the received tensors that gradients answer
    callers: list[torch.Tensor] = field(default_factory=list)  # the caller's data and targets that require grad
    outputs: boundary.Flat | None = None  # the forward's output (the loss on the last stage) until the backward
    freeable: list[torch.Tensor] = field(default_factory=list)  # outputs whose data their send may drop
    output_grads: tuple | None = None  # the gradients of the outputs, received (the loss's: ones)
    input_grads: tuple | None = None  # the gradients of ``inputs`` until they are sent
    deferrals: list[Deferral] = field(default_factory=list)  # the Linear layers that deferred in the forward
    deferred: list[DeferredGrad] = field(default_factory=list)  # their weight gradients' operands, after I


class EagerStage:
    """A stage module run eagerly: each forward keeps its autograd graph until the micro-batch's backward."""

    def __init__(self, module: nn.Module, sink: GradientSink, index: int, scaled_loss: Callable | None,
                 weight_grad_store: WeightGradStore | None, rank: int):
        self.module = module
        self.sink = sink
        self.index = index
        self.scaled_loss = scaled_loss  # (output, *targets) -> the loss over the step's micro-batches; last stage
        self.weight_grad_store = weight_grad_store
        self.rank = rank
        self.offloader: ActivationOffloader | None = None  # the rank's, when activations go to host memory
        self.micro_batches: dict[int, MicroBatch] = {}
        # Tensors requiring grad that the stage's forward reads and that are none of its parameters (kept in a plain
        # attribute or a list): looked for once, at the first training forward.
        self._unregistered: list[torch.Tensor] | None = None
        # This step's leaves beside the stage's parameters (those and loss_fn's), by id: data parallelism averages
        # their gradients over the replicas as it does the parameters'.
        self.beside: dict[int, torch.Tensor] = {}

    def start(self, training: bool) -> None:
        """A new step (``training``) or inference: nothing held, and the weights' aliases made afresh."""
        self.micro_batches = {}
        self.beside = {}
        if self.weight_grad_store:
            self.weight_grad_store.new_step()

    def adopt_schedule(self, schedule: Schedule, weight_grad_store: WeightGradStore | None) -> None:
        """From the next step on, ``schedule``, whose I passes (if it gives this stage any) defer to the store."""
        self.weight_grad_store = weight_grad_store

    def step_done(self) -> None:
        """After a training step's last action."""

    def skips_post_accumulate_hooks(self) -> str | None:
        """What in this stage's backward adds gradients without autograd's accumulation, which runs the parameters'
        post-accumulate-grad hooks as loss.backward() does; None where nothing does, or where FSDP's gradient path
        (a sharded stage) is the one to ask."""
        if self.sink.live:
            return None
        if self.weight_grad_store is not None:
            return "the zero-bubble schedule's split backward"
        if self.sink.main_grad:
            return "main_grad=True's accumulation"
        return None

    def _reentrant_checkpoint(self) -> str:
        """Why a reentrant checkpoint cannot run in this stage's backward, and what to do instead (the executor's note
        on the error says where)."""
        asks = self.skips_post_accumulate_hooks() or "a sharded stage's gradient path"
        return ("the stage runs torch.utils.checkpoint with use_reentrant=True, whose backward runs apart from the "
                f"one that called it and so cannot hand back the gradients that {asks} asks autograd for; "
                "checkpoint with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), turn the model's own checkpointing off "
                "and let the Pipeline's recompute= do it, or use a schedule that does not split the backward (1f1b) "
                "without main_grad")

    def record(self, micro_batch: int) -> MicroBatch:
        held = self.micro_batches.get(micro_batch)
        if held is None:
            held = self.micro_batches[micro_batch] = MicroBatch()
        return held

    def forward(self, micro_batch: int, args: tuple, kwargs: dict, received: list[torch.Tensor],
                targets: tuple, callers: list[torch.Tensor]) -> torch.Tensor | None:
        """The forward of one micro-batch, whose ``received`` tensors are among ``args`` (and on the last stage its
        loss, which it returns detached). ``callers``: the caller's tensors among the arguments and targets that
        require grad, whose gradients the backward sends on into the caller's autograd graph."""
        held = self.record(micro_batch)
        held.inputs, held.callers = received, callers
        store = self.weight_grad_store
        if store:
            store.recording = held.deferrals
        parked: set[int] = set()
        try:
            if self.offloader:
                wait = (self.index, micro_batch, "F")
                with self.offloader.saving(wait):
                    output = self.module(*args, **kwargs)
                # Before the outputs' freeing is decided: the copies out drop the hooks' hold on them.
                self.offloader.offload(wait)
                parked = self.offloader.holding(wait)
            else:
                output = self.module(*args, **kwargs)
        finally:
            if store:
                store.recording = None
        if self._unregistered is None and torch.is_grad_enabled():
            self._unregistered = leaves_beside(boundary.flatten(output).tensors, [*callers, *received], self.module,
                                               store)
        if self._unregistered:
            self.beside.update((id(tensor), tensor) for tensor in self._unregistered)
            if not (self.sink.autograd_accumulates and self.weight_grad_store is None):
                # Their gradients accumulate as the caller's tensors' do, as loss.backward() accumulates every leaf.
                held.callers = callers = callers + self._unregistered
        if self.scaled_loss is None:
            held.outputs = boundary.stage_output(output)
            # An output the offloader still holds as the backward will read it (measuring, it copies nothing) stays.
            held.freeable = [tensor for tensor in held_only_by_themselves(held.outputs.tensors)
                             if id(tensor) not in parked]
            return None
        loss = self.scaled_loss(output, *targets)
        held.outputs, held.output_grads = boundary.flatten(loss), (torch.ones_like(loss),)
        # Leaves the loss reaches beside the stage's output (a learned temperature, an auxiliary head that loss_fn
        # holds) get their gradients as the caller's tensors do: a backward that asks autograd for the stage's own
        # parameters alone would compute and drop theirs.
        of_loss = leaves_beside([loss], [*boundary.flatten(output).tensors, *callers, *received], self.module, store)
        self.beside.update((id(tensor), tensor) for tensor in of_loss)
        held.callers = callers + of_loss
        return loss.detach()

    def infer(self, micro_batch: int, args: tuple, kwargs: dict):
        """An inference forward: no saved tensors, nothing kept past its send; returns the last stage's output."""
        output = self.module(*args, **kwargs)
        if self.scaled_loss is not None:
            return output
        self.record(micro_batch).outputs = boundary.stage_output(output)
        return None

    def outputs_sent(self, micro_batch: int, read_event: Callable[[], torch.cuda.Event | None]) -> None:
        """The forward's outputs were sent: their data goes where no backward reads it. ``read_event()`` gives the
        event after which the send has read them (``Channel.send_read_event``), for a runner that writes them again."""
        held = self.micro_batches[micro_batch]
        free_data(held.freeable)
        held.freeable = []

    def backward(self, micro_batch: int) -> None:
        """The whole backward: input gradients and every parameter's, accumulated into the sink."""
        self._backward(self.micro_batches[micro_batch])
        if self.offloader:
            self.offloader.forget((self.index, micro_batch, "F"))

    def backward_input(self, micro_batch: int) -> None:
        """Input gradients and every parameter gradient but the deferred Linear weight GEMMs' (the critical path)."""
        held = self.micro_batches[micro_batch]
        roots = [out for out, grad in zip(held.outputs.tensors, held.output_grads or ()) if grad is not None]
        self.weight_grad_store.collecting = held.deferred
        try:
            self._backward(held)
        finally:
            self.weight_grad_store.collecting = None
        check_reported(held.deferrals, roots,
                       f"pipeline rank {self.rank}, stage {self.index}, micro-batch {micro_batch}, I pass")
        if self.offloader:
            self.offloader.forget((self.index, micro_batch, "F"))
            wait = (self.index, micro_batch, "I")
            if wait in self.offloader.offloaded:
                held.deferred = _park_deferred(self.offloader, wait, held.deferred)

    def backward_weight(self, micro_batch: int) -> None:
        """The deferred Linear weight gradients of the micro-batch's I pass."""
        deferred = self.micro_batches.pop(micro_batch).deferred
        wait = (self.index, micro_batch, "I")
        if self.offloader and wait in self.offloader.offloaded:
            deferred = _unpark_deferred(self.offloader, wait, deferred)
        self.sink.add_weight_grads(deferred)

    def take_input_grads(self, micro_batch: int) -> tuple:
        held = self.micro_batches[micro_batch]
        grads, held.input_grads = held.input_grads, None
        return grads

    def input_grads_sent(self, micro_batch: int, read_event: Callable[[], torch.cuda.Event | None]) -> None:
        """The input gradients ``take_input_grads`` gave were sent (``outputs_sent`` says what ``read_event`` is)."""

    def _backward(self, held: MicroBatch) -> None:
        """Backward of a micro-batch towards the stage's inputs and its parameters that require grad."""
        outputs, grads, inputs, callers = held.outputs.tensors, held.output_grads, held.inputs, held.callers
        held.outputs = held.output_grads = None
        held.inputs, held.callers = [], []
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        params = [p for p in self.sink.params if p.requires_grad]
        # Autograd accumulates into .grad itself where it may: the sums ``add`` makes, and a parameter's first
        # gradient of the step becomes its .grad, where handing it back and adding it copied it (an embedding's
        # gradient held twice at that moment).
        if self.sink.autograd_accumulates and self.weight_grad_store is None:
            leaves = ()  # every leaf, the caller's graph behind ``callers`` included, as loss.backward() goes
        elif self.sink.autograd_accumulates and not callers and all(tensor.is_leaf for tensor in wanted):
            leaves = wanted + params  # not the deferring Linears' weight aliases, leaves too, whose gradients W makes
        else:
            leaves = None
        try:
            if leaves is not None:
                run_backward(outputs, grads, leaves, keep_graph=False, accumulate=True)
                input_grads = [_take_grad(tensor) for tensor in wanted]
            else:
                results = run_backward(outputs, grads, wanted + params + callers, keep_graph=False)
                input_grads = results[: len(wanted)]
                self.sink.add(results[len(wanted):len(wanted) + len(params)], params)
                if callers:
                    run_backward(callers, results[len(wanted) + len(params):], (), keep_graph=False, accumulate=True)
        except RuntimeError as error:
            if "use_reentrant=True" not in str(error):
                raise
            raise RuntimeError(self._reentrant_checkpoint()) from error
        if self.index > 0:  # the first stage's inputs are data
            remaining = iter(input_grads)
            held.input_grads = tuple(next(remaining) if tensor.requires_grad else None for tensor in inputs)


def _park_deferred(offloader: ActivationOffloader, wait, deferred: list[DeferredGrad]) -> list[tuple]:
    """The W pass's inputs (each deferred gradient's layer input and output gradient) parked for ``wait``."""
    parked = offloader.park(wait, [tensor for _, x, grad in deferred for tensor in (x, grad)])
    return [(weight, parked[2 * index], parked[2 * index + 1]) for index, (weight, _, _) in enumerate(deferred)]


def _unpark_deferred(offloader: ActivationOffloader, wait, parked: list[tuple]) -> list[DeferredGrad]:
    tensors = offloader.unpark(wait, [entry for _, x, grad in parked for entry in (x, grad)])
    offloader.forget(wait)
    return [(weight, tensors[2 * index], tensors[2 * index + 1]) for index, (weight, _, _) in enumerate(parked)]


def leaves_beside(roots: Sequence[torch.Tensor], reached: Sequence[torch.Tensor], module: nn.Module,
                  store: WeightGradStore | None) -> list[torch.Tensor]:
    """The leaves requiring grad that ``roots`` reach other than through the tensors whose gradients the backward
    already asks for (``reached``: the stage's outputs, received and caller's tensors), ``module``'s parameters and
    the ``store``'s weight aliases: a walk of the roots' autograd nodes, which stops where those tensors were made."""
    known = {id(tensor) for tensor in (*reached, *(store.aliases() if store else ()))}
    found = []
    for node in autograd_nodes(roots, {tensor.grad_fn for tensor in reached if tensor.grad_fn is not None}):
        leaf = getattr(node, "variable", None)  # an AccumulateGrad's
        if leaf is not None and id(leaf) not in known:
            known.add(id(leaf))
            found.append(leaf)
    if found:  # a stage parameter the loss reads too (a tied head) is asked for already
        params = {id(param) for param in module.parameters()}
        found = [leaf for leaf in found if id(leaf) not in params]
    return found


def leaves_beside_said(count: int) -> str:
    return (f"its forward or loss_fn reaches {count} tensor(s) requiring grad that are none of the stage's parameters "
            "(parameters loss_fn holds, a tensor kept outside the stage's modules), whose gradients no CUDA graph of "
            "the stage returns")


def _take_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    grad, tensor.grad = tensor.grad, None
    return grad


def run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                 keep_graph: bool, accumulate: bool = False) -> tuple:
    """Gradients of ``outputs`` w.r.t. ``inputs``, returned without accumulating into ``.grad``; or, with
    ``accumulate``, accumulated into the ``.grad`` of ``inputs`` alone, or without them of every leaf, as
    ``loss.backward()`` does.

    Goes to the autograd engine directly, as Megatron does, because the outputs' storage was freed
    after they were sent and torch.autograd.grad would reject their placeholder shapes. An output
    without a gradient (the next stage did not use it) contributes nothing.
    """
    pairs = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad and grad is not None]
    if not pairs or not (inputs or accumulate):
        return (None,) * len(inputs)
    tensors, grad_tensors = zip(*pairs)
    return torch.autograd.Variable._execution_engine.run_backward(
        tensors, grad_tensors, keep_graph, False, tuple(inputs), True, accumulate
    )


def held_only_by_themselves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs whose data nothing else holds, read right after the forward: the ones a send may free.

    ``.data`` swaps the storage of the tensor object itself, so whatever holds that object for the backward would
    read the placeholder. Autograd holds what it saves either as the tensor itself (an op's input: one more use of
    the TensorImpl) or as a new TensorImpl on its storage (an op's own output, as tanh saves it: one more use of the
    storage); a view, a detached alias or a ``torch.compile``'d region's saved tensor holds the storage too. So an
    output is freed only if autograd computed it (a leaf may be a parameter or a received input passed through), it
    is no view (its base keeps the memory), and its TensorImpl and storage have no other user. Counting uses costs a
    few calls per output, where observing every saved tensor through saved-tensor hooks cost one per saved tensor.
    Saved-tensor hooks of the caller's around the step (``save_on_cpu``, an identity for debugging) may keep the
    tensor object itself, which no count shows: under them nothing is freed.
    """
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return []
    return [tensor for tensor in outputs if tensor.grad_fn is not None and tensor._base is None
            and _sole_user(tensor)]


def free_data(tensors: Sequence[torch.Tensor]) -> None:
    """Megatron's deallocate_output_tensor: each tensor's autograd node lives on, its data goes (for
    ``held_only_by_themselves``'s tensors only)."""
    for tensor in tensors:
        tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


def _sole_user(tensor: torch.Tensor) -> bool:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage of its own to count
        return False
    # The storage's users: the tensor and the ``storage`` object just made for this call.
    return tensor._use_count() == 1 and torch._C._storage_Use_Count(storage._cdata) == 2
