"""What a CUDA-graph capture of a stage saw besides its inputs, and whether it still holds.

A replay reads the parameters and buffers at the addresses the capture found them, and every value the forward read
from Python then as a constant. ``CaptureState`` records those a step can cheaply look at again: the parameters'
and buffers' memory, which parameters require grad and which have gradient hooks, every module's attributes holding
plain values or tensors kept outside parameters and buffers, autocast and grad mode, and torch's global settings that
pick the kernels (TF32, reduced-precision reductions, attention backends, deterministic algorithms). Values read from
elsewhere (a global, a closure) it cannot see (docs/using.md, "CUDA graphs").
"""

from __future__ import annotations

import torch
from torch import nn

__all__: list[str] = []

_PARTS = ("parameters' memory", "parameters' requires_grad", "parameters' gradient hooks", "buffers' memory",
          "autocast and grad mode", "torch's kernel settings (TF32, reduced-precision reductions, attention backends, "
          "deterministic algorithms)")
_MISSING = object()


class CaptureState:
    """``module``'s state as a capture leaves it; ``changed`` names what differs since."""

    def __init__(self, module: nn.Module):
        self.module = module
        # The module tree as the capture saw it, walked once: each check reads the parameters and buffers of these
        # modules directly (torch's recursive parameters() took most of a check's time) and compares the tree itself,
        # so a submodule added, removed or replaced shows as a changed parameter or buffer list.
        self._modules = list(module.modules())
        self._state = _state(self._modules)
        self._attributes = [(inner, name, value) for inner in self._modules
                            for name, value in vars(inner).items() if _watched(value)]
        # A stage cut by split: the checks of the values its captured code read, and which capture they pick (its
        # training mode, where split captured both).
        self._read_checks = [hook for hook in module._forward_pre_hooks.values() if hasattr(hook, "changed")]
        self._picked = [hook.picked() for hook in self._read_checks]

    def changed(self) -> list[str]:
        """What the replays would miss (empty: nothing): a parameter or buffer moved to other memory, a parameter
        frozen or unfrozen or given a gradient hook, a watched attribute set anew (``training``, a dropout's ``p``, a
        temperature, a cached tensor replaced), autocast or grad mode, a kernel setting. Cheap enough for every step: a few reads per
        parameter, buffer and attribute."""
        changed = [name for name, old, new in zip(_PARTS, self._state, _state(self._modules)) if old != new]
        read = [text for hook in self._read_checks for text in hook.changed()]
        if [hook.picked() for hook in self._read_checks] != self._picked:
            read.append("training mode, which the model's own code outside its stages reads")
        return changed + read + [f"{type(inner).__name__}.{name} (was {_shown(value)})"
                                 for inner, name, value in self._attributes
                                 if not _same_value(inner.__dict__.get(name, _MISSING), value)]


def _state(modules: list[nn.Module]) -> tuple:
    params = [p for inner in modules for p in inner._parameters.values() if p is not None]
    tree = tuple(id(child) for inner in modules for child in inner._modules.values())
    return ((tree, tuple(p.data_ptr() for p in params)), tuple(p.requires_grad for p in params),
            any(p._backward_hooks or p._post_accumulate_grad_hooks for p in params),  # a capture saw none
            (tree, tuple(b.data_ptr() for inner in modules for b in inner._buffers.values() if b is not None)),
            (torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
            _kernel_settings())


def _kernel_settings() -> tuple:
    """The global settings by which torch picks a kernel, and so the numbers it gives: a replay runs the kernels the
    capture picked under the settings then, where eager would pick by today's."""
    matmul, sdp = torch.backends.cuda.matmul, torch.backends.cuda
    return (torch.get_float32_matmul_precision(), matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
            sdp.flash_sdp_enabled(), sdp.mem_efficient_sdp_enabled(), sdp.math_sdp_enabled(), sdp.cudnn_sdp_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)


def _watched(value: object) -> bool:
    """A module attribute a replay would read as the capture saw it: a plain value, or a tensor kept as a plain
    attribute (not a parameter or buffer), which a replay reads at the address it had then."""
    return value is None or type(value) in (bool, int, float, str, torch.dtype) or isinstance(value, torch.Tensor)


def _same_value(now: object, then: object) -> bool:
    """Tensors by identity (their contents may change in place: the replay reads them), plain values by equality."""
    return now is then or (type(now) is type(then) and not isinstance(now, torch.Tensor) and now == then)


def _shown(value: object) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
