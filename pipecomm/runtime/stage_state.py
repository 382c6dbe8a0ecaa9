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
    """Each stage takes its own keys from ``state``; with ``strict``, a key no stage has, or one a stage misses, is a
    ValueError raised before any stage loads (a checkpoint of the whole model, ``merge_checkpoints``', loads into a
    stage with ``strict=False``)."""
    keys = {stage: modules[stage].state_dict().keys() for stage in sorted(modules)}
    if strict:
        unexpected = set(state).difference(*keys.values())
        missing = sorted(key for stage_keys in keys.values() for key in stage_keys if key not in state)
        if unexpected or missing:
            raise ValueError(f"load_state_dict: rank {rank}'s stages" + (f" have no keys {sorted(unexpected)}"
                             if unexpected else "") + (" and" if unexpected and missing else "")
                             + (f" miss keys {missing}" if missing else "") + "; nothing was loaded. A whole model's "
                             "checkpoint (merge_checkpoints) loads into one stage with strict=False")
    for stage, stage_keys in keys.items():
        modules[stage].load_state_dict({k: state[k] for k in stage_keys if k in state}, strict=strict)
