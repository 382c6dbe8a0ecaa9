"""CUDA-graph stages: slot counts from the schedule, and replayed forwards/backwards equal to eager ones with several micro-batches in flight."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from pipecomm.runtime.cuda_graphs import GraphedStage, in_flight_slots
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.graph_gradients import GradientAccumulators
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
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), slots=2, stage=1, loss=None)
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


class Twice(nn.Module):
    """A Linear run twice, a frozen one between, and one more."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(self.frozen(self.inner(x)))))


@needs_cuda
def test_split_backward_replays_equal_eager_input_and_weight_gradients():
    """I then W replays, two micro-batches in flight, against autograd: the weight of a Linear run twice adds both
    uses, a frozen Linear gets none, and a bias (not deferred) comes from I."""
    torch.manual_seed(0)
    module = Twice().cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    store = WeightGradStore()
    defer_linear_weight_grads([module], store)
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), slots=2, stage=1, loss=None,
                           weight_grad_store=store)
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


@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["whole backward", "I and W"])
def test_replays_add_the_parameter_gradients_into_grad_in_place(split):
    """With accumulators, each replayed backward adds its parameter gradients into ``.grad`` (an accumulator's alias,
    the same memory the whole time), in eager's order, onto what the caller left there before the capture; a frozen
    parameter gets none. Three micro-batches through two slots, the third reusing the first slot."""
    torch.manual_seed(0)
    module = Twice().cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    store = WeightGradStore() if split else None
    if split:
        defer_linear_weight_grads([module], store)
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), slots=2, stage=1, loss=None,
                           weight_grad_store=store, accumulators=GradientAccumulators())
    module.out.bias.grad = torch.ones(8, device="cuda")  # an earlier step's, not zeroed
    reference.out.bias.grad = torch.ones(8, device="cuda")
    xs = [torch.randn(4, 16, device="cuda", requires_grad=True) for _ in range(3)]
    grads = [torch.randn(4, 8, device="cuda") for _ in range(3)]
    input_grads = {}

    def backward(micro_batch):
        got_inputs, got_params = graphed.backward(micro_batch, (grads[micro_batch],))
        assert got_params is None
        if split:
            assert graphed.backward_weights(micro_batch) is None
        input_grads[micro_batch] = got_inputs[0].clone()

    graphed.forward(0, (xs[0],), ())
    graphed.forward(1, (xs[1],), ())
    bound = [p.grad for p in params]
    backward(0)
    graphed.forward(2, (xs[2],), ())
    backward(1)
    backward(2)

    for micro_batch in range(3):
        leaf = xs[micro_batch].detach().clone().requires_grad_()
        reference(leaf).backward(grads[micro_batch])
        torch.testing.assert_close(input_grads[micro_batch], leaf.grad)
    for param, ref, before in zip(params, reference.parameters(), bound):
        if not param.requires_grad:
            assert param.grad is None
            continue
        assert param.grad is before, "the replays add into the .grad bound at the capture"
        torch.testing.assert_close(param.grad, ref.grad)


def _graph_memory(accumulate: bool, slots: int) -> tuple[int, int]:
    """Device memory a graphed stage of 16 Linear(2048, 2048) holds after each slot's forward and backward
    replayed once, beyond its parameters, and its gradients' bytes."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    module = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(16))).cuda()
    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    graphed = GraphedStage(module, GradientSink(list(module.parameters()), main_grad=False), slots=slots, stage=1,
                           loss=None, accumulators=GradientAccumulators() if accumulate else None)
    for micro_batch in range(slots):
        graphed.forward(micro_batch, (torch.randn(4, 2048, device="cuda", requires_grad=True),), ())
    for micro_batch in range(slots):
        graphed.backward(micro_batch, (torch.randn(4, 2048, device="cuda"),))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-up's cached blocks: what stays is the pools', the outputs' and .grad's
    held = torch.cuda.memory_reserved() - before - gradient_bytes  # the parameters are as large as their gradients
    del graphed, module
    return held, gradient_bytes


@needs_cuda
def test_accumulating_graphs_hold_no_set_of_gradients_per_slot():
    """Returned, each slot's backward keeps a whole set of the stage's gradients; added into accumulators, the stage
    holds one set (the accumulators, as eager holds .grad) and the backward's working memory."""
    returned, gradient_bytes = _graph_memory(accumulate=False, slots=2)
    accumulated, _ = _graph_memory(accumulate=True, slots=2)
    assert returned >= 2 * gradient_bytes, returned / 2**20
    assert accumulated <= returned - 0.75 * gradient_bytes, (accumulated / 2**20, returned / 2**20)


@needs_cuda
def test_the_slots_backwards_share_their_working_memory():
    """Three slots hold what one does and two more forwards' activations (a few MB here), not two more backwards'
    working memory (a 16 MB weight gradient each, at least)."""
    one, gradient_bytes = _graph_memory(accumulate=True, slots=1)
    three, _ = _graph_memory(accumulate=True, slots=3)
    assert three - one < gradient_bytes / 16, ((three - one) / 2**20, one / 2**20)
