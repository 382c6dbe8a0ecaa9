"""CUDA-graph stages: their passes from the schedule, and replayed forwards/backwards equal to eager ones with several
micro-batches in flight, in memory eager would hold."""

from __future__ import annotations

import copy
import dataclasses
import gc
import warnings

import pytest
import torch
from torch import nn

from pipecomm.runtime import boundary
from pipecomm.runtime.cuda_graphs import GraphedStage
from pipecomm.runtime.graph_order import GraphGroup, in_flight, stage_passes
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.graph_gradients import GradientAccumulators
from pipecomm.schedules.schedule import make_schedule
from pipecomm.runtime.split_backward import WeightGradStore, defer_linear_weight_grads
from pipecomm.runtime.stage_runner import EagerStage
from ranks import graph_pool_bytes, needs_cuda
from stand_in_graphs import StandInGraph, stand_in_graphs


@pytest.mark.parametrize(
    ("name", "ranks", "micro_batches", "virtual", "expected"),
    [
        ("1f1b", 2, 4, 1, {(0, 0): 2, (1, 1): 1}),
        ("1f1b", 4, 8, 1, {(0, 0): 4, (3, 3): 1}),
        ("gpipe", 2, 4, 1, {(0, 0): 4, (1, 1): 4}),
    ],
)
def test_in_flight_is_the_most_micro_batches_a_stage_holds(name, ranks, micro_batches, virtual, expected):
    schedule = make_schedule(name, ranks, micro_batches, virtual)
    for (rank, stage), held in expected.items():
        assert in_flight(stage_passes(schedule, rank, stage)) == held


def test_a_stage_passes_are_its_compute_actions_in_the_schedule_order():
    schedule = make_schedule("1f1b", 2, 4)
    assert stage_passes(schedule, 0, 0) == (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                            ("B", 3))
    interleaved = make_schedule("interleaved-1f1b", 2, 4, 2)
    for rank in range(2):
        for stage in interleaved.stages_of(rank):
            passes = stage_passes(interleaved, rank, stage)
            assert sorted(passes) == sorted([(kind, m) for kind in "BF" for m in range(4)])


@pytest.mark.parametrize(("name", "virtual"), [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)])
def test_split_backwards_hold_a_micro_batch_from_forward_to_weight_pass(name, virtual):
    schedule = make_schedule(name, 2, 4, virtual)
    for rank in range(2):
        for stage in schedule.stages_of(rank):
            held = most = 0
            for action in schedule.actions[rank]:
                if action.stage == stage and action.kind in "FW":
                    held += 1 if action.kind == "F" else -1
                    most = max(most, held)
            assert in_flight(stage_passes(schedule, rank, stage)) == most >= 1


def test_passes_out_of_forward_order_are_followed_but_mixed_backwards_refused():
    """Graphs per micro-batch follow any order of the passes; a stage whose backward is whole for some micro-batches
    and split for others is refused."""
    schedule = make_schedule("zb-h1", 2, 4)
    actions = list(schedule.actions[0])
    weights = [index for index, action in enumerate(actions) if action.kind == "W"]
    actions[weights[0]], actions[weights[1]] = actions[weights[1]], actions[weights[0]]
    swapped = dataclasses.replace(schedule, actions=(tuple(actions), *schedule.actions[1:]))
    passes = stage_passes(swapped, 0, 0)
    assert passes.index(("W", 1)) < passes.index(("W", 0))
    inputs = [index for index, action in enumerate(actions) if action.kind == "I"]
    actions[inputs[0]] = dataclasses.replace(actions[inputs[0]], kind="B")
    mixed = dataclasses.replace(schedule, actions=(tuple(actions), *schedule.actions[1:]))
    with pytest.raises(ValueError, match="whole for some micro-batches and split for others"):
        stage_passes(mixed, 0, 0)


