"""The suite's shards (conftest's --shard): every test in exactly one, the shards about equally long."""

from __future__ import annotations

import pytest

from conftest import _parse_shard, balanced_shards


def test_without_durations_the_tests_are_dealt_round_robin():
    tests = [f"t{index}" for index in range(7)]
    assert balanced_shards(tests, 3, {}) == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]


def test_every_test_lands_in_one_shard_and_the_longest_are_spread():
    durations = {"long": 40.0, "longer": 50.0, **{f"short{index}": 1.0 for index in range(30)}}
    tests = [f"short{index}" for index in range(30)] + ["long", "longer", "unknown"]
    shards = balanced_shards(tests, 2, durations)
    assert sorted(test for shard in shards for test in shard) == sorted(tests)
    assert all(len({"long", "longer"} & set(shard)) == 1 for shard in shards)
    totals = [sum(durations.get(test, 1.0) for test in shard) for shard in shards]
    assert max(totals) - min(totals) <= 1.0, totals


def test_more_shards_than_tests_leaves_some_empty():
    assert balanced_shards(["a"], 3, {"a": 2.0}) == [["a"], [], []]


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b"])
def test_a_bad_shard_is_a_usage_error(text):
    with pytest.raises(pytest.UsageError):
        _parse_shard(text)
