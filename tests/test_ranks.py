"""The multi-process harness itself: ranks forked from a server that imported torch once, each test's ranks fresh; a
failing rank is named with its traceback, a hanging one fails within the timeout, and the next test still runs."""

from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch.distributed as dist

from ranks import run_ranks

import pipecomm

_LEFT_BEHIND: list[int] = []  # a module global a test's rank sets: the next test's ranks must not see it


def report_rank(rank: int, world_size: int) -> tuple:
    _LEFT_BEHIND.append(rank)
    return rank, world_size, dist.get_world_size(), len(_LEFT_BEHIND), "transformers" in sys.modules


def test_each_test_gets_fresh_ranks_that_imported_torch_and_transformers_once(tmp_path):
    for _ in range(2):
        # The second call's ranks see nothing of the first's; transformers is there without this module importing it.
        assert run_ranks(3, report_rank, tmp_path) == [(rank, 3, 3, 1, True) for rank in range(3)]


def fail_on_rank_one(rank: int, world_size: int, *prepared) -> str:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return "fine"


def hang_on_rank_zero(rank: int, world_size: int, *prepared) -> str:
    if rank == 0:
        if prepared:  # the pid file named by what was prepared
            with open(prepared[0], "w") as file:
                file.write(str(os.getpid()))
        time.sleep(3600)
    return "fine"


def exit_on_rank_zero(rank: int, world_size: int, *prepared) -> str:
    if rank == 0:
        os._exit(3)
    return "fine"


def test_a_failing_rank_is_named_with_its_traceback_and_the_next_test_runs(tmp_path):
    with pytest.raises(AssertionError, match=r"rank 1 failed:\n(.|\n)*in fail_on_rank_one(.|\n)*rank 1 fails on purpose"):
        run_ranks(2, fail_on_rank_one, tmp_path)
    assert run_ranks(2, report_rank, tmp_path) == [(rank, 2, 2, 1, True) for rank in range(2)]


def fail_then_report(rank: int, world_size: int) -> str:
    """Rank 1 reports its peer's failure at once; rank 0, whose own error it is, a moment later."""
    if rank == 1:
        raise pipecomm.PeerFailedError("rank 0 failed in step: the cause")
    time.sleep(0.3)
    raise ValueError("the cause")


def test_the_rank_whose_own_error_it_is_comes_first_though_reported_later(tmp_path):
    with pytest.raises(AssertionError, match=r"^rank 0 failed:\n(.|\n)*ValueError: the cause(.|\n)*rank 1 failed"):
        run_ranks(2, fail_then_report, tmp_path)


def test_a_hanging_rank_fails_the_test_and_the_next_test_runs(tmp_path):
    with pytest.raises(AssertionError, match=r"ranks \[0\] gave no result within 2 s \(hang\?\)"):
        run_ranks(2, hang_on_rank_zero, tmp_path, timeout=2)
    assert run_ranks(2, report_rank, tmp_path) == [(rank, 2, 2, 1, True) for rank in range(2)]


def test_a_rank_that_exits_fails_the_test_unless_allowed_to(tmp_path):
    with pytest.raises(AssertionError, match="rank 0 exited with code 3 without a result"):
        run_ranks(2, exit_on_rank_zero, tmp_path)
    assert run_ranks(2, exit_on_rank_zero, tmp_path, may_exit=frozenset({0})) == [3, "fine"]


def prepared_once() -> tuple:
    return os.getpid(), []


def report_prepared(rank: int, world_size: int, prepared: tuple) -> tuple:
    pid, ranks = prepared
    ranks.append(rank)  # its own copy: no other rank's entry in it
    return pid == os.getppid(), ranks


def fail_to_prepare() -> None:
    raise KeyError("nothing to prepare")


def test_prepared_ranks_are_forked_from_the_process_that_prepared_once(tmp_path):
    assert run_ranks(3, report_prepared, tmp_path, prepare=prepared_once) == [(True, [rank]) for rank in range(3)]


def test_prepared_ranks_fail_hang_and_exit_as_the_others_do(tmp_path):
    with pytest.raises(AssertionError, match=r"rank 1 failed:\n(.|\n)*rank 1 fails on purpose"):
        run_ranks(2, fail_on_rank_one, tmp_path, prepare=int)
    pid_file = tmp_path / "hanging.pid"
    with pytest.raises(AssertionError, match=r"ranks \[0\] gave no result within 2 s \(hang\?\)"):
        run_ranks(2, hang_on_rank_zero, tmp_path, timeout=2, prepare=functools.partial(str, pid_file))
    assert _gone(int(pid_file.read_text())), "the hanging rank outlived its test"
    with pytest.raises(AssertionError, match="rank 0 exited with code 3 without a result"):
        run_ranks(2, exit_on_rank_zero, tmp_path, prepare=int)
    assert run_ranks(2, exit_on_rank_zero, tmp_path, may_exit=frozenset({0}), prepare=int) == [3, "fine"]
    with pytest.raises(AssertionError, match=r"prepare failed:\n(.|\n)*nothing to prepare"):
        run_ranks(2, report_prepared, tmp_path, prepare=fail_to_prepare)


def _gone(pid: int) -> bool:
    """Whether the process ended (a zombie awaiting its reaper counts: it never runs again), within 5 s."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