def test_a_replay_out_of_the_captured_order_is_refused():
    module = nn.Linear(4, 4)
    graphed = GraphedStage(module, GradientSink(list(module.parameters()), main_grad=False),
                           passes=[("F", 0), ("F", 1), ("B", 0), ("B", 1)], stage=0, loss=None)
    graphed._graphs = {step: _Replay() for step in graphed.passes}  # captured, as far as the order goes
    graphed._group = GraphGroup([(0, *step) for step in graphed.passes])
    graphed._launch("F", 0)
    graphed._launch("B", 0)  # skipping F1 is allowed: a skipped pass writes nothing
    with pytest.raises(RuntimeError, match="F pass of micro-batch 1 comes out of the order .* F0 F1 B0 B1"):
        graphed._launch("F", 1)
    with pytest.raises(RuntimeError, match="F pass of micro-batch 2 was not captured"):
        graphed._launch("F", 2)
    graphed.new_step()
    graphed._launch("F", 1)


def test_stages_captured_together_replay_in_their_one_captured_order():
    """Two stages of a rank captured into one pool: a pass of either may not come before one of the other's that
    was captured before it; skipping is allowed."""
    group = GraphGroup([(0, "F", 0), (3, "F", 0), (0, "F", 1), (3, "B", 0), (0, "B", 0), (0, "B", 1)])
    group.launch(0, "F", 0, _Replay())
    group.launch(3, "B", 0, _Replay())  # skipping stage 3's F0 and stage 0's F1
    with pytest.raises(RuntimeError, match=r"stage 0's F pass of micro-batch 1 comes out of the order .* "
                                           r"F0\(stage 0\) F0\(stage 3\) F1\(stage 0\)"):
        group.launch(0, "F", 1, _Replay())
    with pytest.raises(RuntimeError, match="stage 3's F pass of micro-batch 1 was not captured"):
        group.launch(3, "F", 1, _Replay())
    group.new_step()
    group.launch(3, "F", 0, _Replay())


class _Replay:
    def replay(self):
        pass


def _passes(*names: str) -> list[tuple[str, int]]:
    """("F0", "B0", ...) as (kind, micro-batch) passes."""
    return [(name[0], int(name[1:])) for name in names]


