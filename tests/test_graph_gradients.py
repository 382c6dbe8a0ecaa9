"""GradientAccumulators: the ``.grad`` a graphed stage's parameters get each step holds what an eager one would."""

from __future__ import annotations

import torch
from torch import nn

from pipecomm.runtime.graph_gradients import GradientAccumulators
from pipecomm.runtime.stage_runner import run_backward


def _adopted(params, stage=0):
    """Accumulators for ``params`` as a capture gives them: a first run's gradients show which get one, and become
    them."""
    accumulators = GradientAccumulators()
    with accumulators.capturing(params):
        first_run = [torch.ones_like(param) for param in params]
        for param, grad in zip(params, first_run):
            param.grad = grad
        accumulators.adopt_reached(stage, params)
    assert [t.data_ptr() for t in accumulators.tensors(params)] == [t.data_ptr() for t in first_run]
    return accumulators


def _shares_storage(one, other):
    return one.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def test_autograd_adds_in_place_into_the_bound_accumulator():
    layer = nn.Linear(3, 2)
    accumulators = _adopted(list(layer.parameters()))
    accumulators.bind(layer.parameters())
    bound = layer.weight.grad
    x = torch.randn(4, 3)
    for _ in range(2):
        run_backward([layer(x).sum()], [torch.ones(())], [layer.weight, layer.bias], keep_graph=False, accumulate=True)
    assert layer.weight.grad is bound and _shares_storage(bound, accumulators.tensors([layer.weight])[0])
    reference = nn.Linear(3, 2)
    reference.load_state_dict(layer.state_dict())
    (reference(x).sum() * 2).backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_each_step_starts_from_what_the_caller_left_in_grad():
    weight = nn.Parameter(torch.zeros(3))
    accumulators = _adopted([weight])
    accumulator = accumulators.tensors([weight])[0]
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros(3)), "the capture leaves no gradient"

    accumulator.add_(1.0)  # a step's graphs add
    accumulators.bind([weight])  # no zero_grad: accumulation goes on
    accumulator.add_(1.0)
    assert torch.equal(weight.grad, torch.full((3,), 2.0))

    kept = weight.grad
    weight.grad = None  # zero_grad()
    accumulators.bind([weight])
    accumulator.add_(5.0)
    assert torch.equal(weight.grad, torch.full((3,), 5.0)) and _shares_storage(weight.grad, accumulator)
    assert torch.equal(kept, torch.full((3,), 2.0)), "a gradient kept from an earlier step keeps its values"

    mine = torch.arange(3.0)
    weight.grad = mine  # the caller's own tensor
    accumulators.bind([weight])
    accumulator.add_(1.0)
    assert torch.equal(weight.grad, torch.arange(3.0) + 1) and torch.equal(mine, torch.arange(3.0))


def test_a_capture_leaves_every_grad_as_it_was_and_adopts_only_the_reached():
    reached, unreached, frozen = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    frozen.requires_grad_(False)
    reached.grad, unreached_grad = torch.full((2,), 3.0), torch.full((2,), 4.0)
    unreached.grad = unreached_grad
    accumulators = GradientAccumulators()
    with accumulators.capturing([reached, unreached, frozen]):
        assert reached.grad is None and unreached.grad is None
        reached.grad = torch.full((2,), 9.0)  # the first run reaches only this one
        assert accumulators.adopt_reached(0, [reached, unreached, frozen]) == [reached]
        accumulators.tensors([reached])[0].add_(7.0)  # runs during the capture
    assert torch.equal(reached.grad, torch.full((2,), 3.0))
    assert _shares_storage(reached.grad, accumulators.tensors([reached])[0])
    assert unreached.grad is unreached_grad and frozen.grad is None and not accumulators.holds(unreached)

    with accumulators.capturing([reached]):  # a capture again, into the accumulator that holds the step's sum
        reached.grad = torch.ones(2)
        accumulators.adopt_reached(0, [reached])
        accumulators.tensors([reached])[0].add_(7.0)
    assert torch.equal(reached.grad, torch.full((2,), 3.0))


def test_a_shared_parameter_keeps_its_accumulator_until_no_stage_uses_it():
    shared, own = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    accumulators = GradientAccumulators()
    for stage, params in ((0, [shared, own]), (3, [shared])):
        with accumulators.capturing(params):
            for param in params:
                param.grad = torch.ones(2)
            accumulators.adopt_reached(stage, params)
    accumulator = accumulators.tensors([shared])[0]
    accumulators.release(0)
    assert accumulators.holds(shared) and not accumulators.holds(own) and own.grad is not None
    assert accumulators.tensors([shared])[0] is accumulator
    accumulators.release(3)
    assert not accumulators.holds(shared) and shared.grad is not None
