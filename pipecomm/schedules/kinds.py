"""The kinds of action a schedule is made of, and their groups (beneath schedule.py, as the timing kernel needs)."""

from __future__ import annotations

import enum

__all__ = ["COMMUNICATION_KINDS", "COMPUTE_KINDS", "FORWARD_KINDS", "Kind"]


class Kind(str, enum.Enum):
    """What an action does (``Action`` tells each). A kind is the string of its name: it equals and hashes as that
    string, so that "F" works wherever Kind.F does (as a ``costs`` key, in comparisons), and arrays encode it by its
    place in this order."""

    F = "F"
    B = "B"
    I = "I"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # str's own, not Enum's "Kind.F": actions print, format and repr as they did when kinds were plain strings
    # (enum.StrEnum, Python 3.11 on, would do the first two but keep Enum's repr).
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


COMPUTE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)
COMMUNICATION_KINDS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
FORWARD_KINDS = (Kind.F, Kind.SEND_F, Kind.RECV_F)
