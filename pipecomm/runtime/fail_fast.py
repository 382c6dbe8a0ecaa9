"""Each Pipeline call fails fast: refused after a failure, alone on its process, and on failure published to every peer."""

from __future__ import annotations

import atexit
import collections
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch.distributed as dist

from pipecomm.runtime import interrupts
from pipecomm.runtime.failure import (Collective, FailureNotes, PeerFailedError, describe, gather_through_store,
                                      next_pipeline_notes)
from pipecomm.transport.channel import ChannelError

__all__: list[str] = []


class CallProtocol:
    """One Pipeline's calls: ``call`` wraps each public call; ``fail`` publishes a failure and aborts everything."""

    def __init__(self, pipeline_rank: int, global_rank: int, stages: list[int], abort: Callable[[str], None],
                 ranks: Sequence[int] | None = None):
        self.pipeline_rank = pipeline_rank
        self.global_rank = global_rank
        self.stages = stages
        self.abort = abort  # closes the Pipeline's links at once, each peer told the reason; never raises
        self.notes = FailureNotes(ranks=ranks)  # the global ranks it works with (None: the whole job)
        self.failed: str | None = None  # the failure that closed the Pipeline
        self.closed = False
        self.completed: collections.Counter[str] = collections.Counter()  # calls that returned, by name

    @contextlib.contextmanager
    def call(self, action: str, look_up_failures: bool = False) -> Iterator[None]:
        """One public call: refused after a failure or close, refused while another thread is in a Pipeline call,
        and failing fast.

        Failures other ranks published are looked up in the store first only with ``look_up_failures``, for calls
        that might not wait on anything a failed peer stops (``trace``'s gather, an inference whose first stage only
        sends). Every other call (``step`` above all) waits in channels, which a failed peer aborts (or whose peer's
        death they see), and in the fail-fast collectives, which look for published failures while they wait: a
        peer's failure stops it within milliseconds, naming its cause, without a store round trip at every start.
        """
        self._check_usable(action)
        busy = _calls.enter(self.pipeline_rank, action)
        try:
            with self.failing(action):
                if busy:
                    raise RuntimeError(f"Pipeline rank {self.pipeline_rank}: {busy}")
                reasons = self.notes.reasons(self.global_rank) if look_up_failures else ""
                if reasons:
                    raise PeerFailedError(f"pipeline rank {self.pipeline_rank}: cannot {action}: {reasons}")
                yield
            self.completed[action] += 1
        finally:
            if not busy:
                _calls.leave()

    @contextlib.contextmanager
    def failing(self, action: str) -> Iterator[None]:
        """On a failure: this rank's cause published, or the cause another rank published named instead of a
        symptom; the links aborted so that peers waiting on them fail at once; the Pipeline closed."""
        try:
            yield
        except BaseException as error:
            explained = self.fail(action, error)
            if explained is error:
                raise
            raise explained from error

    def fail(self, action: str, error: BaseException) -> BaseException:
        """Publishes and aborts; returns the error to raise: ``error``, or a PeerFailedError naming the cause. Once
        failed (Ctrl-C's watcher thread fails the call it interrupts), the first cause stands."""
        if self.failed is not None:
            return error
        symptom = isinstance(error, (ChannelError, TimeoutError, PeerFailedError))
        reasons = self.notes.reasons(self.global_rank) if symptom else ""
        explained = error
        closed = self.notes.closed(self.global_rank) if isinstance(error, ChannelError) and not reasons else ""
        if closed:
            # A peer closed its Pipeline while this rank still called: the channel's error says only that it closed.
            explained = type(error)(f"{error} ({closed}; every rank must make the same calls, then close)")
        elif reasons and not isinstance(error, PeerFailedError):
            # A channel's error may already hold the reason (a peer's abort carries it): said once.
            explained = PeerFailedError(str(error) if reasons in str(error) else f"{error} ({reasons})")
        elif isinstance(error, ChannelError) and _PEER_ABORTED in str(error):
            # No note to read (the store's host died, taking the notes with it), but the peer's abort says why.
            explained = PeerFailedError(str(error))
        own = (f"rank {self.global_rank} (pipeline rank {self.pipeline_rank}, stages {self.stages}) failed in "
               f"{action}: {describe(error)}")
        if not reasons:
            self.notes.publish(self.global_rank, own)
        self.failed = describe(explained, limit=500)
        self.closed = True
        self.abort(_shortened(reasons or own))  # the original cause first: the shm and IPC channels carry 240 bytes
        return explained

    def closing(self) -> None:
        """The Pipeline is closed: said in the store (not as a failure), for a peer that still calls and meets the
        closed channels to say why."""
        made = ", ".join(f"{count} call{'s' * (count != 1)} of {action}"
                         for action, count in sorted(self.completed.items())) or "no calls"
        self.notes.publish_closed(self.global_rank, f"rank {self.global_rank} (pipeline rank {self.pipeline_rank}) "
                                                    f"closed its Pipeline after {made}")

    def exiting(self) -> None:
        """The process exits with the Pipeline open, outside its calls (the program's end, or sys.exit, which no
        excepthook sees): published before the links close, so that a peer still waiting on this rank says why
        rather than only that the channel closed."""
        if not (self.closed or self.failed):
            self.notes.publish(self.global_rank, f"rank {self.global_rank} (pipeline rank {self.pipeline_rank}, "
                                                 f"stages {self.stages}) exited with the Pipeline open, outside its "
                                                 "calls (the program ended or called sys.exit)")

    def peer_failures(self) -> str:
        """What other ranks published, for a wait that wants to stop once one has failed."""
        return self.notes.reasons(self.global_rank)

    def gather(self, value: object, what: str, timeout: float) -> list:
        """Every rank's picklable ``value``, in rank order: at most ``timeout``, and not once another rank failed."""
        return gather_through_store(self.notes, self.global_rank, value, what, timeout)

    def wait(self, collective: Collective, timeout: float) -> None:
        """Waits for one of the Pipeline's collectives: at most ``timeout``, and not once another rank failed."""
        collective.wait(timeout, self.notes, self.global_rank)

    def _check_usable(self, action: str) -> None:
        if self.failed is not None:
            raise RuntimeError(f"Pipeline rank {self.pipeline_rank}: cannot {action}: an earlier call failed and "
                               f"closed it ({self.failed}); build a new Pipeline")
        if self.closed:
            raise RuntimeError(f"Pipeline rank {self.pipeline_rank}: cannot {action}: it was closed")


