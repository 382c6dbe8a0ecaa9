"""GradientAccumulators: the ``.grad`` a graphed stage's parameters get each step holds what an eager one would."""

from __future__ import annotations

import pytest
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


class _EagerReplay:
    """A "graph" whose replay runs a function eagerly: the check's logic on a CPU."""

    def __init__(self, run):
        self.replay = run


def _eager_graphs(graphed, module, accumulator_of, stale_micro_batch):
    """Stand-ins for the captured passes of ``graphed`` (a Linear's stage, whole backwards): each reads and writes the
    landing buffers as a graph does, its backward adding into the accumulators; ``stale_micro_batch``'s backward
    scales the weight's gradient by a factor a capture could have baked in (its outputs and input gradient right)."""
    saved = {}

    def forward(micro_batch):
        @torch.no_grad()
        def run():
            saved[micro_batch] = graphed._inputs.tensors[0].clone()  # its copy of the inputs, in the pool
            graphed._outputs[0].copy_(module(saved[micro_batch]))
        return run

    def backward(micro_batch):
        def run():
            leaf = saved.pop(micro_batch).requires_grad_()
            grads = torch.autograd.grad(module(leaf), [leaf, module.weight, module.bias], graphed._grad_outputs[0])
            graphed._input_grads[0].copy_(grads[0])
            accumulator_of(module.weight).add_(grads[1], alpha=1.5 if micro_batch == stale_micro_batch else 1.0)
            accumulator_of(module.bias).add_(grads[2])
        return run

    return {(kind, m): _EagerReplay((forward if kind == "F" else backward)(m)) for kind, m in graphed.passes}


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("stale", [None, 0, "last"])
def test_the_check_finds_a_pass_off_eager_without_copying_the_gradients(monkeypatch, micro_batches, stale):
    """The check of replays that add into accumulators, in the captured order: micro-batches take the probe negated
    and not by turns, and the accumulators must be about zero after each negated one; with an even count a second
    round checks the last. A micro-batch computing with a stale weight, first or last, is found; right ones pass."""
    from pipecomm.runtime import boundary, cuda_graphs, graph_check, graph_order
    from pipecomm.runtime.gradient_sink import GradientSink
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: None)
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    params = list(module.parameters())
    accumulators = _adopted(params, stage=1)
    by_id = dict(zip(map(id, params), accumulators.tensors(params)))
    passes = [("F", 0), ("F", 1), ("B", 0)]
    passes += [step for m in range(2, micro_batches) for step in (("F", m), ("B", m - 1))]
    passes.append(("B", micro_batches - 1))
    graphed = cuda_graphs.GraphedStage(module, GradientSink(params, main_grad=False), passes, stage=1, loss=None,
                                       checked=True, accumulators=accumulators)
    graphed.accumulated = params
    x = torch.randn(2, 4)
    graphed._inputs = boundary.flatten(x.clone())
    graphed._outputs, graphed._output_requires_grad = [torch.zeros(2, 3)], [True]
    graphed._grad_outputs, graphed._input_grads = [torch.zeros(2, 3)], [torch.zeros(2, 4)]
    # The eager run: R in the accumulators, the reference the warm-up keeps.
    leaf = x.clone().requires_grad_()
    output = module(leaf)
    grads = torch.autograd.grad(output, [leaf, *params], graphed._probe([output])[0])
    for param, grad in zip(params, grads[1:]):
        by_id[id(param)].copy_(grad)
    reference = cuda_graphs._Reference(
        [output.detach()], [grads[0]], None, None, {id(p): by_id[id(p)].abs().max() for p in params},
        {id(p): {"input"} for p in params}, [None] * 3)
    stale_micro_batch = micro_batches - 1 if stale == "last" else stale
    graphed._graphs = _eager_graphs(graphed, module, lambda param: by_id[id(param)], stale_micro_batch)
    graphed._group = graph_order.GraphGroup([(1, *step) for step in passes])
    if stale_micro_batch is None:
        graphed._check_replays(reference, torch.device("cpu"))
        graphed.new_step()
        graphed._launch("F", 0)
        graphed.backward(0, None)  # the loss's own gradient, whatever probe the check left in the landing buffer
        assert torch.equal(graphed._grad_outputs[0], torch.ones(2, 3))
    else:
        with pytest.raises(graph_check.GraphCheckError, match="parameter gradients the replays added up to the B pass"):
            graphed._check_replays(reference, torch.device("cpu"))


def test_stages_captured_together_keep_their_own_warm_up_results_of_a_shared_parameter():
    """Two stages of a rank holding one Linear, captured together: the shared weight and bias are found, and each
    checked stage keeps a copy of what its own warm-up left in their accumulators (another stage's warm-up adds into
    them after it), and of nothing else."""
    from pipecomm.runtime import cuda_graphs
    from pipecomm.runtime.gradient_sink import GradientSink
    shared, own = nn.Linear(4, 4), nn.Linear(4, 2)
    first, second = list(shared.parameters()), list(shared.parameters()) + list(own.parameters())
    accumulators = _adopted(second)
    stages = [cuda_graphs.GraphedStage(nn.Sequential(*layers), GradientSink(params, main_grad=False), [("F", 0)],
                                       stage=stage, loss=None, checked=checked, accumulators=accumulators)
              for stage, layers, params, checked in ((0, [shared], first, True), (1, [shared, own], second, False))]
    for stage in stages:
        stage.accumulated = stage.params
    shared_ids = cuda_graphs._shared(stages)
    assert shared_ids == {id(shared.weight), id(shared.bias)}
    kept = stages[0]._warmed_shared(shared_ids)
    assert [tensor.data_ptr() for tensor, _ in kept] == [t.data_ptr() for t in accumulators.tensors(first)]
    assert all(torch.equal(tensor, copy) and not _shares_storage(tensor, copy) for tensor, copy in kept)
    assert stages[1]._warmed_shared(shared_ids) == [], "an unchecked stage's capture keeps nothing"
