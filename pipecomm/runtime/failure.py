"""Failing fast: a rank whose call fails publishes why through the job's store, and every collective around the pipeline stops waiting once one has."""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from pipecomm.parallel.backend import uses_nccl
from pipecomm.transport.channel import PeerDiedError
from pipecomm.transport.lifetime import keep_forever

__all__ = ["PeerFailedError"]

# Every rank builds its Pipelines in the same order, so the n-th one has the same number everywhere: how many this
# process has begun to build.
_pipelines_begun = [0]

# How often a rank waiting in a collective looks for failures published by other ranks.
POLL_SECONDS = 0.1
# How long a finished collective may take to drop its tensors on gloo's worker thread (see Collective.wait).
_RELEASE_SECONDS = 0.5


class PeerFailedError(RuntimeError):
    """This rank's call cannot go on because another rank's failed; the message holds that rank's error."""


class FailureNotes:
    """The failure notes of the n-th Pipeline of every rank in the job: ``publish`` this rank's, look for those of
    the ranks it works with (``ranks``, global; None: all), so that a Pipeline over other ranks (another model, its
    n-th too) fails apart.

    A note is a key per failed rank plus a counter, so that looking costs one store round trip. The
    store may be gone (its host process died): then nothing is published or found, and nothing raises.
    """

    def __init__(self, number: int | None = None, ranks: Sequence[int] | None = None):
        """The notes of a new Pipeline, or with ``number``, of the Pipeline of that number."""
        if number is None:
            number = _pipelines_begun[0]
            _pipelines_begun[0] += 1
        self.prefix = f"pipecomm/pipeline/{number}"
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()
                                                                         if dist.is_initialized() else 1))
        self.gathers = 0  # ``gather_through_store``'s calls so far, which number its keys

    def publish(self, global_rank: int, text: str) -> bool:
        """Records this rank's failure; False where the store cannot be reached."""
        if self.store is None:
            return False
        try:
            self.store.set(f"{self.prefix}/failed/{global_rank}", text)
            self.store.add(f"{self.prefix}/failures", 1)
        except Exception:  # noqa: BLE001 - the store's host is gone: the local error stands alone
            return False
        return True

    def publish_closed(self, global_rank: int, text: str) -> None:
        """Records that this rank closed its Pipeline: not a failure, so no wait stops for it (``closed`` reads it)."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/closed/{global_rank}", text)
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to say it to
            pass

    def closed(self, global_rank: int) -> str:
        """What the other ranks that closed their Pipelines said (``publish_closed``); empty if none did."""
        return self._read("closed", global_rank, self.ranks)

    def any(self) -> bool:
        if self.store is None:
            return False
        try:
            return self.store.add(f"{self.prefix}/failures", 0) > 0
        except Exception:  # noqa: BLE001 - an unreachable store tells nothing; the wait's own bounds hold
            return False

    def reasons(self, global_rank: int, among: Sequence[int] | None = None) -> str:
        """What the other ranks (of ``among`` only, if given) published, e.g. 'rank 1 failed in step: ValueError:
        ...'; empty if none did."""
        if not self.any():
            return ""
        return self._read("failed", global_rank, self.ranks if among is None else among)

    def _read(self, kind: str, global_rank: int, ranks: Sequence[int]) -> str:
        """The notes of ``kind`` that ``ranks`` but this one left, joined."""
        if self.store is None:
            return ""
        found = []
        try:
            for rank in ranks:
                key = f"{self.prefix}/{kind}/{rank}"
                if rank != global_rank and self.store.check([key]):
                    found.append(self.store.get(key).decode())
        except Exception:  # noqa: BLE001 - report what could be read
            pass
        return "; ".join(found)


def next_pipeline_notes() -> FailureNotes:
    """The notes of the Pipeline this process would build next, which its peers may be building (and waiting in for
    this rank) now."""
    return FailureNotes(_pipelines_begun[0])


# Leads the notes pipecomm adds to an error raised inside a step (where it came from), which ``describe`` puts first.
NOTE_PREFIX = "pipecomm: "


