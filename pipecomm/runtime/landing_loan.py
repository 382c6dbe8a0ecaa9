"""A CUDA graph's landing buffers lent to a send instead of copied for it, and taken back before a replay."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__: list[str] = []


class LandingLoan:
    """One set of a stage's landing buffers (a forward's outputs, or a backward's input gradients) that a micro-batch
    sends as they are. The next replay writing the set must not change what a send has not read yet: before it
    (``before_write``), a micro-batch that has not sent them yet gets copies (``copy_out``), and once sent, the
    replay's stream waits on the device until the send has read them; the host goes on. A copy per send would
    cost as much memory as its copies in flight, which a host running ahead makes many."""

    def __init__(self, copy_out: Callable[[object], None]):
        self._copy_out = copy_out  # gives the borrower copies of what it holds of the buffers
        self._borrower: object | None = None  # holds the buffers themselves and has not sent them yet
        self._read: torch.cuda.Event | None = None  # after it, the last send from the buffers has read them

    def new_step(self) -> None:
        """The last step's micro-batches are gone (one that failed may not have sent); a send still being read is
        still waited for."""
        self._borrower = None

    def lend(self, borrower: object) -> None:
        """``borrower`` (after the replay that wrote the buffers) holds them themselves, for its send."""
        self._borrower = borrower

    def sent(self, borrower: object, read_event: Callable[[], torch.cuda.Event | None]) -> None:
        """``borrower`` sent what it held (``Channel.send_read_event`` gives ``read_event``)."""
        if borrower is self._borrower:  # else it sent the copies it was given
            self._borrower = None
            self._read = read_event()

    def before_write(self) -> None:
        """Before a replay that writes the buffers, on the stream it runs on."""
        if self._borrower is not None:
            self._copy_out(self._borrower)
            self._borrower = None
        if self._read is not None:
            self._read.wait()
            self._read = None
