"""Failing fast: a rank whose step fails says why through the job's store, and collectives wait no longer than the pipeline's timeout."""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist

__all__: list[str] = []

# Every rank builds its Pipelines in the same order, so the n-th one has the same number everywhere.
_pipeline_numbers = itertools.count()


class StepFailures:
    """One pipeline's failure notes: ``publish`` this rank's, read the others' with ``reasons``."""

    def __init__(self, global_ranks: list[int]):
        self.global_ranks = global_ranks
        self.prefix = f"pipecomm/pipeline/{next(_pipeline_numbers)}/failed"
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None

    def publish(self, global_rank: int, error: BaseException) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{global_rank}", describe(error))

    def reasons(self, global_rank: int) -> str:
        """What the other ranks published, e.g. 'rank 1 failed: RuntimeError: ...'; empty if none did."""
        if self.store is None:
            return ""
        found = []
        for rank in self.global_ranks:
            key = f"{self.prefix}/{rank}"
            if rank != global_rank and self.store.check([key]):
                found.append(f"rank {rank} failed: {self.store.get(key).decode()}")
        return "; ".join(found)


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def wait_collective(work: dist.Work, group: dist.ProcessGroup | None, timeout: float, what: str) -> None:
    """Waits for a collective: on gloo at most ``timeout`` seconds, then a TimeoutError naming ``what``.

    On NCCL the wait only orders the GPU's streams, the host does not block, and NCCL's watchdog bounds it.
    """
    if dist.get_backend(group) == "nccl":
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        raise TimeoutError(f"{what}: failed or not done after {timeout:g} s ({error})") from error
