"""A rank's checkpoint: its stages' state dicts as one, under the original model's names where ``split`` kept them."""

from __future__ import annotations

from torch import nn

__all__: list[str] = []


def state_dict(modules: dict[int, nn.Module], rank: int) -> dict:
    """Every stage's state in one dict; two stages may share an entry only if it is the same object (a tied weight)."""
    state: dict = {}
    for stage in sorted(modules):
        for key, value in modules[stage].state_dict().items():
            if key in state and value is not state[key]:
                raise ValueError(f"state_dict: stages on rank {rank} both have a {key!r}; name them "
                                 "uniquely, e.g. with pipecomm.split")
            state[key] = value
    return state


def load_state_dict(modules: dict[int, nn.Module], state: dict, strict: bool, rank: int) -> None:
    """Each stage takes its own keys from ``state``; with ``strict``, a key no stage has is a ValueError."""
    expected = set()
    for stage in sorted(modules):
        keys = modules[stage].state_dict().keys()
        expected.update(keys)
        modules[stage].load_state_dict({k: state[k] for k in keys if k in state}, strict=strict)
    unexpected = set(state) - expected
    if strict and unexpected:
        raise ValueError(f"load_state_dict: keys of no stage on rank {rank}: {sorted(unexpected)}")
