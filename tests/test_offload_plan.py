"""plan_offload: which waits of a schedule's activations go to host memory, when they come back, and the peak left."""

from __future__ import annotations

import dataclasses
import random

import pytest

import pipecomm
from pipecomm.schedules import offload
from pipecomm.schedules.offload import check_plan, plan_offload

COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def plan_for(name: str, num_ranks: int, micro_batches: int, copy_time: float):
    schedule = pipecomm.make_schedule(name, num_ranks, micro_batches, 2 if name == "interleaved-1f1b" else None)
    simulated = pipecomm.simulate(schedule, COSTS)
    return schedule, simulated, plan_offload(schedule, simulated.timeline, copy_time, copy_time)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"])
@pytest.mark.parametrize("copy_time", [0.25, 1.0, 100.0])
def test_copies_fit_their_waits_and_come_back_before_the_pass_that_reads_them(name, copy_time):
    schedule, simulated, plan = plan_for(name, 4, 8, copy_time)
    assert plan.peak_memory_without == simulated.peak_memory
    for rank, actions in enumerate(schedule.actions):
        assert plan.peak_memory[rank] <= plan.peak_memory_without[rank]
        assert set(plan.reload_before[rank]) == plan.offloaded[rank]
        for (stage, micro_batch, saved_by), index in plan.reload_before[rank].items():
            kinds = {action.kind: position for position, action in enumerate(actions)
                     if (action.stage, action.micro_batch) == (stage, micro_batch) and action.is_compute}
            readers = ("B", "I") if saved_by == "F" else ("W",)
            reader = min(kinds[kind] for kind in readers if kind in kinds)
            # Started after the pass that saved it, and by the pass that reads it.
            assert kinds[saved_by] < index <= reader, (rank, stage, micro_batch, saved_by, index, actions)
    if copy_time == 100.0:  # no wait holds such copies
        assert plan.offloaded == (frozenset(),) * 4 and plan.peak_memory == plan.peak_memory_without


def test_offload_brings_1f1b_first_stage_and_zb_h2_below_1f1b_memory():
    _, _, plan = plan_for("1f1b", 4, 8, 0.5)
    assert plan.peak_memory_without[0] == 4 and plan.peak_memory[0] == 2
    assert (0, 0, "F") in plan.offloaded[0] and not any(stage == 3 for stage, _, _ in plan.offloaded[3])
    _, _, plan = plan_for("zb-h2", 4, 8, 0.5)
    assert max(plan.peak_memory_without) == 8 and max(plan.peak_memory) <= 4
    assert any(saved_by == "I" for waits in plan.offloaded for _, _, saved_by in waits)  # W's inputs wait too


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b"])
@pytest.mark.parametrize("copy_time", [0.25, 2.0, 3.0, 5.0])
def test_a_rank_offloads_only_what_lowers_its_peak(name, copy_time):
    # Copies that fit their waits but leave the peak where it was cost the link and the compute for nothing: at
    # copy_time 3.0 every 1f1b and zb-h2 rank had such copies (16 and 20 of them) and kept its peak.
    _, _, plan = plan_for(name, 4, 8, copy_time)
    for rank, waits in enumerate(plan.offloaded):
        assert not waits or plan.peak_memory[rank] < plan.peak_memory_without[rank], (rank, sorted(waits))


def test_reloads_are_grouped_by_the_action_they_start_before():
    schedule, _, plan = plan_for("1f1b", 4, 8, 0.5)
    starts = plan.reloads_at(0)
    assert sorted(wait for waits in starts.values() for wait in waits) == sorted(plan.offloaded[0])
    assert all(0 <= index < len(schedule.actions[0]) for index in starts)


def test_negative_copy_times_are_refused():
    schedule = pipecomm.make_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="copy times must be >= 0"):
        plan_offload(schedule, pipecomm.simulate(schedule).timeline, -1.0, 1.0)


def test_a_plan_that_does_not_fit_the_schedule_is_refused():
    schedule = pipecomm.make_schedule("1f1b", 2, 4)
    plan = plan_offload(schedule, pipecomm.simulate(schedule).timeline, 0.0, 0.0)
    check_plan(plan, schedule)
    wait = min(plan.offloaded[0])
    moved = dataclasses.replace(plan, reload_before=({**plan.reload_before[0], wait: 0}, plan.reload_before[1]))
    with pytest.raises(ValueError, match=r"starts the copy back of \(0, 0, 'F'\) on rank 0 before action 0"):
        check_plan(moved, schedule)
    with pytest.raises(ValueError, match="the offload plan is for 2 ranks, the schedule '1f1b' has 4"):
        check_plan(plan, pipecomm.make_schedule("1f1b", 4, 4))


def test_simulate_reports_the_peak_with_offload():
    schedule, simulated, plan = plan_for("1f1b", 4, 8, 0.5)
    assert simulated.peak_memory_offloaded is None
    assert pipecomm.simulate(schedule, COSTS, offload_times=(0.5, 0.5)).peak_memory_offloaded == plan.peak_memory


def _peak(held, share, away):
    """The most held at once, event by event (frees first at equal times)."""
    events = [(start, share) for start, _ in held] + [(end, -share) for _, end in held]
    events += [change for gone, back in away for change in ((gone, -share), (back, share))]
    live = peak = 0.0
    for _, change in sorted(events):
        live += change
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("seed", range(20))
def test_pruning_keeps_what_dropping_one_copy_at_a_time_would(seed):
    # The pruning answers each "does the peak need this copy?" with a range query over the memory profile; the
    # reference recounts the whole profile for every copy, as the planner did before (O(n^2) at m in the hundreds).
    rng = random.Random(seed)
    held = [(start, start + rng.choice([1.0, 2.0, 3.0, 5.0])) for start in (rng.randrange(60) for _ in range(40))]
    chosen = {}
    for index, (start, end) in enumerate(rng.sample(held, 30)):
        gone = start + rng.choice([0.0, 0.5, 1.0])
        chosen[(0, index, "F")] = (gone, max(gone, end - rng.choice([0.0, 0.5, 1.0])))
    share = rng.choice([1.0, 0.5])
    expected = dict(chosen)
    peak = _peak(held, share, expected.values())
    for wait in sorted(chosen, key=lambda wait: (chosen[wait][1] - chosen[wait][0], wait)):
        trial = {other: span for other, span in expected.items() if other != wait}
        if _peak(held, share, trial.values()) <= peak + 1e-9:
            expected = trial
    assert offload._lowering_the_peak(held, share, chosen) == expected
    assert offload._peak(held, share, chosen.values()) == peak
