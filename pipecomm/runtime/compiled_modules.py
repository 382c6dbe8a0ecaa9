"""torch.compile'd modules a pipeline cannot run: those that replay inductor's own CUDA graphs (mode="reduce-overhead")."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

__all__: list[str] = []

_BACKEND_DEPTH = 8  # CatchErrorsWrapper -> ConvertFrame -> the backend with its config, in torch 2.11 to 2.13


def replaying_inductor_graphs(modules: Iterable[nn.Module]) -> list[str]:
    """The qualified names of the modules compiled with inductor's CUDA graphs ("reduce-overhead", "max-autotune").

    Their replays write every call's outputs into the same memory, so a pipeline's second micro-batch in flight
    overwrites the first one's activations (torch raises at the first step; under ``cuda_graphs=True`` the capture
    fails). Found through torch.compile's own objects; a module they do not show is not reported.
    """
    if "torch._dynamo" not in sys.modules:
        return []  # nothing was compiled; importing dynamo to find that out would add most of a second to every rank
    return [name for module in modules for name, inner in module.named_modules() if _uses_cudagraphs(inner)]


def _uses_cudagraphs(module: nn.Module) -> bool:
    for context in _compile_contexts(module):
        backend = getattr(context, "callback", None)
        for _ in range(_BACKEND_DEPTH):
            if backend is None:
                break
            config = getattr(backend, "config", None)
            if isinstance(config, dict) and config.get("triton.cudagraphs"):
                return True
            backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return False


def _compile_contexts(module: nn.Module) -> list:
    """The torch.compile contexts of a ``torch.compile(module)`` wrapper or a module compiled in place."""
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    contexts = [module.dynamo_ctx] if isinstance(module, OptimizedModule) else []
    compiled = module.__dict__.get("_compiled_call_impl")  # nn.Module.compile()
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, _TorchDynamoContext):
            contexts.append(contents)
    return contexts