def describe(error: BaseException, limit: int = 4000) -> str:
    """An error as one line for other ranks' messages: where in the step it came from, if noted, its type and text."""
    said = " ".join(str(error).split())
    text = f"{type(error).__name__}: {said}" if said else type(error).__name__
    where = [note[len(NOTE_PREFIX):] for note in getattr(error, "__notes__", ()) if note.startswith(NOTE_PREFIX)]
    if where:
        text = f"{'; '.join(where)}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Collective:
    """An asynchronous collective of the pipeline: started at once, waited in slices that look for other ranks' failures.

    Waiting also makes sure gloo's worker thread has let go of the tensors before they go back to
    Python: a worker that drops the last reference to a tensor with a Python object needs the GIL,
    and if the interpreter is finalizing by then, the process aborts ("terminate called without an
    active exception").
    """

    def __init__(self, start: Callable[[], dist.Work], tensors: Sequence[torch.Tensor], group, what: str):
        self.tensors = list(tensors)
        self.group = group
        self.what = what
        self.baselines = [tensor._use_count() for tensor in self.tensors]
        self.work = start()

    @classmethod
    def all_reduce(cls, tensor: torch.Tensor, group, what: str, timeout: float,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> Collective:
        """``tensor`` all-reduced in place over ``group`` (None: the default one), started (``_gloo_timeout``)."""
        if tensor.is_cuda:
            return cls(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), [tensor], group, what)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        options.timeout = _gloo_timeout(timeout)
        return cls(lambda: _process_group(group).allreduce([tensor], options), [tensor], group, what)

    @classmethod
    def broadcast(cls, tensor: torch.Tensor, source: int, group, what: str, timeout: float) -> Collective:
        """``tensor`` broadcast from global rank ``source`` over ``group``, started (``_gloo_timeout``)."""
        if tensor.is_cuda:
            return cls(lambda: dist.broadcast(tensor, src=source, group=group, async_op=True), [tensor], group, what)
        process_group = _process_group(group)
        options = dist.BroadcastOptions()
        options.rootRank = dist.get_group_rank(process_group, source)
        options.rootTensor = 0
        options.timeout = _gloo_timeout(timeout)
        return cls(lambda: process_group.broadcast([tensor], options), [tensor], group, what)

    def wait(self, timeout: float, notes: FailureNotes | None, global_rank: int) -> None:
        work, self.work = self.work, None
        if uses_nccl(self.group) and any(tensor.is_cuda for tensor in self.tensors):
            work.wait()  # orders the streams only; NCCL's watchdog bounds it
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                # At least a millisecond: a zero timeout means none to torch.distributed.
                work.wait(datetime.timedelta(seconds=max(0.001, min(POLL_SECONDS, deadline - time.monotonic()))))
                break
            except RuntimeError:
                if work.is_completed():
                    # Done since the slice ran out, or failed (gloo lost a peer): waiting again says which.
                    try:
                        work.wait()
                        break
                    except RuntimeError as error:
                        raise _peer_error(self.what, error, notes, global_rank) from error
                reasons = notes.reasons(global_rank) if notes is not None else ""
                if reasons or time.monotonic() >= deadline:
                    keep_forever(self.tensors)
                    if reasons:
                        raise PeerFailedError(f"{self.what}: {reasons}") from None
                    raise TimeoutError(f"{self.what}: not done after {timeout:g} s") from None
        del work
        self._release()

    def _release(self) -> None:
        give_up = time.monotonic() + _RELEASE_SECONDS
        for tensor, baseline in zip(self.tensors, self.baselines):
            while tensor._use_count() > baseline and time.monotonic() < give_up:
                time.sleep(0.0001)


class CollectiveWaiter(Protocol):
    """What waits for a Pipeline's collectives (``PipelineCollectives``): at most ``timeout`` seconds each."""

    timeout: float

    def wait(self, collective: Collective) -> None: ...


_GLOO_SLACK_SECONDS = 5.0


def _gloo_timeout(timeout: float) -> datetime.timedelta:
    """A gloo collective's own timeout: a little after the wait's, which gives up first and says why. Without one, the
    process group's (30 minutes by default) holds gloo's worker thread, and a process whose wait gave up on a silent
    peer then hangs at exit for that long, joining it."""
    return datetime.timedelta(seconds=timeout + _GLOO_SLACK_SECONDS)


def _process_group(group) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def gather_through_store(notes: FailureNotes, global_rank: int, value: object, what: str, timeout: float) -> list:
    """Every rank's picklable ``value``, in rank order, through the store the notes live in: a wait that another
    rank's failure note ends at once and ``timeout`` bounds, where ``dist.all_gather_object`` waited, for the process
    group's timeout (30 minutes over gloo), on a rank that had raised while building its Pipeline. The keys are the
    notes' own (the n-th Pipeline's on every rank), numbered by call."""
    store, world = notes.store, dist.get_world_size()
    keys = [f"{notes.prefix}/gathered/{notes.gathers}/{rank}" for rank in range(world)]
    notes.gathers += 1
    deadline = time.monotonic() + timeout
    try:
        store.set(keys[global_rank], pickle.dumps(value))
        pause = 0.001
        # Polled with check, not waited for in slices: a TCPStore logs two warnings at each wait that times out.
        while not store.check(keys):
            if notes.any():
                # Only the ranks yet to give theirs: one that gave it and failed later (in its first step, while
                # this rank is still building) is heard of where this rank next waits on it.
                reasons = notes.reasons(global_rank, among=_missing(store, keys))
                if reasons:
                    raise PeerFailedError(f"rank {global_rank}: {what}: {reasons}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {global_rank}: {what}: ranks {_missing(store, keys)} gave theirs not "
                                   f"within {timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_SECONDS)
        # One round trip for all (multi_get), not one per rank: a job of a thousand ranks would make a million.
        values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(key) for key in keys]
        return [pickle.loads(value) for value in values]
    except dist.DistNetworkError as error:
        raise PeerDiedError(f"rank {global_rank}: {what}: the process hosting torch.distributed's store died "
                            f"({' '.join(str(error).split())[:200]})") from None


def _missing(store: dist.Store, keys: list[str]) -> list[int]:
    return [rank for rank, key in enumerate(keys) if not store.check([key])]


def _peer_error(what: str, error: RuntimeError, notes: FailureNotes | None, global_rank: int) -> Exception:
    reasons = notes.reasons(global_rank) if notes is not None else ""
    if reasons:
        return PeerFailedError(f"{what}: {reasons}")
    text = " ".join(str(error).split())
    if "closed by peer" in text or "Connection reset" in text:
        return PeerDiedError(f"{what}: a process of the collective died ({text})")
    return RuntimeError(f"{what}: failed: {text}")