@needs_cuda
def test_replayed_stage_equals_eager_with_two_micro_batches_in_flight():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), _passes("F0", "F1", "B0", "B1", "F2", "B2"),
                           stage=1, loss=None)
    xs = [torch.randn(4, 16, device="cuda", requires_grad=True) for _ in range(3)]  # received: they need grads
    grads = [torch.randn(4, 16, device="cuda") for _ in range(3)]

    outputs = {0: graphed.forward(0, (xs[0],), ())[0].clone(), 1: graphed.forward(1, (xs[1],), ())[0].clone()}
    input_grads, param_grads = {}, {}
    for micro_batch in (0, 1, 2):
        if micro_batch == 2:
            outputs[2] = graphed.forward(2, (xs[2],), ())[0].clone()  # may reuse micro-batch 0's memory
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
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), _passes("F0", "F1", "I0", "W0", "I1", "W1"),
                           stage=1, loss=None, weight_grad_store=store)
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
def test_a_weight_pass_with_nothing_deferred_is_captured_without_torchs_empty_graph_warning():
    """A stage of no Linear (or whose Linears run inside compiled regions) defers nothing, so its W graphs are empty:
    expected, and not worth torch's warning, which blames a wrong device or stream."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.LayerNorm(16), nn.Tanh()).cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    store = WeightGradStore()
    defer_linear_weight_grads([module], store)
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), _passes("F0", "I0", "W0"), stage=1,
                           loss=None, weight_grad_store=store)
    x, grad = torch.randn(4, 16, device="cuda", requires_grad=True), torch.randn(4, 16, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed.forward(0, (x,), ())
        input_grads, param_grads = graphed.backward(0, (grad,))
        graphed.backward_weights(0)
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)], [str(w.message) for w in caught]
    leaf = x.detach().clone().requires_grad_()
    expected = torch.autograd.grad(reference(leaf), [leaf, *reference.parameters()], grad)
    for got, want in zip([input_grads[0], *param_grads], expected):
        torch.testing.assert_close(got, want)


@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["whole backward", "I and W"])
def test_replays_add_the_parameter_gradients_into_grad_in_place(split):
    """With accumulators, each replayed backward adds its parameter gradients into ``.grad`` (an accumulator's alias,
    the same memory the whole time), in eager's order, onto what the caller left there before the capture; a frozen
    parameter gets none. Three micro-batches, two in flight."""
    torch.manual_seed(0)
    module = Twice().cuda()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    store = WeightGradStore() if split else None
    if split:
        defer_linear_weight_grads([module], store)
    kinds = ("I", "W") if split else ("B",)
    passes = [("F", 0), ("F", 1), *((kind, 0) for kind in kinds), ("F", 2),
              *((kind, m) for m in (1, 2) for kind in kinds)]
    graphed = GraphedStage(module, GradientSink(params, main_grad=False), passes, stage=1, loss=None,
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


def _held_bytes(order: list[tuple[int, str, int]], graphed: bool) -> tuple[int, int]:
    """Device memory a rank's stages of 8 Linear(1024, 1024) + GELU blocks each hold for their micro-batches (4096
    rows, 32 MB of saved activations per block) over ``order`` (stage, kind, micro-batch) beyond their parameters and
    gradients: eager, the peak allocated; graphed (the stages captured together), the graphs' pool after a capture
    and a replayed step; and the graphed stages' landing buffers."""
    torch.manual_seed(0)
    indices = sorted({stage for stage, _, _ in order})
    modules = {stage: nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8))).cuda()
               for stage in indices}
    split = any(kind == "I" for _, kind, _ in order)
    store = WeightGradStore() if split else None
    if store:
        defer_linear_weight_grads(list(modules.values()), store)
    params = {stage: list(module.parameters()) for stage, module in modules.items()}
    for param in (param for stage in indices for param in params[stage]):
        param.grad = torch.zeros_like(param)
    grad = torch.randn(4096, 1024, device="cuda")

    def received():  # as a channel hands it over, for the forward alone
        return torch.randn(4096, 1024, device="cuda", requires_grad=True)

    torch.cuda.synchronize()
    gc.collect()  # an earlier test's graphs, and with them their pools
    torch.cuda.empty_cache()
    if not graphed:
        runners = {stage: EagerStage(modules[stage], GradientSink(params[stage], main_grad=False), stage, None, store,
                                     rank=0) for stage in indices}
        for runner in runners.values():
            runner.start(True)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for stage, kind, m in order:
            runner = runners[stage]
            if kind == "F":
                x = received()
                runner.forward(m, (x,), {}, [x], (), [])
                runner.outputs_sent(m, lambda: None)
                del x
            elif kind == "W":
                runner.backward_weight(m)
            else:
                runner.micro_batches[m].output_grads = (grad,)
                (runner.backward if kind == "B" else runner.backward_input)(m)
                runner.take_input_grads(m)  # sent
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, 0
    earlier_pools = graph_pool_bytes()  # an earlier test's, not yet collected
    accumulators = GradientAccumulators()
    stages = {stage: GraphedStage(modules[stage], GradientSink(params[stage], main_grad=False),
                                  [(kind, m) for one, kind, m in order if one == stage], stage=stage, loss=None,
                                  weight_grad_store=store, accumulators=accumulators) for stage in indices}
    samples = {stage: (boundary.flatten(((received(),), {})), boundary.flatten(())) for stage in indices}
    GraphedStage.capture(list(stages.values()), samples, order)
    del samples
    for stage, kind, m in order:
        graphed = stages[stage]
        if kind == "F":
            graphed.forward(m, (received(),), ())
        elif kind == "W":
            graphed.backward_weights(m)
        else:
            graphed.backward(m, (grad,))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the warm-up's cached blocks
    pools = graph_pool_bytes() - earlier_pools
    landing = sum(t.nbytes for graphed in stages.values()
                  for t in [*graphed._inputs.tensors, *graphed._outputs, *graphed._grad_outputs,
                            *(t for t in graphed._input_grads if t is not None)])
    return pools, landing


