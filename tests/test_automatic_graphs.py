"""cuda_graphs="auto", the default: where it applies, the shape watch, and on a GPU the adoption of graphs, checked
against one eager process through short batches, frozen parameters, changed attributes and captures that fail."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipecomm
from pipecomm.runtime.checks import graph_mode
from pipecomm.runtime import boundary, graph_runner
from pipecomm.runtime.cuda_graphs import GraphedStage, signature, signature_difference
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.graph_runner import ShapeWatch
from ranks import graph_pool_bytes, needs_cuda

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("device", "options", "expected"), [
    ("cpu", {}, False),
    ("cuda", {}, "auto"),
    ("cuda", {"offload": True}, False),
    ("cuda", {"sharded": True}, False),
])
def test_auto_applies_only_where_graphs_can_serve(device, options, expected):
    settings = {"sharded": False, "offload": False, **options}
    assert graph_mode("auto", torch.device(device), [nn.Linear(2, 2)], **settings) == expected
    assert graph_mode(True, torch.device(device), [nn.Linear(2, 2)], **settings) is True
    assert graph_mode(False, torch.device(device), [nn.Linear(2, 2)], **settings) is False


def test_a_bad_cuda_graphs_value_is_refused():
    with pytest.raises(ValueError, match='cuda_graphs must be True, False or "auto", not \'yes\''):
        pipecomm.Pipeline(nn.Linear(4, 4), stage=0, num_stages=1, micro_batches=2,
                          loss_fn=nn.functional.mse_loss, cuda_graphs="yes")


def test_the_default_on_cpu_never_captures():
    pipe = pipecomm.Pipeline(nn.Linear(4, 4), stage=0, num_stages=1, micro_batches=2, loss_fn=nn.functional.mse_loss)
    for _ in range(3):
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert pipe.cuda_graph_states == {0: "eager"}


def _watched(steps: list[list[tuple]]) -> list[tuple[int, int]]:
    """(steps alike, changes) after each step of micro-batches given as (args, targets)."""
    watch, seen = ShapeWatch(), []
    for step in steps:
        for args, targets in step:
            watch.see(args, {}, targets)
        watch.step_done()
        seen.append((watch.steps_alike, watch.changes))
    return seen


def test_the_watch_counts_steps_whose_micro_batches_share_one_signature():
    a, b = torch.zeros(2, 3), torch.zeros(1, 3)
    assert _watched([[((a,), ())] * 2] * 3) == [(1, 0), (2, 0), (3, 0)]
    # A short micro-batch in a step: that step counts for nothing (a change), and the next starts again.
    assert _watched([[((a,), ())] * 2, [((a,), ()), ((b,), ())], [((a,), ())]]) == [(1, 0), (0, 1), (1, 1)]
    # Shapes, dtypes, requires_grad, non-tensor leaves and targets all count.
    for args, targets in [((b,), ()), ((a.double(),), ()), ((a.clone().requires_grad_(),), ()), ((a, 1), ()),
                          ((a,), (a,))]:
        assert _watched([[((a,), ())], [(args, targets)]]) == [(1, 0), (1, 1)]


class Cached(nn.Module):
    """Reads a tensor it keeps as a plain attribute, and a plain value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.offset = torch.zeros(4)
        self.scale = 1.0

    def forward(self, x):
        return self.linear(x) * self.scale + self.offset


