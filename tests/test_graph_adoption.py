"""The default's adoption of CUDA graphs, on a CPU: ``GraphRunner``'s decisions (watch, capture, trial, keep or drop,
give up) and the exactness of steps that mix replayed and eager micro-batches, with graphs that compute eagerly and
pass timings given by the test. The real graphs are tests/test_automatic_graphs.py's, on a GPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pipecomm
from pipecomm.runtime import boundary, graph_runner
from pipecomm.runtime.cuda_graphs import signature, signature_difference

TOLERANCE = dict(rtol=1e-6, atol=1e-7)


class EagerGraphs:
    """``GraphedStage``'s interface, computed by autograd: a "capture" records the signature it serves, a "replay" runs
    the module on detached copies of the inputs and keeps its autograd graph until the backward. Where the sink
    accumulates in ``.grad``, the parameters' gradients go into the rank's accumulators, as captured graphs add them:
    the capture's first run, into empty ``.grad``s, shows which parameters get one."""

    fail_capture = False  # set by a test: the next capture raises

    def __init__(self, module, sink, passes, stage, loss, weight_grad_store=None, checked=False, accumulators=None):
        self.module, self.params, self.loss, self.stage = module, sink.params, loss, stage
        self.passes = list(passes)
        self._group = None  # the order the stages captured together share, and its next position, as real graphs'
        self.accumulators = accumulators if sink.autograd_accumulates else None
        self.accumulated, self._adding_into = [], []
        self.output_layout = None
        self.captured = False
        self._signature = None
        self._held = {}
        self._landing_outputs, self._landing_input_grads = None, None

    def new_step(self):
        self._group["next"] = 0

    def _follow(self, kind, micro_batch):
        order = self._group["order"]
        position = order.index((self.stage, kind, micro_batch))
        assert position >= self._group["next"], f"{kind}{micro_batch} replayed out of the captured order {order}"
        self._group["next"] = position + 1

    def mismatch(self, inputs, targets):
        return signature_difference(signature(inputs, targets), self._signature)

    @classmethod
    def capture(cls, members, samples, order):
        if EagerGraphs.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        stages = {member.stage for member in members}
        group = {"order": [step for step in order if step[0] in stages], "next": 0}
        for member in members:
            member._group = group
            inputs, targets = samples[member.stage]
            if member.accumulators:
                with member.accumulators.capturing(member.params):
                    outputs = member._forward("capture", inputs, targets)
                    member._backward("capture", tuple(torch.ones_like(t) for t in outputs))
                    member.accumulated = member.accumulators.adopt_reached(member.stage, member.params)
                member._adding_into = member.accumulators.tensors(member.accumulated)  # a capture bakes in addresses
            member.captured = True
            member._signature = signature(inputs, targets)

    def replay(self, micro_batch, inputs, targets, landing=False):
        if not self.captured:
            self.capture([self], {self.stage: (inputs, targets)}, [(self.stage, *step) for step in self.passes])
        return self.replay_fitting(micro_batch, inputs, targets, landing)

    def replay_fitting(self, micro_batch, inputs, targets, landing=False):
        self._follow("F", micro_batch)
        outputs = self._forward(micro_batch, inputs, targets)
        if not landing:
            return outputs
        # As the real graphs' landing buffers: one set, written by every forward replay.
        self._landing_outputs = _write_landing(self._landing_outputs, outputs)
        return tuple(t.detach().requires_grad_(o.requires_grad) for t, o in zip(self._landing_outputs, outputs))

    def _forward(self, micro_batch, inputs, targets):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs.tensors]
        args, kwargs = boundary.unflatten(leaves, inputs.layout)
        output = self.module(*args, **kwargs)
        if self.loss is not None:
            output = self.loss(output, *boundary.unflatten(targets.tensors, targets.layout))
        flat = boundary.flatten(output)
        self.output_layout = flat.layout
        self._held[micro_batch] = (flat.tensors, leaves)
        return tuple(t.detach().requires_grad_(t.requires_grad) for t in flat.tensors)

    def backward(self, micro_batch, grads):
        self._follow("I" if ("I", micro_batch) in self.passes else "B", micro_batch)
        input_grads, param_grads = self._backward(micro_batch, grads)
        self._landing_input_grads = _write_landing(self._landing_input_grads, input_grads)
        return list(self._landing_input_grads), param_grads

    def _backward(self, micro_batch, grads):
        outputs, leaves = self._held.pop(micro_batch)
        grads = grads or tuple(torch.ones_like(t) for t in outputs)
        wanted = [t for t in leaves if t.requires_grad] + [p for p in self.params if p.requires_grad]
        found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        input_grads = [next(found) if t.requires_grad else None for t in leaves]
        param_grads = [next(found) if p.requires_grad else None for p in self.params]
        if not self.accumulators:
            return input_grads, param_grads
        if not self.captured:  # the capture's first run, into the empty .grads the capture leaves
            for param, grad in zip(self.params, param_grads):
                param.grad = grad
        else:
            accumulators = iter(self._adding_into)
            for grad in param_grads:
                if grad is not None:
                    next(accumulators).add_(grad)
        return input_grads, None

    def backward_weights(self, micro_batch):
        self._follow("W", micro_batch)
        # The "I" replay above computed every gradient: no Linear deferred.
        return None if self.accumulators else [None] * len(self.params)

    def changed_since_capture(self):
        return None


