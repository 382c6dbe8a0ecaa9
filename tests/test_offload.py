"""Activation offload: every schedule trains as one process does while saved activations wait in host memory."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from equivalence import float_batch, mse, train_like_one_process
from models import Block
from ranks import needs_cuda, run_ranks

import pipecomm
from pipecomm.runtime import offload as runtime_offload
from pipecomm.runtime import offload_planner
from pipecomm.runtime.offload import ActivationOffloader
from pipecomm.schedules.offload import OffloadPlan, check_plan, plan_offload
from pipecomm.schedules.schedule import Schedule


def blocks(num_stages: int) -> list[nn.Module]:
    return [nn.Sequential(Block(), Block()) for _ in range(num_stages)]


def counting_copies() -> list[int]:
    """How many tensors ActivationOffloader.offload copies out on this rank, from now on."""
    copied = [0]
    original = ActivationOffloader.offload

    def offload(self, wait):
        copies = self._waits.get(wait)
        if copies is not None and not copies.offloaded and not self.measure_only:
            copied[0] += len(copies.parked)
        original(self, wait)

    ActivationOffloader.offload = offload
    return copied


def offload_trains_exactly(rank: int, world_size: int, kind: str, recompute: bool) -> int:
    # Copies that take no time fit every wait: every micro-batch's activations go to host memory and back, the
    # test model's small ones too (on a GPU, tensors under 64 KiB stay).
    offload_planner.copy_speeds = lambda device: (math.inf, math.inf)
    runtime_offload._MIN_CUDA_BYTES = 0
    copied = counting_copies()
    train_like_one_process(rank, world_size, blocks, float_batch, mse, steps=4, kind=kind, offload=True,
                           recompute=recompute)
    return copied[0]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_every_schedule_trains_exactly_with_activations_in_host_memory(tmp_path, kind, recompute):
    copied = run_ranks(2, offload_trains_exactly, tmp_path, kind, recompute, timeout=240)
    assert all(count > 0 for count in copied), copied  # every rank's offloaded waits held tensors


def tanh_ended(num_stages: int) -> list[nn.Module]:
    """Stages whose last op saves its own output for the backward (tanh), the output their send may free."""
    return [nn.Sequential(Block(), nn.Tanh()) for _ in range(num_stages)]


def measured_with_saved_outputs(rank: int, world_size: int) -> str:
    train_like_one_process(rank, world_size, tanh_ended, float_batch, mse, steps=3, offload=True)
    return "ok"


def test_an_output_autograd_saved_stays_while_offload_measures(tmp_path):
    """offload=True's first step parks what the forwards save without copying it, so the backward reads the saved
    output itself: the send must not free its data (every schedule; the gradients were garbage before)."""
    assert run_ranks(2, measured_with_saved_outputs, tmp_path, timeout=240) == ["ok", "ok"]


def every_wait_offloaded(schedule: Schedule) -> OffloadPlan:
    """A plan for ``schedule`` that sends every wait to host memory, each copied back right before the pass that reads
    it: the forward's saved activations and the W pass's inputs, whether or not the peak needs them away (which
    ``plan_offload`` would ask)."""
    offloaded, reload_before = [], []
    for actions in schedule.actions:
        position = {(action.stage, action.micro_batch, action.kind): index for index, action in enumerate(actions)
                    if action.is_compute}
        reader = {}
        for stage, micro_batch, kind in position:
            if kind == "F":
                reader[(stage, micro_batch, "F")] = min(position[(stage, micro_batch, reads)] for reads in ("B", "I")
                                                        if (stage, micro_batch, reads) in position)
            elif kind == "I" and (stage, micro_batch, "W") in position:
                reader[(stage, micro_batch, "I")] = position[(stage, micro_batch, "W")]
        offloaded.append(frozenset(reader))
        reload_before.append(reader)
    plan = dataclasses.replace(plan_offload(schedule, pipecomm.simulate(schedule).timeline, 0.0, 0.0),
                               offloaded=tuple(offloaded), reload_before=tuple(reload_before))
    check_plan(plan, schedule)
    return plan


def planned_offload(rank: int, world_size: int, name: str, chunks: int) -> tuple:
    """A plan made before the Pipeline, for its schedule, with the W pass's inputs waiting too (zero-bubble)."""
    schedule = pipecomm.make_schedule(name, world_size, 4, chunks if chunks > 1 else None)
    plan = every_wait_offloaded(schedule)
    copied = counting_copies()
    train_like_one_process(rank, world_size, blocks, float_batch, mse, schedules=[(name, chunks)], offload=plan)
    return copied[0], sorted({saved_by for _, _, saved_by in plan.offloaded[rank]})


@pytest.mark.parametrize("name, chunks", [("zb-h2", 1), ("zb-v", 2)])
def test_a_given_plan_offloads_the_w_pass_inputs_too(tmp_path, name, chunks):
    for copied, saved_by in run_ranks(2, planned_offload, tmp_path, name, chunks):
        assert copied > 0 and saved_by == ["F", "I"]


def refused(rank: int, world_size: int) -> str:
    stage = nn.Linear(4, 4)
    common = dict(stage=rank, num_stages=2, loss_fn=mse, micro_batches=4, timeout=30)
    with pytest.raises(ValueError, match="offload must be True, False or a pipecomm OffloadPlan"):
        pipecomm.Pipeline(stage, offload="yes", **common)
    other = pipecomm.make_schedule("1f1b", 3, 4)
    plan = plan_offload(other, pipecomm.simulate(other).timeline, 0.0, 0.0)
    with pytest.raises(ValueError, match="an OffloadPlan is for one schedule"):
        pipecomm.Pipeline(stage, offload=plan, schedule="auto", **common)
    with pytest.raises(ValueError, match="the offload plan is for 3 ranks, the schedule '1f1b' has 2"):
        pipecomm.Pipeline(stage, offload=plan, **common)
    return "ok"


def test_bad_offload_options_are_clear_errors(tmp_path):
    run_ranks(2, refused, tmp_path)


def test_offload_with_cuda_graphs_is_refused():
    with pytest.raises(ValueError, match="offload cannot be combined with cuda_graphs=True"):
        pipecomm.Pipeline(nn.Linear(4, 4), stage=0, num_stages=1, loss_fn=mse, micro_batches=2, offload=True,
                          cuda_graphs=True)



def auto_offloads(rank: int, world_size: int) -> tuple:
    offload_planner.copy_speeds = lambda device: (math.inf, math.inf)
    copied = counting_copies()
    train_like_one_process(rank, world_size, blocks, float_batch, mse, schedules=[("auto", 1)], steps=10,
                           offload=True)
    return copied[0]


def test_auto_measures_what_waits_and_tries_every_schedule_offloaded(tmp_path):
    # The three measured steps count the bytes; the plan's and 1f1b's trials, and the schedule kept, offload.
    assert all(copied > 0 for copied in run_ranks(2, auto_offloads, tmp_path, timeout=180))


def test_an_inplace_change_to_a_saved_tensor_is_refused_as_autograd_refuses_it():
    def forward(x):
        y = x * 2
        z = y.sin()  # saves y
        y.add_(1)  # autograd's version check refuses the backward; hooks alone would carry the change into it
        return z

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward(x).sum().backward()
    offloader = ActivationOffloader(torch.device("cpu"), [(0, 0, "F")], [])
    with offloader.saving((0, 0, "F")):
        forward(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation after the forward saved it"):
        offloader.offload((0, 0, "F"))
