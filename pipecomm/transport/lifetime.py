"""Objects kept alive until the process ends, for backends whose native threads may still use them at exit."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

__all__ = ["keep_forever"]


def keep_forever(objects: Sequence) -> None:
    """Keeps objects alive until the process ends, never destroyed: the tensors of a collective or send left
    running, or a process group, which a gloo worker or the interpreter's finalization would otherwise free at
    a moment that aborts the process (a worker holds no GIL; a group destroyed late joins its own threads)."""
    for item in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))