# What the shared-memory and IPC channels add to the error of a peer that aborted with a reason (shm_ring.cpp).
_PEER_ABORTED = " (it aborted: "


def _shortened(text: str, limit: int = 240) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes, cut at a word ("...") rather than in one; the store holds it all."""
    if len(text.encode()) <= limit:
        return text
    cut = text.encode()[: limit - 3].decode(errors="ignore")
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."


class _CallGuard:
    """Which Pipeline call this process is in, so that an overlapping one (from another thread, or nested in it) is
    refused."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside: str = ""
        self._thread: threading.Thread | None = None  # the one inside

    def enter(self, pipeline_rank: int, action: str) -> str:
        """Empty if this call may go ahead; otherwise the call it overlaps."""
        if not self._lock.acquire(blocking=False):
            if self._thread is threading.current_thread():
                return (f"{action} was called inside another Pipeline call ({self._inside}), from its loss_fn, a "
                        "stage's forward or a hook: Pipeline calls cannot nest; make the inner call before or after")
            return (f"{action} called from thread {threading.current_thread().name!r} while "
                    f"{self._inside or 'another Pipeline call is running'}; Pipelines are not thread-safe: calls on "
                    "one process must not overlap")
        self._thread = threading.current_thread()
        self._inside = (f"thread {self._thread.name!r} is in {action} of the Pipeline of rank {pipeline_rank}")
        return ""

    def leave(self) -> None:
        self._inside, self._thread = "", None
        self._lock.release()

    def busy(self) -> bool:
        """Whether a Pipeline call is running on some thread of this process."""
        return bool(self._inside)


