"""Where a stage's parameter gradients accumulate over the micro-batches: ``.grad`` or fp32 ``main_grad`` buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipecomm._ops import accumulate_
from pipecomm.runtime.split_backward import DeferredGrad, weight_grad

__all__: list[str] = []

# accumulate_ kernels exist for these (accumulator, grad) pairs; others fall back to add_.
_NATIVE_PAIRS = {
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class GradientSink:
    """Where a stage's parameter gradients go: ``.grad`` (default) or fp32 ``main_grad`` buffers.

    With ``main_grad``, the bf16/fp16 parameters that require grad share one flat fp32 buffer; one
    unfrozen later gets a buffer of its own with its first gradient. Frozen parameters get no gradient.
    With ``live`` (a stage sharded by FSDP), ``params`` are the module's parameters at the time they
    are read: FSDP swaps its unsharded ones in while they are gathered, and those are what autograd sees.
    """

    def __init__(self, params: list[nn.Parameter], main_grad: bool, live: nn.Module | None = None):
        self._params = params
        self._ids = tuple(map(id, params))
        self._live = live
        self.main_grad = main_grad
        if main_grad:
            low_precision = [p for p in params if p.dtype in _LOW_PRECISION and p.requires_grad]
            total = sum(p.numel() for p in low_precision)
            device = low_precision[0].device if low_precision else None
            self.flat_main_grad = torch.zeros(total, dtype=torch.float32, device=device) if low_precision else None
            offset = 0
            for param in low_precision:
                param.main_grad = self.flat_main_grad[offset : offset + param.numel()].view_as(param)
                offset += param.numel()

    @property
    def autograd_accumulates(self) -> bool:
        """Whether a backward may leave the accumulation to autograd (``.grad``, as ``loss.backward()`` does): the
        same sums in the same order as ``add``, with no gradient handed back to Python. Not for ``main_grad``
        buffers, nor for FSDP's gathered parameters, whose gradients go to its reduce-scatter."""
        return not self.main_grad and self._live is None

    def replaced_in(self, module: nn.Module) -> bool:
        """Whether ``module``'s parameters are other objects than the ones this sink was made for (as
        ``load_state_dict(assign=True)`` leaves them); never for a live (sharded) sink, whose parameters FSDP swaps."""
        return self._live is None and tuple(map(id, module.parameters())) != self._ids

    @property
    def live(self) -> bool:
        """Whether the parameters are read as they are at each backward (a stage sharded by FSDP)."""
        return self._live is not None

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._live.parameters()) if self._live is not None else self._params

    def target(self, param: nn.Parameter) -> torch.Tensor | None:
        if self.main_grad and param.dtype in _LOW_PRECISION:
            return getattr(param, "main_grad", None)
        return param.grad

    def add(self, grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter] | None = None) -> None:
        """Adds one micro-batch's gradients of ``params`` (default: all): one fused launch per dtype pair (DTensors,
        a tensor-parallel layer's, add through their own dispatch)."""
        accumulators, sources = [], []
        for param, grad in zip(self.params if params is None else params, grads):
            if grad is None:
                continue
            target = self.target(param)
            if target is None:
                self._start(param, grad)
            elif (target.dtype, grad.dtype) in _NATIVE_PAIRS and not isinstance(target, DTensor):
                accumulators.append(target)
                sources.append(grad)
            else:
                target.add_(grad)
        try:
            accumulate_(accumulators, sources)
        except (RuntimeError, ValueError):
            # A layout the fused kernel does not take (a channels_last parameter's gradient, a sparse one), which it
            # finds before it adds anything: torch's add, which raises in turn for what is truly wrong.
            for target, grad in zip(accumulators, sources):
                target.add_(grad)

    def _start(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if grad.is_sparse:  # an Embedding's with sparse=True: kept sparse, as autograd keeps it
            param.grad = grad.clone()
            return
        # A copy: autograd may hand back one tensor for several parameters, or an expanded view.
        if self.main_grad and param.dtype in _LOW_PRECISION:
            param.main_grad = grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            param.grad = grad.clone(memory_format=torch.contiguous_format)

    def _adopt(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """``grad``, a tensor nothing else holds, becomes the parameter's first gradient."""
        if self.main_grad and param.dtype in _LOW_PRECISION:
            param.main_grad = grad.to(torch.float32)
        else:
            param.grad = grad.to(param.dtype)

    @torch.no_grad()  # the saved inputs carry autograd history, which .grad must not record
    def add_weight_grads(self, deferred: Sequence[DeferredGrad]) -> None:
        """Deferred Linear weight gradients; where the dtypes allow, the GEMM accumulates in place, and a weight's
        first gradient of the step is the GEMM's own result."""
        params, grads = [], []
        for param, x, grad_output in deferred:
            target = self.target(param)
            if target is not None and target.dtype == grad_output.dtype == x.dtype:
                target.addmm_(grad_output.reshape(-1, grad_output.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            elif target is None:
                # No copy of it beside it (``_start``'s): with every weight's copy and original alive at once until
                # the fused add, a W pass after zero_grad held the stage's weight gradients twice (0.54 GB more at
                # a Llama stage's peak, H200).
                self._adopt(param, weight_grad(grad_output, x))
            else:
                # In the parameter's dtype, as autograd hands gradients back (under autocast, too).
                params.append(param)
                grads.append(weight_grad(grad_output, x).to(param.dtype))
        self.add(grads, params)