@needs_cuda
@pytest.mark.parametrize("passes", [
    _passes("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"),
    _passes("F0", "F1", "F2", "I0", "F3", "W0", "I1", "W1", "I2", "I3", "W2", "W3"),
], ids=["whole backward", "I and W"])
def test_the_graphs_hold_what_eager_holds_at_its_peak(passes):
    """One pool for the stage's passes, captured in their order, holds what eager holds at its peak: activations
    freed at a micro-batch's backward (at its I, but for W's operands) are reused by later passes. A pool per
    micro-batch in flight held each one's activations until its last pass, and its own transients. Beside the pool,
    the stage's landing buffers: an input, an output, their gradients (16 MB each here)."""
    order = [(1, kind, m) for kind, m in passes]
    eager, _ = _held_bytes(order, graphed=False)
    graphed, landing = _held_bytes(order, graphed=True)
    assert graphed <= 1.05 * eager, (graphed / 2**20, eager / 2**20)
    assert landing == 4 * (16 << 20)


@needs_cuda
@pytest.mark.parametrize("order", [
    "F0/1 F1/1 F0/2 F2/1 F1/2 B0/2 F3/1 B0/1 F2/2 B1/2 B1/1 F3/2 B2/2 B2/1 B3/2 B3/1",
    "F0/1 F1/1 F0/2 F2/1 F1/2 I0/2 F3/1 I0/1 F2/2 W0/2 I1/2 W0/1 I1/1 F3/2 W1/2 I2/2 W1/1 I2/1 I3/2 W2/2 W2/1 I3/1 "
    "W3/2 W3/1",
], ids=["whole backward", "I and W"])
def test_a_ranks_stages_captured_together_hold_what_eager_holds_at_the_ranks_peak(order):
    """Two stages on one rank (zb-v's V, four micro-batches) captured together into one pool, in the rank's order:
    the pool holds what eager holds at the rank's peak, not the sum of each stage's own peak, which a pool per
    stage held. Beside it, each stage's landing buffers."""
    order = [(int(step.split("/")[1]), step[0], int(step[1:].split("/")[0])) for step in order.split()]
    eager, _ = _held_bytes(order, graphed=False)
    graphed, landing = _held_bytes(order, graphed=True)
    assert graphed <= 1.05 * eager, (graphed / 2**20, eager / 2**20)
    assert landing == 2 * 4 * (16 << 20)


@needs_cuda
def test_two_stages_sharing_a_weight_captured_together_are_checked_and_exact():
    """Two stages of a rank holding one Linear (a tied layer), captured together with the check: each stage's
    graphs add its part of the weight's gradient into the one accumulator, the check passes for both (each starts
    from its own warm-up's gradients, though the other's warm-up added into the same accumulator), and a replayed
    step's gradients equal eager autograd's sums."""
    torch.manual_seed(0)
    shared = nn.Linear(64, 64)
    modules = {1: nn.Sequential(shared, nn.Tanh()), 2: nn.Sequential(shared, nn.Tanh(), nn.Linear(64, 64))}
    modules = {stage: module.cuda() for stage, module in modules.items()}
    order = [(1, "F", 0), (2, "F", 0), (1, "F", 1), (2, "B", 0), (2, "F", 1), (1, "B", 0), (2, "B", 1), (1, "B", 1)]
    params = {stage: list(module.parameters()) for stage, module in modules.items()}
    everything = list({id(p): p for stage in modules for p in params[stage]}.values())
    accumulators = GradientAccumulators()
    stages = {stage: GraphedStage(modules[stage], GradientSink(params[stage], main_grad=False),
                                  [(kind, m) for one, kind, m in order if one == stage], stage=stage, loss=None,
                                  checked=True, accumulators=accumulators) for stage in modules}
    inputs = {stage: [torch.randn(32, 64, device="cuda", requires_grad=True) for _ in range(2)] for stage in modules}
    grads = {stage: [torch.randn(32, 64, device="cuda") for _ in range(2)] for stage in modules}
    samples = {stage: (boundary.flatten(((inputs[stage][0],), {})), boundary.flatten(())) for stage in modules}
    GraphedStage.capture(list(stages.values()), samples, order)
    assert stages[1]._group is stages[2]._group
    for param in everything:
        param.grad = None  # zero_grad()
    accumulators.bind(everything)
    for stage, kind, m in order:
        if kind == "F":
            stages[stage].forward(m, (inputs[stage][m],), ())
        else:
            stages[stage].backward(m, (grads[stage][m],))
    expected = {id(p): torch.zeros_like(p) for p in everything}
    for stage, module in modules.items():
        for m in range(2):
            found = torch.autograd.grad(module(inputs[stage][m]), params[stage], grads[stage][m])
            for param, grad in zip(params[stage], found):
                expected[id(param)] += grad
    for param in everything:
        torch.testing.assert_close(param.grad, expected[id(param)], rtol=1e-4, atol=1e-5)


