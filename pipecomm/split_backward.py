"""Zero-bubble backward split: input gradients now (I), the Linear layers' weight-gradient GEMMs later (W).

Zero-bubble schedules run a stage's backward in two parts so that the part the previous stage waits
for (the input gradients) runs first and the rest fills the bubbles. As in the zero-bubble paper's
and Megatron's implementations, what is deferred is the weight-gradient GEMM of every ``nn.Linear``
(half of a transformer's backward FLOPs). The I pass is an ordinary autograd backward that does not
ask for those weights, so autograd's own Linear backward skips their GEMMs; an identity node on each
layer's output records the gradient arriving there, and W turns it and the layer's input into the weight
gradient, accumulated straight into the gradient buffer by the GEMM. That node keeps the input as a
tensor saved for backward, so inside a checkpointed region (``recompute``) the input is dropped after
the forward and recomputed like every other saved activation rather than pinned until the backward.
Every other parameter (norms, embeddings, biases, custom layers) gets its gradient during I, and I
frees the autograd graph as an ordinary backward does, so between I and W a micro-batch holds only
what W needs.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__: list[str] = []

# One deferred weight gradient: (weight, the layer's input, the gradient of its output).
DeferredGrad = tuple[nn.Parameter, torch.Tensor, torch.Tensor]


class WeightGradStore:
    """What a stage's deferred Linear layers report to the executor."""

    def __init__(self):
        # During a forward: the weights whose gradients that micro-batch leaves to W.
        self.recording: set[int] | None = None
        # During that micro-batch's I pass: what W needs.
        self.collecting: list[DeferredGrad] | None = None


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
        # An alias that is no view: a stage's executor may still free a sent output that nothing saved.
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.deferred and ctx.store.collecting is not None:
            ctx.store.collecting.append((ctx.weight, x, grad_output))
        return grad_output, None, None, None, None


def _after_forward(store: WeightGradStore, layer: nn.Linear, args: tuple, output):
    # Whether the weight is frozen is read here, at each forward: users freeze and unfreeze between steps.
    if not layer.weight.requires_grad or not output.requires_grad:
        return None
    if isinstance(layer.weight, DTensor):
        return None  # tensor-parallel: its input and output gradient are laid out across ranks; I computes it
    x = args[0]
    if not (x.requires_grad or (layer.bias is not None and layer.bias.requires_grad)):
        # Nothing the I pass asks for runs through this layer's backward, so it would never see the
        # output gradient: this micro-batch's I computes the weight gradient as usual.
        return None
    deferred = store.recording is not None
    if deferred:
        store.recording.add(id(layer.weight))
    # Applied outside a step's forwards too (deferring nothing): a checkpoint's recomputation, which runs
    # during the backward, must save the same tensors as the forward it replays.
    # The weight goes in a tuple, so that the node gets no gradient edge to it.
    return _ReportInput.apply(output, x, (layer.weight,), store, deferred)


def deferrable_linears(modules: Iterable[nn.Module]) -> list[nn.Linear]:
    """The layers whose weight gradients a W pass may compute: plain ``nn.Linear`` layers of ``modules`` whose weight
    nothing else among them uses. Whether a forward defers one is decided as it runs (frozen, tensor-parallel)."""
    modules = list(modules)
    uses = collections.Counter(id(p) for m in modules for _, p in m.named_parameters(remove_duplicate=False))
    return [layer for module in modules for layer in module.modules()
            if type(layer) is nn.Linear and uses[id(layer.weight)] == 1]


def defer_linear_weight_grads(modules: Iterable[nn.Module], store: WeightGradStore) -> Callable[[], None]:
    """Makes the plain ``nn.Linear`` layers of ``modules`` report to ``store``; returns the undo.

    A layer whose weight is also used elsewhere (a tied embedding) is left alone, since its other
    uses need the weight's gradient from I. So are subclasses (nn.MultiheadAttention reads its
    out_proj's weight directly) and torch.compile'd modules, whose graphs would not call the hooks.
    """
    modules = list(modules)
    if any(isinstance(module, torch._dynamo.eval_frame.OptimizedModule) for module in modules):
        return lambda: None
    handles = [layer.register_forward_hook(functools.partial(_after_forward, store))
               for layer in deferrable_linears(modules)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