@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: None, None),
    (lambda m: m.offset.add_(1.0), None),  # in place: the replay reads the same memory
    (lambda m: setattr(m, "offset", torch.ones(4)), r"Cached.offset \(was a tensor of shape \(4,\)\)"),
    (lambda m: setattr(m, "scale", 2.0), r"Cached.scale \(was 1.0\)"),
    (lambda m: setattr(m, "scale", 1), r"Cached.scale"),  # 1 is not 1.0 to a replay's baked constant's type
    (lambda m: m.eval(), r"Cached.training \(was True\).*Linear.training"),
    (lambda m: m.linear.weight.requires_grad_(False), "parameters' requires_grad"),
    (lambda m: setattr(m.linear, "weight", nn.Parameter(m.linear.weight.detach().clone())),
     "parameters' memory"),
    (lambda m: m.to(torch.float64), "parameters' memory.*buffers' memory|parameters' memory"),
    (lambda m: setattr(m, "linear", nn.Linear(4, 4)), "parameters' memory"),  # a submodule replaced
    (lambda m: m.linear.add_module("extra", nn.Identity()), "parameters' memory"),  # the tree changed
    (lambda m: m.linear.weight.register_hook(lambda grad: grad * 2), "parameters' gradient hooks"),
    (lambda m: m.linear.bias.register_post_accumulate_grad_hook(print), "parameters' gradient hooks"),
    (lambda m: torch.set_float32_matmul_precision("high"), "kernel settings"),
    (lambda m: torch.backends.cuda.enable_flash_sdp(False), "kernel settings"),
    (lambda m: torch.use_deterministic_algorithms(True), "kernel settings"),
])
def test_what_the_replays_cannot_see_is_named_as_changed(change, expected):
    module = Cached()
    settings = (torch.get_float32_matmul_precision(), torch.backends.cuda.flash_sdp_enabled(),
                torch.are_deterministic_algorithms_enabled())
    try:
        _changed_after_capture(module, change, expected)
    finally:
        torch.set_float32_matmul_precision(settings[0])
        torch.backends.cuda.enable_flash_sdp(settings[1])
        torch.use_deterministic_algorithms(settings[2])


def _changed_after_capture(module: Cached, change, expected) -> None:
    graphed = GraphedStage(module, GradientSink(list(module.parameters()), main_grad=False), [("F", 0), ("B", 0)],
                           stage=0, loss=None)
    graphed.record_state()  # as a capture ends
    change(module)
    found = graphed.changed_since_capture()
    if expected is None:
        assert found is None
    else:
        assert found is not None and re.search(expected, found), found


@dataclasses.dataclass
class Scale:
    factor: float = 1.0


class ScaledBetween(nn.Module):
    """Reads a config's value between its annotated modules: code the capture makes a constant."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
        self.config = Scale()

    def forward(self, x):
        return self.second(self.first(x) * self.config.factor)


def test_a_value_the_split_capture_read_is_named_as_changed():
    """A stage cut by split checks such values at each call, which a replay does not make: the graphs ask too."""
    model = ScaledBetween()
    stage = pipecomm.split(model, 2, 0, example_inputs=(torch.randn(2, 4),))
    graphed = GraphedStage(stage, GradientSink(list(stage.parameters()), main_grad=False), [("F", 0), ("B", 0)],
                           stage=0, loss=None)
    graphed.record_state()
    assert graphed.changed_since_capture() is None
    model.config.factor = 2.0
    assert "Scale (config).factor: 1.0 at the capture, 2.0 now" in graphed.changed_since_capture()


def test_cuda_graphs_true_refuses_a_gradient_hook_it_would_not_replay():
    module = Cached()
    module.linear.weight.register_hook(lambda grad: grad * 2)
    graphed = GraphedStage(module, GradientSink(list(module.parameters()), main_grad=False), [("F", 0), ("B", 0)],
                           stage=0, loss=None)
    with pytest.raises(ValueError, match="stage 0's parameter 'linear.weight' has a gradient hook"):
        graphed.forward(0, (torch.randn(2, 4),), ())


# -- on a GPU ----------------------------------------------------------------------------------


class Scaled(nn.Module):
    """An MLP whose output is scaled by a plain attribute, which a replay would read as the capture saw it."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 32), nn.Linear(32, 8)
        self.scale = 1.0

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))) * self.scale


def _pipeline(module: nn.Module, **options) -> pipecomm.Pipeline:
    return pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             device="cuda", **options)


