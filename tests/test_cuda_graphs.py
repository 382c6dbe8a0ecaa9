"""CUDA-graph stages: slot counts from the schedule, and replayed forwards/backwards equal to eager ones with several micro-batches in flight."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from pipecomm.runtime.cuda_graphs import GraphedStage, in_flight_slots
from pipecomm.schedules.schedule import make_schedule
from pipecomm.runtime.split_backward import WeightGradStore, defer_linear_weight_grads
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


@pytest.mark.parametrize(("name", "virtual"), [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
def test_split_backwards_hold_a_slot_from_forward_to_weight_pass(name, virtual):
    schedule = make_schedule(name, 2, 4, virtual)
    for rank in range(2):
        for stage in schedule.stages_of(rank):
            held = most = 0
            for action in schedule.actions[rank]:
                if action.stage == stage and action.kind in "FW":
                    held += 1 if action.kind == "F" else -1
                    most = max(most, held)
            assert in_flight_slots(schedule, rank, stage) == most >= 1


def test_passes_out_of_forward_order_are_refused():
    schedule = make_schedule("zb-h1", 2, 4)
    actions = list(schedule.actions[0])
    weights = [index for index, action in enumerate(actions) if action.kind == "W"]
    actions[weights[0]], actions[weights[1]] = actions[weights[1]], actions[weights[0]]
    swapped = dataclasses.replace(schedule, actions=(tuple(actions), *schedule.actions[1:]))
    with pytest.raises(ValueError, match="W passes out of forward order"):
        in_flight_slots(swapped, 0, 0)


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


@needs_cuda
def test_split_backward_replays_equal_eager_input_and_weight_gradients():
    """I then W replays, two micro-batches in flight, against autograd: the weight of a Linear run twice adds both
    uses, a frozen Linear gets none, and a bias (not deferred) comes from I."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 16)
            self.frozen = nn.Linear(16, 16).requires_grad_(False)
            self.out = nn.Linear(16, 8)

        def forward(self, x):
            return self.out(torch.tanh(self.inner(self.frozen(self.inner(x)))))

    torch.manual_seed(0)
    module = Twice().cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    store = WeightGradStore()
    defer_linear_weight_grads([module], store)
    graphed = GraphedStage(module, params, slots=2, stage=1, loss=None, weight_grad_store=store)
    xs = [torch.randn(4, 16, device="cuda", requires_grad=True) for _ in range(2)]
    grads = [torch.randn(4, 8, device="cuda") for _ in range(2)]
    for micro_batch in (0, 1):
        graphed.forward(micro_batch, (xs[micro_batch],), ())
    for micro_batch in (0, 1):
        input_grads, from_input_pass = graphed.backward(micro_batch, (grads[micro_batch],))
        input_grad, from_input_pass = input_grads[0].clone(), [g if g is None else g.clone() for g in from_input_pass]
        from_weight_pass = graphed.backward_weights(micro_batch)
        leaf = xs[micro_batch].detach().clone().requires_grad_()
        trainable = [p for p in reference.parameters() if p.requires_grad]
        expected = torch.autograd.grad(reference(leaf), [leaf, *trainable], grads[micro_batch])
        torch.testing.assert_close(input_grad, expected[0])
        expected_params = iter(expected[1:])
        for param, early, late in zip(params, from_input_pass, from_weight_pass):
            if not param.requires_grad:
                assert early is None and late is None
                continue
            deferred = param.dim() == 2  # the Linear weights; biases come with the input gradients
            assert (early is None) == deferred and (late is None) != deferred
            torch.testing.assert_close(late if deferred else early, next(expected_params))