def _tied_stages(checked: bool, device: str = "cpu"):
    """Two stages of a rank holding one Linear, with the rank's accumulators, in a V over two micro-batches."""
    torch.manual_seed(0)
    with torch.device(device):
        shared = nn.Linear(8, 8)
        modules = {1: nn.Sequential(shared, nn.Tanh()), 2: nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8))}
    order = [(1, "F", 0), (2, "F", 0), (1, "F", 1), (2, "B", 0), (2, "F", 1), (1, "B", 0), (2, "B", 1), (1, "B", 1)]
    accumulators = GradientAccumulators()
    stages = {stage: GraphedStage(module, GradientSink(list(module.parameters()), main_grad=False),
                                  [(kind, m) for one, kind, m in order if one == stage], stage=stage, loss=None,
                                  checked=checked, accumulators=accumulators) for stage, module in modules.items()}
    samples = {stage: (boundary.flatten(((torch.randn(4, 8, device=device, requires_grad=True),), {})),
                       boundary.flatten(())) for stage in modules}
    return stages, samples, order, accumulators, shared


def test_a_capture_of_two_stages_together_runs_through_on_a_cpu(monkeypatch):
    """With stand-in graphs (tests/stand_in_graphs.py), checked: both stages get a graph per pass, one group in the
    rank's order, each stage's own accumulators (the tied weight's one, added into by both), and every parameter's
    .grad as it was before."""
    stand_in_graphs(monkeypatch)
    stages, samples, order, accumulators, shared = _tied_stages(checked=True)
    kept = torch.full_like(shared.weight, 3.0)
    shared.weight.grad = kept
    GraphedStage.capture(list(stages.values()), samples, order)
    assert all(set(stage._graphs) == set(stage.passes) for stage in stages.values())
    assert stages[1]._group is stages[2]._group and stages[1]._group.order == tuple(order)
    assert {id(p) for p in stages[1].accumulated} == {id(shared.weight), id(shared.bias)}
    assert len(stages[2].accumulated) == 4
    assert accumulators._held[id(shared.weight)].users == {1, 2}, "one accumulator for the tied weight, both add in"
    assert torch.equal(shared.weight.grad, kept), "the capture's runs left the gradient a caller kept"
    for stage in stages.values():
        stage.new_step()
    stages[1].forward(0, (samples[1][0].tensors[0],), ())
    with pytest.raises(RuntimeError, match="stage 1's F pass of micro-batch 0 comes out of the order"):
        stages[1].forward(0, (samples[1][0].tensors[0],), ())