_calls = _CallGuard()


# -- the process's open Pipelines ------------------------------------------------------------------


class Closable(Protocol):
    calls: CallProtocol

    def close(self) -> None: ...


# Pipelines not closed yet: closed at exit, and told of an uncaught exception so that their peers hear of it.
_live: weakref.WeakSet = weakref.WeakSet()
_installed = False
_WORKER_GRACE_SECONDS = 0.05
_ran_on_several_ranks = False  # set by the first Pipeline of several ranks


def track(pipeline: Closable, several_ranks: bool) -> None:
    """``pipeline`` is open: closed when the interpreter exits, failed by an uncaught exception."""
    global _ran_on_several_ranks
    _live.add(pipeline)
    _ran_on_several_ranks = _ran_on_several_ranks or several_ranks
    install()


def install() -> None:
    """The exit handler and the excepthook, once per process (``pipecomm.init`` and every Pipeline call it): they
    fail the open Pipelines, and tell peers building this rank's next Pipeline that it will not come."""
    global _installed, _previous_excepthook
    if not _installed:
        _installed = True
        atexit.register(close_live_pipelines)
        _previous_excepthook = sys.excepthook
        sys.excepthook = _fail_live_pipelines
    interrupts.watch(_interrupt_calls)


def _interrupt_calls() -> None:
    """Ctrl-C while a Pipeline call waits: the open Pipelines fail (their peers told why), which wakes the wait; Python
    then raises KeyboardInterrupt as usual. Between calls nothing is done: the program may catch it and go on."""
    if not _calls.busy():
        return
    for pipe in list(_live):
        with contextlib.suppress(BaseException):
            pipe.calls.fail("a call interrupted by SIGINT (Ctrl-C)", KeyboardInterrupt())


def untrack(pipeline: Closable) -> None:
    _live.discard(pipeline)


def close_live_pipelines() -> None:
    """What the interpreter's exit does: every open Pipeline closed (its shared-memory files unlinked)."""
    for pipe in list(_live):
        with contextlib.suppress(Exception):
            if _ran_on_several_ranks:
                pipe.calls.exiting()
            pipe.close()
    _tell_next_pipeline("exited before building it (the program ended or called sys.exit)")
    if _ran_on_several_ranks:
        # A gloo worker thread drops its references to a finished collective's tensors after the collective
        # completes; dropping the last one needs the GIL, and a worker that asks for it once the interpreter is
        # finalizing aborts the process ("terminate called without an active exception", pytorch#190489). A
        # program's last collective (a metric's all-reduce, all_gather_object) may have finished just before it
        # exits: give the workers the GIL for a moment while the interpreter is still whole.
        time.sleep(_WORKER_GRACE_SECONDS)


_previous_excepthook = sys.excepthook


def _fail_live_pipelines(exc_type, exc_value, traceback) -> None:
    """An uncaught exception ends this process: its Pipelines fail first, so that their peers raise with its cause."""
    for pipe in list(_live):
        with contextlib.suppress(BaseException):
            pipe.calls.fail("the program (uncaught exception)", exc_value)
    _tell_next_pipeline(f"failed in the program before building it (uncaught exception): {describe(exc_value)}")
    _previous_excepthook(exc_type, exc_value, traceback)


def _tell_next_pipeline(what: str) -> None:
    """Peers building this rank's next Pipeline wait for it to connect: they stop at once, naming why it will not
    (the first reason only: an uncaught exception's, not the exit that follows it)."""
    if _told_next[0] or not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    _told_next[0] = True
    with contextlib.suppress(Exception):
        rank = dist.get_rank()
        next_pipeline_notes().publish(rank, f"rank {rank} {what}")


_told_next = [False]