def _write_landing(landing, values):
    """The one set of landing buffers a stand-in's replays write (made at the first), as the real graphs' are: what
    the runner gives a send from them must be read, or copied, before the next replay writes them."""
    if landing is None:
        landing = [None if value is None else torch.empty_like(value) for value in values]
    for buffer, value in zip(landing, values):
        if value is not None:
            buffer.copy_(value.detach())
    return landing


class GivenTimes:
    """``PassTimer`` whose measurements are the test's: (GPU ms, host ms) per decision, in order."""

    measurements: list[tuple[float, float]] = []
    largest_growth = 1 << 20  # bytes a forward left allocated

    def start(self):
        return None

    def stop(self, started):
        pass

    def per_pass_ms(self):
        return GivenTimes.measurements.pop(0)


@pytest.fixture
def adoption(monkeypatch):
    """The default Pipeline on a CPU as if on a GPU, over ``EagerGraphs`` and ``GivenTimes``."""
    monkeypatch.setattr(graph_runner, "GraphedStage", EagerGraphs)
    monkeypatch.setattr(graph_runner, "PassTimer", GivenTimes)
    monkeypatch.setattr(pipecomm.pipeline, "graph_mode", lambda cuda_graphs, *args, **kwargs: cuda_graphs)
    monkeypatch.setattr(EagerGraphs, "fail_capture", False)
    monkeypatch.setattr(GivenTimes, "measurements", [])


def _train(steps, measurements, batch=lambda step: 16, schedule="1f1b", settled=None, zero_grad=True,
           hooks=lambda module: None):
    """``steps`` steps of the default Pipeline and of one process, each step's loss and gradients equal, and the
    gradients of the step before, kept, unchanged; the graph states after each step (and, in ``settled``, whether
    "auto" had settled on its schedule). Without ``zero_grad`` the gradients add up over the steps."""
    GivenTimes.measurements[:] = measurements
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(module)
    hooks(module)
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             schedule=schedule)
    states, kept = [], []
    for step in range(steps):
        x, y = torch.randn(batch(step), 8), torch.randn(batch(step), 4)
        loss = pipe.step(x, target=y)
        expected = sum(nn.functional.mse_loss(reference(a), b) / 4 for a, b in zip(x.chunk(4), y.chunk(4)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
        for grad, value in kept:
            assert torch.equal(grad, value), f"step {step} changed a gradient kept from the step before"
        kept = []
        for param, ref in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE, msg=f"step {step}")
            if zero_grad:
                kept.append((param.grad, param.grad.clone()))
                param.grad = ref.grad = None
        states.append(pipe.cuda_graph_states[0])
        if settled is not None:
            settled.append(pipe.auto_step_times is not None)
    return states


HOST_BOUND = (1.0, 0.95)  # an eager pass: the host launches it in about its GPU span
GPU_BOUND = (1.0, 0.2)
FASTER, NOT_FASTER = (0.3, 0.1), (0.95, 0.1)


def test_a_host_bound_stage_captures_at_the_third_step_and_keeps_faster_graphs(adoption):
    assert _train(5, [HOST_BOUND, FASTER]) == ["watching", "to capture", "replaying", "replaying", "replaying"]


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "zb-h2"])
def test_replays_follow_the_captured_order_of_each_schedule(adoption, schedule):
    """The graphs are one per micro-batch and pass, captured in the schedule's order: the runner must replay them in
    that order (``EagerGraphs`` asserts it) whatever the schedule, split backwards included, and stay exact (zb-h2
    re-orders its passes for the costs it measured first, and captures a step later)."""
    assert _train(5, [HOST_BOUND, FASTER], schedule=schedule)[-2:] == ["replaying"] * 2


def test_replayed_gradients_add_up_over_steps_without_zero_grad(adoption):
    assert _train(5, [HOST_BOUND, FASTER], zero_grad=False)[2:] == ["replaying"] * 3


def test_a_stage_whose_parameters_have_gradient_hooks_stays_eager(adoption):
    calls = []
    states = _train(4, [HOST_BOUND], hooks=lambda module: module[0].weight.register_hook(calls.append))
    assert states[1:] == ["eager: its parameter '0.weight' has a gradient hook (register_hook), which a replay would "
                          "not run"] * 3
    assert len(calls) == 4 * 4, "the hook ran for every micro-batch of every step"


def test_a_gpu_bound_stage_never_captures(adoption):
    states = _train(4, [GPU_BOUND])
    assert states[0] == "watching" and all("the GPU bounds it" in state for state in states[1:]), states


def test_graphs_no_faster_than_eager_are_dropped_after_their_trial(adoption):
    states = _train(5, [HOST_BOUND, NOT_FASTER])
    assert states[:3] == ["watching", "to capture", "replaying"]
    assert all(state.startswith("eager: replaying its CUDA graphs took the GPU 0.95 ms") for state in states[3:])