def test_a_capture_whose_check_fails_leaves_no_stage_graphed_on_a_cpu(monkeypatch):
    """With stand-in graphs whose replays do nothing (stale graphs): the check of the first stage finds its replays
    off eager, and neither stage keeps graphs or accumulators."""
    from pipecomm.runtime.graph_check import GraphCheckError
    stand_in_graphs(monkeypatch, inert=True)
    stages, samples, order, accumulators, shared = _tied_stages(checked=True)
    with pytest.raises(GraphCheckError, match="stage 1: "):
        GraphedStage.capture(list(stages.values()), samples, order)
    assert StandInGraph.replays > 0
    assert not any(stage.captured or stage.accumulated for stage in stages.values())
    assert not accumulators.holds(shared.weight)


def _segment_of(tensor: torch.Tensor) -> dict:
    address = tensor.data_ptr()
    return next(segment for segment in torch.cuda.memory_snapshot()
                if segment["address"] <= address < segment["address"] + segment["total_size"])


@needs_cuda
@pytest.mark.parametrize("callers", [False, True], ids=["off", "the caller's on"])
def test_the_pool_grows_in_expandable_segments_and_the_callers_setting_stays(callers):
    """The captures allocate the graphs' pool in expandable segments (one stretch of addresses instead of segments
    sized for their first allocation); an allocation after the capture gets what the caller had: ordinary segments,
    or expandable ones where the caller turned them on."""
    settings = torch._C._accelerator_setAllocatorSettings
    if callers:
        settings("expandable_segments:True")
    try:
        _capture_and_allocate(callers)
    finally:
        settings("expandable_segments:False")
        torch.cuda.empty_cache()  # no expandable segment left cached for a later test's buffer shared over IPC


def _capture_and_allocate(callers: bool) -> None:
    stages, samples, order, _, _ = _tied_stages(checked=False, device="cuda")
    torch.cuda.empty_cache()
    earlier = {(0, 0)} | {tuple(segment["segment_pool_id"]) for segment in torch.cuda.memory_snapshot()}
    GraphedStage.capture(list(stages.values()), samples, order)
    snapshot = torch.cuda.memory_snapshot()
    pools = [segment for segment in snapshot if tuple(segment["segment_pool_id"]) not in earlier]
    assert pools and all(segment["is_expandable"] for segment in pools)
    if not callers:  # nothing the capture allocated outside its pool (a buffer that IPC might share) is expandable
        assert not any(segment["is_expandable"] for segment in snapshot if tuple(segment["segment_pool_id"]) == (0, 0))
    # Larger than any free block an earlier test left cached in a live segment, so it needs a segment of its own.
    free = [block["size"] for segment in snapshot if tuple(segment["segment_pool_id"]) == (0, 0)
            for block in segment["blocks"] if block["state"] == "inactive"]
    after = torch.empty(max(free, default=0) + (3 << 20), dtype=torch.uint8, device="cuda")
    assert _segment_of(after)["is_expandable"] == callers


def test_expandable_segments_are_set_for_each_capture_and_set_back(monkeypatch):
    """On a CPU, the allocator's settings recorded: turned on around each capture of a CUDA device and off after it, a
    failed one too; left alone where the caller has them on (as torch 2.11's snapshot says, which has no getter for
    them, or the getter of later releases), and for a CPU stage."""
    from pipecomm.runtime import graph_capture
    calls = []
    settings = {"expandable_segments": False}
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "allocator_settings": settings})
    around = graph_capture.ExpandableSegments(torch.device("cuda", 0))
    for _ in range(2):
        with around:
            assert calls[-1] == "expandable_segments:True"
        assert calls[-1] == "expandable_segments:False"
    with pytest.raises(RuntimeError, match="capture failed"):
        with around:
            raise RuntimeError("capture failed")
    assert calls == ["expandable_segments:True", "expandable_segments:False"] * 3
    calls.clear()
    settings["expandable_segments"] = True
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        with graph_capture.ExpandableSegments(device):
            pass
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments: True",
                        raising=False)
    settings["expandable_segments"] = False  # the getter, where there is one, is what counts
    with graph_capture.ExpandableSegments(torch.device("cuda", 0)):
        pass
    assert calls == []
