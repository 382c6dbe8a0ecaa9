"""``LandingLoan``: a graph's landing buffers sent as they are stay what each micro-batch sends, whether its send
comes after the next replay (copies first) or its copy is still in flight on the device (the replay waits)."""

from __future__ import annotations

import pytest
import torch

from ranks import needs_cuda

from pipecomm.runtime.landing_loan import LandingLoan


class _Event:
    """A read event that counts the waits on it."""

    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def test_the_next_write_copies_for_a_borrower_not_sent_and_waits_once_for_one_sent():
    copied = []
    loan = LandingLoan(copied.append)
    loan.lend("micro-batch 0")
    loan.before_write()
    assert copied == ["micro-batch 0"]
    event = _Event()
    loan.sent("micro-batch 0", lambda: pytest.fail("the copies were sent: nothing to wait for"))
    loan.lend("micro-batch 1")
    loan.sent("micro-batch 1", lambda: event)
    loan.before_write()
    loan.before_write()
    assert (copied, event.waits) == (["micro-batch 0"], 1)


def test_a_new_step_forgets_the_borrower_but_not_the_read_in_flight():
    loan = LandingLoan(lambda held: pytest.fail("a micro-batch of the step before was copied"))
    event = _Event()
    loan.lend("micro-batch 0")
    loan.sent("micro-batch 0", lambda: event)
    loan.lend("micro-batch 1")  # its step failed before the send
    loan.new_step()
    loan.before_write()
    assert event.waits == 1


@needs_cuda
def test_a_replay_waits_on_the_device_until_a_slow_send_has_read_the_buffer():
    """The send's copy held back on its stream (a busy copy engine): the next replay's write, launched at once by the
    host, must land after the copy has read the buffer."""
    landing = torch.ones(1 << 20, device="cuda")
    received = torch.empty_like(landing)
    channel_stream = torch.cuda.Stream()
    loan = LandingLoan(lambda held: pytest.fail("the micro-batch had sent"))
    loan.lend("micro-batch 0")
    channel_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(channel_stream):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
        received.copy_(landing)

    def read_event():
        event = torch.cuda.Event()
        event.record(channel_stream)
        return event

    loan.sent("micro-batch 0", read_event)
    loan.before_write()
    landing.fill_(2.0)  # the next replay
    torch.cuda.synchronize()
    assert torch.equal(received, torch.ones_like(received))
