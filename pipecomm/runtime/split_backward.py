"""Zero-bubble backward split: input gradients now (I), the Linear layers' weight-gradient GEMMs later (W).

Zero-bubble schedules run a stage's backward in two parts so that the part the previous stage waits
for (the input gradients) runs first and the rest fills the bubbles. As in the zero-bubble paper's
and Megatron's implementations, what is deferred is the weight-gradient GEMM of every ``nn.Linear``
call (half of a transformer's backward FLOPs).

During a step's forward each plain ``nn.Linear`` multiplies by an *alias* of its weight: a detached
leaf sharing its storage, which no backward ever asks for, so autograd's own Linear backward skips
that GEMM. An identity node on the layer's output records the gradient arriving there, and W turns
it and the layer's input into the weight gradient, accumulated straight into the gradient buffer.
Every other use of the weight (a tied head, an ``F.linear`` on it elsewhere) still reads the weight
itself, and I computes its part of the gradient as usual. The node keeps the input as a tensor saved
for backward, so inside a checkpointed region (``recompute``) the input is dropped after the forward
and recomputed like every other saved activation. Every other parameter gets its gradient during I,
and I frees the autograd graph as an ordinary backward does.

Inside a region that torch.compile traces, the layer is an ordinary Linear: a compiled backward
computes its weight gradient whole, so I does, and nothing is deferred. Nor is a weight with a gradient hook
(``register_hook``), which runs on the gradient autograd computes. A deferral whose identity
node is reached by I and yet reports nothing would leave the weight without its gradient, so it is
an error naming the layer (``check_reported``), never a silent omission.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__: list[str] = []

# One deferred weight gradient: (weight, the layer's input, the gradient of its output).
DeferredGrad = tuple[nn.Parameter, torch.Tensor, torch.Tensor]
# One deferral a forward made: (the layer's name, the identity node its backward runs).
Deferral = tuple[str, torch.autograd.graph.Node]


class WeightGradStore:
    """What a stage's deferring Linear layers and the executor share."""

    def __init__(self):
        # During a micro-batch's forward: the deferrals it makes, in call order.
        self.recording: list[Deferral] | None = None
        # During that micro-batch's I pass: what W needs.
        self.collecting: list[DeferredGrad] | None = None
        self.deferrals_made = 0  # over the store's life: zero after a step means W had nothing to do
        self._aliases: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def alias(self, weight: nn.Parameter) -> torch.Tensor:
        """The weight's alias for this step: one for every micro-batch, so that autocast casts it once, as it does the
        weight (its cache keeps casts of leaves that require grad)."""
        entry = self._aliases.get(id(weight))
        if entry is None or entry[0] is not weight:  # the weight is held, so its id cannot have been reused
            entry = self._aliases[id(weight)] = (weight, weight.detach().requires_grad_())
        return entry[1]

    def aliases(self) -> list[torch.Tensor]:
        """This step's aliases, leaves that only the W pass reads the gradients of."""
        return [alias for _, alias in self._aliases.values()]

    def new_step(self) -> None:
        """Forgets the aliases: a weight frozen, replaced or resharded between steps gets a fresh one."""
        self._aliases.clear()


def weight_grad(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A Linear's weight gradient from its output gradient and its input, in the output gradient's dtype."""
    x = x.to(grad_output.dtype)  # under autocast the layer's input is fp32, the GEMM ran in its cast
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _ReportInput(torch.autograd.Function):
    """Identity on a Linear's output; its backward hands (weight, input, output gradient) to the store."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, x: torch.Tensor, weight: tuple[nn.Parameter], store: WeightGradStore,
                deferred: bool) -> torch.Tensor:
        # Saved, not closed over: a checkpoint's saved-tensor hooks then drop it and recompute it for the backward.
        ctx.save_for_backward(x)
        ctx.weight, ctx.store, ctx.deferred = weight[0], store, deferred
        ctx.reported = False
        # An alias that is no view: a stage's executor may still free a sent output that nothing saved.
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.deferred and ctx.store.collecting is not None:
            ctx.store.collecting.append((ctx.weight, x, grad_output))
            ctx.reported = True
        elif ctx.deferred and torch.is_grad_enabled():
            # A differentiable backward (create_graph=True) outside the I pass: the model's own torch.autograd.grad
            # in its forward. What it builds reads the weight's alias, which no pass asks a gradient for.
            raise RuntimeError(
                "torch.autograd.grad(..., create_graph=True) through an nn.Linear during the step's forward (a "
                "gradient penalty, a meta-learning inner step): the zero-bubble schedules defer Linear weight "
                "gradients and would drop the second-order part of them; use a schedule without the split backward "
                "(1f1b, interleaved-1f1b, gpipe)")
        return grad_output, None, None, None, None


