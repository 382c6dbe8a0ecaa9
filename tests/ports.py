"""A free TCP port on this host, in a module that imports nothing heavy (tests/launcher.py must not touch CUDA)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
