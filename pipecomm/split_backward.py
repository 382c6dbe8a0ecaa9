"""Zero-bubble backward split: input gradients now (I), the Linear layers' weight-gradient GEMMs later (W).

Zero-bubble schedules run a stage's backward in two parts so that the part the previous stage waits
for (the input gradients) runs first and the rest fills the bubbles. As in the zero-bubble paper's
and Megatron's implementations, what is deferred is the weight-gradient GEMM of every ``nn.Linear``
(half of a transformer's backward FLOPs): during I such a layer returns its input gradient and its
bias gradient, and records its input and output gradient; W turns those into the weight gradient,
accumulated straight into the gradient buffer by the GEMM itself. Every other parameter (norms,
embeddings, custom layers) gets its gradient during I. I frees the autograd graph as an ordinary
backward does, so between I and W a micro-batch holds only what W needs.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__: list[str] = []

# One deferred weight gradient: (weight, the layer's input, the gradient of its output).
DeferredGrad = tuple[nn.Parameter, torch.Tensor, torch.Tensor]


class WeightGradStore:
    """Where deferred layers put their weight-gradient work while a stage's I pass runs."""

    def __init__(self):
        self.collecting: list[DeferredGrad] | None = None


class _DeferredLinear(torch.autograd.Function):
    """F.linear whose backward, while its store is collecting, leaves the weight gradient for later."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.param = weight  # under autocast the saved weight is a cast copy
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # Cast as autocast would, and keep the cast copies: the backward runs outside autocast.
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            output = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.store = store
        ctx.has_bias = bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        needs_input, needs_weight, needs_bias, _ = ctx.needs_input_grad
        grad_input = grad_output.matmul(weight) if needs_input else None
        grad_bias = grad_output.sum(dim=tuple(range(grad_output.dim() - 1))) if ctx.has_bias and needs_bias else None
        grad_weight = None
        if needs_weight:
            if ctx.store.collecting is not None:
                ctx.store.collecting.append((ctx.param, x, grad_output))
            else:
                grad_weight = weight_grad(grad_output, x)
        return grad_input, grad_weight, grad_bias, None


def weight_grad(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def _deferred_forward(layer: nn.Linear, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(x, layer.weight, layer.bias, store)


def defer_linear_weight_grads(modules: Iterable[nn.Module], store: WeightGradStore) -> Callable[[], None]:
    """Makes the plain ``nn.Linear`` layers of ``modules`` defer their weight gradients to ``store``; returns the undo.

    A layer whose weight is also used elsewhere (a tied embedding) is left alone, since its other
    uses would need their gradient at the same time. So are subclasses (nn.MultiheadAttention
    reads its out_proj's weight directly) and torch.compile'd modules, whose tracing would see
    the store.
    """
    modules = list(modules)
    if any(isinstance(module, torch._dynamo.eval_frame.OptimizedModule) for module in modules):
        return lambda: None
    uses = collections.Counter(id(p) for m in modules for _, p in m.named_parameters(remove_duplicate=False))
    patched = []
    for module in modules:
        for layer in module.modules():
            if (type(layer) is nn.Linear and layer.weight.requires_grad and uses[id(layer.weight)] == 1
                    and "forward" not in layer.__dict__):
                layer.forward = functools.partial(_deferred_forward, layer, store)
                patched.append(layer)

    def undo() -> None:
        for layer in patched:
            del layer.forward

    return undo