def test_a_short_batch_runs_eagerly_and_two_in_a_row_start_the_watch_again(adoption):
    states = _train(8, [HOST_BOUND, FASTER, HOST_BOUND, FASTER],
                    batch=lambda step: 8 if step in (4, 5) else 16)
    assert states == ["watching", "to capture", "replaying", "replaying", "replaying", "watching", "watching",
                      "to capture"]


def test_no_capture_where_its_memory_would_not_fit(adoption, monkeypatch):
    # 212 parameters (848 bytes of gradients) and a forward that keeps 1 MiB: one micro-batch in flight (1F1B on one
    # stage) and the eager warm-up make (1 + 1) x (1 MiB + 848 B) = 2.1 MB, over 0.8 of the 2 MB left here.
    monkeypatch.setattr(graph_runner, "_free_bytes", lambda params: 2e6)
    states = _train(4, [HOST_BOUND])
    assert states == ["watching"] + ["eager: its CUDA graphs would need about 0.0021 GB (micro-batches in flight at "
                                         "most: 1) and the device has 0.002 GB left"] * 3


def test_a_failed_capture_leaves_the_stage_eager_with_one_warning(adoption):
    EagerGraphs.fail_capture = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = _train(4, [HOST_BOUND])
    assert states[2:] == ["eager: capturing its CUDA graphs failed (RuntimeError: operation not permitted when stream "
                          "is capturing)"] * 2
    assert sum("runs eagerly from now on" in str(warning.message) for warning in caught) == 1


def test_no_capture_while_schedule_auto_still_measures(adoption):
    """"auto" switches schedules between its trials, each switch starts the watch again, and no capture falls in a
    measured step: graphs come two steps after it settles."""
    settled = []
    states = _train(16, [HOST_BOUND, FASTER], schedule="auto", settled=settled)
    last_measured = settled.index(True)
    assert all(state == "watching" for state in states[:last_measured + 2]), states
    assert states[last_measured + 2] == "to capture" and states[last_measured + 3] == "replaying", states


def test_two_graphed_stages_sharing_a_parameter_add_into_one_accumulator(adoption):
    """A rank's two stages holding one Linear (a tied layer): each stage's graphs add its part of the gradient into
    the one accumulator, bound as the parameter's .grad, which equals one process's sum every step."""
    GivenTimes.measurements[:] = [HOST_BOUND, HOST_BOUND, FASTER, FASTER]
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    stages = [nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 4))]
    reference = copy.deepcopy(nn.ModuleList(stages))  # one copy of the shared layer, held by both
    pipe = pipecomm.Pipeline(stages, stage=[0, 1], num_stages=2, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             schedule="interleaved-1f1b")
    for step in range(5):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        pipe.step(x, target=y)
        for a, b in zip(x.chunk(4), y.chunk(4)):
            (nn.functional.mse_loss(reference[1](reference[0](a)), b) / 4).backward()
        for param, ref in zip(nn.ModuleList(stages).parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE, msg=f"step {step}")
            param.grad = ref.grad = None
    assert pipe.cuda_graph_states == {0: "replaying", 1: "replaying"}


@pytest.mark.parametrize("cuda_graphs", [True, "auto"])
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_a_ranks_stages_are_captured_together_and_replay_in_its_order(adoption, monkeypatch, schedule, cuda_graphs):
    """A rank holding two stages: both are captured together, into one order (``EagerGraphs`` asserts the replays
    keep it across the stages): with cuda_graphs=True at the second step's first forward (the first step runs
    eagerly, each stage keeping a micro-batch to capture on, and zb-v is rebuilt for the costs it measured, which the
    captures follow), with "auto" at the first forward after the watch; exact against one process every step."""
    GivenTimes.measurements[:] = [HOST_BOUND, HOST_BOUND, FASTER, FASTER]
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))]
    reference = copy.deepcopy(nn.ModuleList(stages))
    # "auto" passes the Pipeline's check of a CPU device; the runners get the mode asked for.
    monkeypatch.setattr(pipecomm.pipeline, "graph_mode", lambda *args, **kwargs: cuda_graphs)
    pipe = pipecomm.Pipeline(stages, stage=[0, 1], num_stages=2, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             schedule=schedule)
    for step in range(5):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        loss = pipe.step(x, target=y)
        expected = sum(nn.functional.mse_loss(reference[1](reference[0](a)), b) / 4
                       for a, b in zip(x.chunk(4), y.chunk(4)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
        for param, ref in zip(nn.ModuleList(stages).parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE, msg=f"step {step}")
            param.grad = ref.grad = None
    assert pipe.cuda_graph_states == {0: "replaying", 1: "replaying"}
    runners = pipe._executor.stages
    assert runners[0].graphed._group is runners[1].graphed._group, "the stages were captured apart"
    assert (pipe.planned_costs is not None) == (schedule == "zb-v"), "zb-v is rebuilt for its measured costs"
    assert runners[0].graphed._group["order"] == [
        (action.stage, action.kind, action.micro_batch) for action in pipe.schedule.actions[0]
        if action.kind in "FBIW"], "the captures follow the schedule the rank runs"
