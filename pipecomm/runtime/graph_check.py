"""How a checked capture's replays are compared with an eager run of the same micro-batch: the tolerance, and the
first tensor off it named. One synchronization per comparison."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__: list[str] = []

# A replay checked against eager may differ by the atomics' order in some backward kernels (attention's, index_add's):
# largest difference allowed, relative to the eager tensor's largest entry. Stale values from a capture differ by far
# more.
CHECK_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
CHECK_TOLERANCE_DEFAULT = 1e-3


class GraphCheckError(RuntimeError):
    """A captured graph's first replay differed from an eager run of the same micro-batch."""


def detached(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Copies an eager run's results are kept as, for the replays to be compared with."""
    return [None if t is None else t.detach().clone() for t in tensors]


def signed(tensors: Sequence[torch.Tensor | None], sign: float) -> list[torch.Tensor | None]:
    """Gradients replayed for a probe times ``sign``, brought back to the probe's own sign."""
    return [t if t is None or sign > 0 else -t for t in tensors]


def largest_difference(compared: Sequence[tuple[str, Sequence, Sequence]]) -> str | None:
    """The first replayed tensor off its eager twin by more than the tolerance (relative to the twin's largest
    entry), described; None where every one agrees. ``compared``: (what, replayed, eager) lists. One synchronization
    for all of them."""
    pairs, named = [], []
    for kind, got_list, want_list in compared:
        for index, (got, want) in enumerate(zip(got_list, want_list)):
            if (got is None) != (want is None):
                return f"{kind} {index} is {'missing' if got is None else 'present'} in the replay only"
            if got is not None and got.numel():
                pairs.append(torch.stack([(got.float() - want.float()).abs().max(), want.float().abs().max()]))
                named.append((f"{kind} {index}", CHECK_TOLERANCE.get(want.dtype, CHECK_TOLERANCE_DEFAULT)))
    if not pairs:
        return None
    for (name, tolerance), (difference, largest) in zip(named, torch.stack(pairs).tolist()):
        if not difference <= tolerance * largest:  # NaN fails too
            return f"{name}: largest difference {difference:.3g} where the largest entry is {largest:.3g}"
    return None


def largest_entry(tensor: torch.Tensor) -> torch.Tensor:
    """The largest absolute entry, a 0-d fp32 tensor (no synchronization)."""
    return tensor.detach().float().abs().max()


def off_zero(tensors: Sequence[torch.Tensor], largest: Sequence[torch.Tensor]) -> str | None:
    """The first tensor whose largest entry is over the tolerance relative to ``largest`` (its eager twin's, in the
    same order), described; None where every one is about zero. One synchronization."""
    if not tensors:
        return None
    found = torch.stack([largest_entry(tensor) for tensor in tensors] + list(largest)).tolist()
    for index, (tensor, got, bound) in enumerate(zip(tensors, found, found[len(tensors):])):
        if not got <= CHECK_TOLERANCE.get(tensor.dtype, CHECK_TOLERANCE_DEFAULT) * bound:  # NaN fails too
            return (f"parameter gradient {index}: largest difference {got:.3g} where the largest entry is "
                    f"{bound:.3g}")
    return None
