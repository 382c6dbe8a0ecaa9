"""CUDA-graph stages: slot counts from the schedule, and replayed forwards/backwards equal to eager ones with several micro-batches in flight."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipecomm.cuda_graphs import GraphedStage, in_flight_slots
from pipecomm.schedule import make_schedule
from ranks import needs_cuda


@pytest.mark.parametrize(
    ("name", "ranks", "micro_batches", "virtual", "expected"),
    [
        ("1f1b", 2, 4, 1, {(0, 0): 2, (1, 1): 1}),
        ("1f1b", 4, 8, 1, {(0, 0): 4, (3, 3): 1}),
        ("gpipe", 2, 4, 1, {(0, 0): 4, (1, 1): 4}),
    ],
)
def test_slots_are_the_most_micro_batches_a_stage_holds(name, ranks, micro_batches, virtual, expected):
    schedule = make_schedule(name, ranks, micro_batches, virtual)
    for (rank, stage), slots in expected.items():
        assert in_flight_slots(schedule, rank, stage) == slots


def test_interleaved_slots_cover_every_chunk():
    schedule = make_schedule("interleaved-1f1b", 2, 4, 2)
    for rank in range(2):
        for stage in schedule.stages_of(rank):
            assert 1 <= in_flight_slots(schedule, rank, stage) <= 4


def test_a_split_backward_is_refused():
    with pytest.raises(ValueError, match="splits the backward into I and W"):
        in_flight_slots(make_schedule("zb-h1", 2, 4), 0, 0)


@needs_cuda
def test_replayed_stage_equals_eager_with_two_micro_batches_in_flight():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    graphed = GraphedStage(module, params, slots=2, stage=1, loss=None)
    xs = [torch.randn(4, 16, device="cuda", requires_grad=True) for _ in range(3)]  # received: they need grads
    grads = [torch.randn(4, 16, device="cuda") for _ in range(3)]

    outputs = {0: graphed.forward(0, (xs[0],), ())[0].clone(), 1: graphed.forward(1, (xs[1],), ())[0].clone()}
    input_grads, param_grads = {}, {}
    for micro_batch in (0, 1, 2):
        if micro_batch == 2:
            outputs[2] = graphed.forward(2, (xs[2],), ())[0].clone()  # reuses slot 0 after its backward
        got_input, got_params = graphed.backward(micro_batch, (grads[micro_batch],))
        input_grads[micro_batch] = got_input[0].clone()
        param_grads[micro_batch] = [g.clone() for g in got_params]
    assert all(p.grad is None for p in params), "replays leave .grad to the caller"

    for micro_batch in range(3):
        leaf = xs[micro_batch].clone().requires_grad_()
        expected = reference(leaf)
        expected_params = torch.autograd.grad(expected, [leaf, *reference.parameters()], grads[micro_batch])
        torch.testing.assert_close(outputs[micro_batch], expected)
        torch.testing.assert_close(input_grads[micro_batch], expected_params[0])
        for got, want in zip(param_grads[micro_batch], expected_params[1:]):
            torch.testing.assert_close(got, want)

    with pytest.raises(ValueError, match="captured for"):
        graphed.forward(0, (torch.randn(5, 16, device="cuda"),), ())