def _one_process(reference: nn.Module, x, y) -> tuple[torch.Tensor, list]:
    """Gradient accumulation: a backward per micro-batch (under autocast, one backward of the summed losses would add
    the micro-batches' gradients of a weight's cached bf16 cast in bf16)."""
    loss = 0
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        micro_batch_loss = nn.functional.mse_loss(reference(xs), ys) / 4
        micro_batch_loss.backward()
        loss = loss + micro_batch_loss.detach()
    return loss, [None if p.grad is None else p.grad.clone() for p in reference.parameters()]


@pytest.fixture(autouse=True)
def _graphs_kept_whatever_the_trial_times(monkeypatch):
    """These tests follow the graphs' states, not their speed: on a shared GPU a tiny stage's replays timed 0.94x eager
    once, over the trial's bar, and the graphs were given up as GPU-bound where the test expected replays."""
    monkeypatch.setattr(graph_runner, "_KEEP_BELOW", float("inf"))


def _train(steps: int, before_step=None, batch=lambda step: 16, module=None, data_grads=lambda step: False,
           around_step=lambda step: contextlib.nullcontext()) -> tuple[pipecomm.Pipeline, list]:
    """``steps`` SGD steps of the default Pipeline and of one eager process, each step's loss and gradients equal
    (in the steps ``data_grads`` names, the input's and target's too, which require grad), each step of both inside
    ``around_step(step)``; returns the Pipeline and its graph states after each step."""
    torch.manual_seed(0)
    module = (module or Scaled()).cuda()
    reference = copy.deepcopy(module)
    pipe = _pipeline(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    states = []
    for step in range(steps):
        if before_step:
            before_step(step, module)
            before_step(step, reference)
        x, y = torch.randn(batch(step), 8, device="cuda"), torch.randn(batch(step), 8, device="cuda")
        ref_x, ref_y = x.clone().requires_grad_(data_grads(step)), y.clone().requires_grad_(data_grads(step))
        with around_step(step):
            loss = pipe.step(x.requires_grad_(data_grads(step)), target=y.requires_grad_(data_grads(step)))
        with around_step(step):
            ref_loss, ref_grads = _one_process(reference, ref_x, ref_y)
        torch.testing.assert_close(loss, ref_loss, **TOLERANCE, msg=f"loss of step {step}")
        for data, ref in ((x, ref_x), (y, ref_y)) if data_grads(step) else ():
            torch.testing.assert_close(data.grad, ref.grad, **TOLERANCE, msg=f"the data's gradient, step {step}")
        for param, ref_grad in zip(module.parameters(), ref_grads):
            if ref_grad is None:
                assert param.grad is None, f"step {step}"
            else:
                torch.testing.assert_close(param.grad, ref_grad, **TOLERANCE, msg=f"step {step}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        states.append(pipe.cuda_graph_states[0])
    return pipe, states


@needs_cuda
def test_graphs_are_adopted_at_the_third_step_and_train_as_one_process():
    _, states = _train(5)
    assert states == ["watching", "to capture", "replaying", "replaying", "replaying"]


@needs_cuda
def test_a_short_batch_runs_eagerly_beside_the_graphs():
    _, states = _train(6, batch=lambda step: 8 if step == 4 else 16)
    assert states[2:] == ["replaying"] * 4


@needs_cuda
def test_a_batch_that_requires_grad_runs_eagerly_beside_the_graphs_and_gets_its_gradients():
    """No graph reaches the caller's autograd graph: the step whose input and target require grad runs eagerly,
    exact, and the replays go on after it."""
    _, states = _train(6, data_grads=lambda step: step == 3)
    assert states[2:] == ["replaying"] * 4


@needs_cuda
@pytest.mark.parametrize("change", ["freeze", "attribute", "eval"])
def test_a_change_the_graphs_cannot_see_drops_them_until_shapes_hold_again(change):
    def before_step(step, module):
        if step == 4:
            if change == "freeze":
                module.first.requires_grad_(False)
            elif change == "attribute":
                module.scale = 0.5
            else:
                module.eval()  # no dropout here: the same function, but a replay must not be trusted to know

    _, states = _train(8, before_step=before_step)
    assert states == ["watching", "to capture", "replaying", "replaying", "watching", "to capture", "replaying",
                      "replaying"]


@needs_cuda
@pytest.mark.parametrize("from_step", [0, 4])
def test_replays_under_autocast_train_as_one_process_under_autocast(from_step):
    """The user's autocast around the step: replays cast the weights each pass (autocast's cache, which would keep a
    cast from before the optimizer's step, is off in the capture), and autocast turned on later drops the graphs."""
    _, states = _train(8, around_step=lambda step: torch.autocast("cuda", dtype=torch.bfloat16,
                                                                  enabled=step >= from_step))
    assert states[-2:] == ["replaying", "replaying"]
    assert from_step == 0 or states[4] == "watching", states


class Checkpointed(Scaled):
    """Recomputes its first layer in the backward (torch.utils.checkpoint, as Hugging Face's blocks do)."""

    def forward(self, x):
        hidden = checkpoint(self.first, x, use_reentrant=False)
        return self.second(torch.tanh(hidden)) * self.scale


@needs_cuda
def test_checkpointed_layers_replay_as_one_process():
    _, states = _train(5, module=Checkpointed())
    assert states == ["watching", "to capture", "replaying", "replaying", "replaying"]


class CheckpointedDropout(Scaled):
    """A dropout inside the model's own checkpoint: its recomputation in the backward redraws the forward's mask."""

    def forward(self, x):
        hidden = checkpoint(lambda x: nn.functional.dropout(self.first(x), 0.5), x, use_reentrant=False)
        return self.second(torch.tanh(hidden)) * self.scale


@contextlib.contextmanager
def _seeded(step: int):
    torch.manual_seed(100 + step)
    yield


@needs_cuda
def test_a_recomputed_dropout_replays_the_forward_masks_as_one_process():
    """A backward graph's recomputation rewinds the generator within its own graph: replayed from anywhere but its
    forward's start, it drew other masks than the forward's (gradients off by 100%, and the check passed)."""
    _, states = _train(6, module=CheckpointedDropout(), around_step=_seeded)
    assert states[2:] == ["replaying"] * 4


class NoisyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + 1e-3 * torch.randn_like(grad)


class DrawsBothWays(Scaled):
    def forward(self, x):
        return NoisyBackward.apply(nn.functional.dropout(super().forward(x), 0.5))


@needs_cuda
def test_graphs_whose_forward_and_backward_both_draw_random_numbers_are_refused():
    """A backward replayed from its forward's random state (for a recomputation) cannot also draw its own numbers
    where eager does."""
    torch.manual_seed(0)
    pipe = _pipeline(DrawsBothWays().cuda(), cuda_graphs=True)
    with pytest.raises(ValueError, match="forward and backward passes .* both draw random numbers"):
        pipe.step(torch.randn(16, 8, device="cuda"), target=torch.randn(16, 8, device="cuda"))
    pipe.close()


class Branchy(Scaled):
    """Reads a value back to the host in its forward, which a capture cannot."""

    def forward(self, x):
        out = super().forward(x)
        return out if out.sum().item() > -1e30 else -out


@needs_cuda
def test_a_capture_that_fails_leaves_the_stage_eager_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, states = _train(5, module=Branchy())
    assert states[2:] == [states[2]] * 3 and states[2].startswith("eager: capturing its CUDA graphs failed")
    assert sum("runs eagerly from now on" in str(warning.message) for warning in caught) == 1


class Counting(Scaled):
    """Doubles its output on every other call: a replay repeats what the capture saw, an eager run does not."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * (2 if self.calls % 2 else 1)


@needs_cuda
def test_a_replay_that_differs_from_eager_is_not_used():
    torch.manual_seed(0)
    pipe = _pipeline(Counting().cuda())
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    with pytest.warns(UserWarning, match="differs from an eager run of the same micro-batch"):
        for _ in range(3):
            pipe.step(x, target=y)
    assert pipe.cuda_graph_states[0].startswith("eager: capturing its CUDA graphs failed (GraphCheckError")


class Slow(Scaled):
    """Keeps the GPU busy far longer than the host takes to launch it."""

    def forward(self, x):
        torch.cuda._sleep(20_000_000)
        return super().forward(x)


@needs_cuda
def test_a_stage_the_gpu_bounds_stays_eager():
    _, states = _train(4, module=Slow())
    assert states[0] == "watching"
    assert all(state.startswith("eager: the host launches a pass in") and "the GPU bounds it" in state
               for state in states[1:]), states


@needs_cuda
def test_dropout_replays_pass_the_check():
    torch.manual_seed(0)
    pipe = _pipeline(nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8)).cuda())
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    for _ in range(4):
        pipe.step(x, target=y)
    assert pipe.cuda_graph_states[0] == "replaying"


@needs_cuda
def test_graphs_asked_for_refuse_a_change_they_cannot_see():
    torch.manual_seed(0)
    module = Scaled().cuda()
    pipe = _pipeline(module, cuda_graphs=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    pipe.step(x, target=y)
    assert pipe.cuda_graph_states[0] == "replaying"
    module.scale = 2.0
    with pytest.raises(ValueError, match=r"Scaled.scale \(was 1.0\) changed since the CUDA graphs were captured"):
        pipe.step(x, target=y)


def test_a_signature_difference_names_the_tensor_and_what_differs():
    a = torch.zeros(2, 3)
    captured = signature(boundary.flatten(((a,), {})), boundary.flatten(()))
    needs_grad = signature(boundary.flatten(((a.clone().requires_grad_(),), {})), boundary.flatten(()))
    assert signature_difference(captured, captured) is None
    assert signature_difference(needs_grad, captured) == (
        "input tensor 0 is (2, 3) torch.float32 on cpu, requiring grad, but the graphs were captured for (2, 3) "
        "torch.float32 on cpu")


def _replaying_pipeline() -> pipecomm.Pipeline:
    """A Pipeline with cuda_graphs=True after the two steps that capture its graphs and replay them."""
    torch.manual_seed(0)
    pipe = _pipeline(Scaled().cuda(), cuda_graphs=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 8, device="cuda")
    for _ in range(2):
        pipe.step(x, target=y)
    assert pipe.cuda_graph_states[0] == "replaying"
    return pipe


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [True, "auto"])
def test_a_closed_pipeline_gives_its_graphs_memory_back(cuda_graphs):
    # bench/e2e.py read torch's own 1F1B peak 0.8 GB higher when rows with cuda_graphs=True had run before it in the
    # same processes (4x H200, p = 4: 4.22 GB against 3.40): graph pools outliving the Pipelines that captured them.
    gc.collect()
    torch.cuda.empty_cache()
    before = graph_pool_bytes()
    if cuda_graphs == "auto":
        pipe, states = _train(4)
        assert states[-1] == "replaying"
    else:
        pipe = _replaying_pipeline()
    assert graph_pool_bytes() > before
    pipe.close()
    del pipe
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert graph_pool_bytes() == before, "the closed Pipeline's CUDA graph pools are still reserved"


@needs_cuda
def test_pipelines_captured_one_after_another_leave_no_workspace_each():
    """cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it runs on: the captures of a thread share one
    stream, whose workspace the first made, so Pipelines captured one after another (as a recapture after a change
    is) leave nothing each behind."""
    def capture_and_close() -> int:
        pipe = _replaying_pipeline()
        pipe.close()
        del pipe
        gc.collect()
        return torch.cuda.memory_allocated()

    first = capture_and_close()
    assert [capture_and_close() - first for _ in range(3)] == [0, 0, 0]

