"""Zero-bubble backward split: input gradients now (I), the Linear layers' weight-gradient GEMMs later (W).

Zero-bubble schedules run a stage's backward in two parts so that the part the previous stage waits
for (the input gradients) runs first and the rest fills the bubbles. As in the zero-bubble paper's
and Megatron's implementations, what is deferred is the weight-gradient GEMM of every ``nn.Linear``
(half of a transformer's backward FLOPs). The I pass is an ordinary autograd backward that does not
ask for those weights, so autograd's own Linear backward skips their GEMMs; a hook on each layer's
output records the gradient arriving there, and W turns it and the layer's input into the weight
gradient, accumulated straight into the gradient buffer by the GEMM. Every other parameter (norms,
embeddings, biases, custom layers) gets its gradient during I, and I frees the autograd graph as an
ordinary backward does, so between I and W a micro-batch holds only what W needs.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

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


def _after_forward(store: WeightGradStore, layer: nn.Linear, args: tuple, output) -> None:
    # Whether the weight is frozen is read here, at each forward: users freeze and unfreeze between steps.
    if store.recording is None or not layer.weight.requires_grad or not output.requires_grad:
        return
    x = args[0]
    if not (x.requires_grad or (layer.bias is not None and layer.bias.requires_grad)):
        # Nothing the I pass asks for runs through this layer's backward, so it would never see the
        # output gradient: this micro-batch's I computes the weight gradient as usual.
        return
    weight = layer.weight
    store.recording.add(id(weight))

    def capture(grad_output: torch.Tensor) -> None:
        if store.collecting is not None:
            store.collecting.append((weight, x, grad_output))

    output.register_hook(capture)


def defer_linear_weight_grads(modules: Iterable[nn.Module], store: WeightGradStore) -> Callable[[], None]:
    """Makes the plain ``nn.Linear`` layers of ``modules`` report to ``store``; returns the undo.

    A layer whose weight is also used elsewhere (a tied embedding) is left alone, since its other
    uses need the weight's gradient from I. So are subclasses (nn.MultiheadAttention reads its
    out_proj's weight directly) and torch.compile'd modules, whose graphs would not call the hooks.
    """
    modules = list(modules)
    if any(isinstance(module, torch._dynamo.eval_frame.OptimizedModule) for module in modules):
        return lambda: None
    uses = collections.Counter(id(p) for m in modules for _, p in m.named_parameters(remove_duplicate=False))
    handles = [
        layer.register_forward_hook(functools.partial(_after_forward, store))
        for module in modules
        for layer in module.modules()
        if type(layer) is nn.Linear and uses[id(layer.weight)] == 1
    ]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
