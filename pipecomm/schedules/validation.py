"""Validating a schedule: well-formed, every channel received in the order it is sent, free of deadlock."""

from __future__ import annotations

import collections

from pipecomm.schedules.schedule import CHANNEL_NAMES, Action, Schedule, channel_kind, counterpart
from pipecomm.schedules.structure import check_structure
from pipecomm.schedules.simulation import execute

__all__ = ["validate"]


def validate(schedule: Schedule, buffer_slots: int = 4) -> None:
    """Raises ValueError naming the first defect: a missing, duplicated or misplaced action, an
    unmatched transfer, a rank that runs an action before one it depends on, a receive out of its
    channel's order, or a deadlock.

    The deadlock check runs all ranks together: a RECV blocks until its SEND has run on the peer,
    and a SEND blocks while its channel already holds ``buffer_slots`` messages that have not been
    received. As the runtime opens them, a pair of ranks has an activation and a gradient channel,
    each in order and with its own slots each way; a rank's messages to itself never block.
    """
    if buffer_slots < 1:
        raise ValueError(f"validate: buffer_slots must be >= 1, got {buffer_slots}")
    check_structure(schedule)
    _check_channel_order(schedule)
    execute(schedule, lambda action: 0.0, 0.0, buffer_slots)


def _check_channel_order(schedule: Schedule) -> None:
    """Each channel delivers in order: a rank must receive from each of its channels in the order the peer sends."""
    sent: dict[tuple[int, int, str], list[Action]] = collections.defaultdict(list)
    received: dict[tuple[int, int, str], list[Action]] = collections.defaultdict(list)
    for rank, program in enumerate(schedule.actions):
        for action in program:
            if action.kind.startswith("SEND"):
                sent[(rank, schedule.stage_rank(counterpart(action).stage), channel_kind(action))].append(action)
            elif action.kind.startswith("RECV"):
                send = counterpart(action)
                received[(schedule.stage_rank(send.stage), rank, channel_kind(action))].append(send)
    for (source, target, kind), order in sent.items():
        if received[(source, target, kind)] != order:
            got = next(i for i, (a, b) in enumerate(zip(order, received[(source, target, kind)])) if a != b)
            raise ValueError(
                f"rank {target} receives from its {CHANNEL_NAMES[kind]} channel with rank {source} out of the order "
                f"rank {source} sends: message {got} is {order[got]}, but rank {target} first receives "
                f"{counterpart(received[(source, target, kind)][got])}"
            )
