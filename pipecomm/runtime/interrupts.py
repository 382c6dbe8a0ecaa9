"""Ctrl-C during a Pipeline call: its channels wait in native code, where Python's SIGINT handler cannot run until the
wait ends (up to the timeout); a watcher thread hears the signal and fails the call's Pipelines, which ends the wait."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable

__all__: list[str] = []

_tried = [False]


def watch(interrupt: Callable[[], None]) -> None:
    """Once per process, from the main thread: ``interrupt`` runs on another thread at every SIGINT while Python's own
    handler (KeyboardInterrupt) is the one installed. Nothing is installed where someone else already listens through
    ``signal.set_wakeup_fd`` (asyncio's event loop does), or off the main thread, which cannot set it."""
    if _tried[0] or threading.current_thread() is not threading.main_thread():
        return
    _tried[0] = True
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return
    threading.Thread(target=_listen, args=(reader, writer, interrupt), name="pipecomm-sigint", daemon=True).start()


def _listen(reader: socket.socket, writer: socket.socket, interrupt: Callable[[], None]) -> None:
    # ``writer`` stays referenced here: Python writes each signal's number into it.
    while True:
        received = reader.recv(64)
        if not received:
            return
        if signal.SIGINT in received and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            interrupt()