def _deferring_forward(layer: nn.Linear, name: str, store: WeightGradStore, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, deferring the weight gradient while the store records a step's forward."""
    weight, bias = layer.weight, layer.bias
    if torch.compiler.is_compiling() or not _may_defer(weight, bias, input):
        return nn.functional.linear(input, weight, bias)
    deferred = store.recording is not None
    output = nn.functional.linear(input, store.alias(weight) if deferred else weight, bias)
    # Applied outside a step's forwards too (deferring nothing): a checkpoint's recomputation, which runs
    # during the backward, must save the same tensors as the forward it replays.
    # The weight goes in a tuple, so that the node gets no gradient edge to it.
    output = _ReportInput.apply(output, input, (weight,), store, deferred)
    if deferred:
        store.recording.append((name, output.grad_fn))
        store.deferrals_made += 1
    return output


def _may_defer(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> bool:
    # Read at each forward: users freeze and unfreeze between steps, and hook-based reparametrizations
    # (weight_norm) set a computed weight, whose gradient must flow on to what it was computed from.
    if not (torch.is_grad_enabled() and weight.requires_grad and isinstance(weight, nn.Parameter)):
        return False
    if torch._C._are_functorch_transforms_active():
        return False  # inside torch.func.vmap or grad: the alias cannot be made a leaf there, and I computes it
    if isinstance(weight, DTensor):
        return False  # tensor-parallel: its input and output gradient are laid out across ranks; I computes it
    if weight._backward_hooks:
        return False  # register_hook: the hook runs on the gradient autograd computes, which W's GEMM would bypass
    # Otherwise nothing the I pass asks for runs through this layer's backward, so it would never see the output
    # gradient: I computes the weight gradient as usual.
    return x.requires_grad or (bias is not None and bias.requires_grad)


def deferrable_linears(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Linear]]:
    """The layers whose weight gradients a W pass may compute, each once, with its name in its stage module:
    ``nn.Linear`` itself (a subclass may compute otherwise, as nn.MultiheadAttention's out_proj does) with the class's
    own forward. Keyed by identity, not name: a rank's two stages of one architecture name their layers alike."""
    found: dict[int, tuple[str, nn.Linear]] = {}
    for module in modules:
        for name, layer in module.named_modules():
            if type(layer) is nn.Linear and "forward" not in layer.__dict__:
                found.setdefault(id(layer), (name, layer))
    return list(found.values())


def defer_linear_weight_grads(modules: Iterable[nn.Module], store: WeightGradStore) -> Callable[[], None]:
    """Makes the ``deferrable_linears`` of ``modules`` defer their weight gradients while ``store`` records; returns
    the undo. The layers' forward hooks, the user's own included, see the layer's output as usual."""
    layers = deferrable_linears(modules)
    for name, layer in layers:
        layer.forward = functools.partial(_deferring_forward, layer, name, store)

    def undo() -> None:
        for _, layer in layers:
            forward = layer.__dict__.get("forward")
            # Left in place where something wrapped it since (a recomputation still installed): with the store no
            # longer recording, it defers nothing.
            if isinstance(forward, functools.partial) and forward.func is _deferring_forward:
                del layer.forward

    return undo


def autograd_nodes(roots: Sequence[torch.Tensor], stop: set | frozenset = frozenset()) -> dict:
    """The autograd nodes a backward from ``roots`` reaches, in the order a walk meets them (as the keys of a dict),
    not going past those in ``stop``."""
    reached: dict = {}
    pending = [root.grad_fn for root in roots]
    while pending:
        node = pending.pop()
        if node is None or node in reached or node in stop:
            continue
        reached[node] = None
        pending.extend(next_node for next_node, _ in node.next_functions)
    return reached


def check_reported(deferrals: Sequence[Deferral], roots: Sequence[torch.Tensor], where: str) -> None:
    """Raises, naming the layers, if a backward from ``roots`` reached a deferral among ``deferrals`` that reported
    nothing: their weight gradients would be missing (a deferral that is not reached, like its layer's output, had no
    part in the loss). ``where`` leads the message (rank, stage, micro-batch)."""
    silent = {node: name for name, node in deferrals if not node.reported}
    if not silent:
        return
    reached = autograd_nodes(roots)
    missing = [name for node, name in silent.items() if node in reached]
    if missing:
        raise RuntimeError(
            f"{where}: the weight gradients of {', '.join(missing)} (nn.Linear) were deferred to the W pass, but the "
            "backward reached their deferral without passing it the layer's output gradient, so they would get none; "
            "something ran their backward outside autograd's view of the layer. Use a schedule without the split "
            "backward (1f1b, interleaved-1f1b, gpipe)")


def warn_if_nothing_deferred(store: WeightGradStore, who: str, schedule_name: str, stages: list[int]) -> None:
    """After a zero-bubble schedule's first step: a warning if no Linear deferred its weight gradient to W."""
    if store.deferrals_made == 0:
        warnings.warn(
            f"{who}: schedule {schedule_name!r} split the backward, but no nn.Linear of stages {stages} deferred its "
            "weight gradient to W in the first step: they run inside torch.compile'd regions (whose backward "
            "computes every gradient in one graph), are frozen, or are subclasses with a forward of their own. "
            "Training is exact, but the W passes have nothing to fill the bubbles with; 1f1b gives the same for "
            "less bookkeeping", stacklevel=3)
