"""Recomputation: every schedule equals one process; sent outputs freed only where no recomputation reads them."""

from __future__ import annotations

import copy
import io
import weakref

import pytest
import torch
from torch import nn

from models import HIDDEN, Block
from equivalence import GRAPH_OPTION
from ranks import held_stages, needs_cuda, rank_device, run_ranks

import pipecomm
from pipecomm.runtime import stage_runner
from pipecomm.runtime.gradient_sink import GradientSink
from pipecomm.runtime.recompute import checkpoint_stages
from pipecomm.schedules.schedule import SCHEDULES
from pipecomm.runtime.split_backward import WeightGradStore, check_reported, defer_linear_weight_grads

BATCH = 8
SEQ = 3
STEPS = 3
MICRO_BATCHES = 4
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# Every schedule on 2 ranks, with its stages per rank; "auto" runs one step more, its first on the plan.
CASES = [(name, 2 if name in ("interleaved-1f1b", "zb-v") else 1, STEPS) for name in SCHEDULES] + [("auto", 1, 4)]


class Gate(nn.Module):
    """Multiplies by a tensor given by keyword, which the product saves for its other factor's gradient."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, *, skip):
        return self.proj(x) * skip


class Gated(nn.Module):
    """A block with a frozen norm, then a gate whose keyword input is also sent on: a Linear's output that only
    the gate saves."""

    def __init__(self, last: bool):
        super().__init__()
        self.block = Block()
        self.block.norm.requires_grad_(False)
        self.side = nn.Linear(HIDDEN, HIDDEN)
        self.gate = Gate()
        self.last = last

    def forward(self, x, skip=None):
        h = self.block(x if skip is None else x + skip)
        side = self.side(h)
        out = self.gate(h, skip=side)
        return out if self.last else (out, side)


class NoParameters(nn.Module):
    """Sends on a view of its received input beside the product."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last

    def forward(self, x, skip):
        out = torch.tanh(x) * skip
        return out if self.last else (out, skip.view_as(skip))


def gated_stages(num_stages: int) -> list[nn.Module]:
    return [Gated(last=s == num_stages - 1) for s in range(num_stages)]


def mixed_stages(num_stages: int) -> list[nn.Module]:
    """Stages with and without parameters, the third (of four) wholly frozen."""
    stages = [Gated(last=False) if s % 2 == 0 else NoParameters(last=s == num_stages - 1) for s in range(num_stages)]
    if num_stages == 4:
        stages[2].requires_grad_(False)
    return stages


def blocks_and_gates(module: nn.Module) -> bool:
    return isinstance(module, (Block, Gate))


def mse(output, target):
    return nn.functional.mse_loss(output, target)


def batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randn(BATCH, SEQ, HIDDEN, generator=generator)


def run_stages(stages, x):
    """The unsplit model in plain PyTorch: each stage's output feeds the next as the pipeline passes it."""
    for stage in stages:
        x = stage(*x) if isinstance(x, tuple) else stage(x)
    return x


def train_like_one_process(rank: int, world_size: int, recompute) -> str:
    """For each model and schedule, AdamW steps of the recomputing pipeline against the unsplit model without
    recomputation: every step's loss and gradients, and the parameters at the end."""
    for build in (gated_stages, mixed_stages):
        for schedule, chunks, steps in CASES:
            num_stages = world_size * chunks
            torch.manual_seed(0)
            stages = build(num_stages)
            reference = copy.deepcopy(stages)
            mine = held_stages(schedule, world_size, MICRO_BATCHES, chunks, rank)
            pipe = pipecomm.Pipeline([stages[s] for s in mine], stage=mine, num_stages=num_stages, loss_fn=mse,
                                     micro_batches=MICRO_BATCHES, schedule=schedule, timeout=30, recompute=recompute)
            where = f"{build.__name__}, {schedule}"
            named = [(f"{where}, stage {s}: {name}", p) for s in mine for name, p in stages[s].named_parameters()]
            ref_params = [p for s in mine for p in reference[s].parameters()]
            # A rank holding only parameterless stages has nothing to step.
            optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-2) if named else None
            ref_optimizer = torch.optim.AdamW([p for stage in reference for p in stage.parameters()], lr=1e-2)
            for step in range(steps):
                x, target = batch(step)
                loss = pipe.step(x, target=target)
                ref_loss = mse(run_stages(reference, x), target)
                ref_loss.backward()
                torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE, msg=f"{where}: loss of step {step}")
                for (name, param), ref_param in zip(named, ref_params):
                    if ref_param.grad is None:
                        assert param.grad is None, f"{name} got a gradient at step {step}"
                    else:
                        torch.testing.assert_close(param.grad, ref_param.grad, **TOLERANCE, msg=f"{name}, step {step}")
                if optimizer:
                    optimizer.step()
                    optimizer.zero_grad()
                ref_optimizer.step()
                ref_optimizer.zero_grad()
            for (name, param), ref_param in zip(named, ref_params):
                torch.testing.assert_close(param.detach(), ref_param.detach(), **TOLERANCE, msg=name)
            pipe.close()
            assert not any("forward" in module.__dict__ for stage in stages for module in stage.modules()), where
    return "ok"


@pytest.mark.parametrize("recompute", [True, blocks_and_gates], ids=["whole-stages", "selective"])
def test_recompute_with_every_schedule_equals_one_process(tmp_path, recompute):
    run_ranks(2, train_like_one_process, tmp_path, recompute, timeout=240)


# -- dropout ------------------------------------------------------------------------------------


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.block(x))


def dropout_blocks(module: nn.Module) -> bool:
    return isinstance(module, DropoutBlock)


def seed(step: int, stage: int) -> int:
    return 1000 * step + stage


def dropout_masks_survive_recomputation(rank: int, world_size: int, recompute, kind: str = "cpu",
                                        steps: int = STEPS) -> str:
    """Stage s draws its masks from seed(step, s), on its rank as in the reference, which runs each stage over the
    micro-batches in order; the recomputation must draw the forward's masks and leave the random state as it was.
    ``kind`` as tests/equivalence.py's: on GPUs the reference runs on the rank's GPU, whose generator draws the
    masks."""
    device = rank_device(rank, "cuda" if kind.startswith("cuda") else "cpu")
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        torch.manual_seed(0)
        stages = [nn.Sequential(DropoutBlock(), nn.Linear(HIDDEN, HIDDEN)).to(device) for _ in range(world_size)]
        reference = copy.deepcopy(stages)
        pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=mse,
                                 micro_batches=MICRO_BATCHES, schedule=schedule, timeout=30, recompute=recompute,
                                 cuda_graphs=GRAPH_OPTION[kind])
        for step in range(steps):
            x, target = (tensor.to(device) for tensor in batch(step))
            torch.manual_seed(seed(step, rank))
            loss = pipe.step(x, target=target)
            outputs = list(x.chunk(MICRO_BATCHES))
            for index, stage in enumerate(reference):
                torch.manual_seed(seed(step, index))
                outputs = [stage(output) for output in outputs]
            ref_loss = sum(mse(o, t) for o, t in zip(outputs, target.chunk(MICRO_BATCHES))) / MICRO_BATCHES
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), **TOLERANCE, msg=f"{schedule}: loss of step {step}")
            for (name, param), ref_param in zip(stages[rank].named_parameters(), reference[rank].parameters()):
                torch.testing.assert_close(param.grad, ref_param.grad, **TOLERANCE, msg=f"{schedule}, {name}, {step}")
                param.grad = ref_param.grad = None
        if kind in ("cuda-graphs", "cuda-auto"):  # a trial may drop graphs no faster than eager on the GPU
            state = pipe.cuda_graph_states[rank]
            assert state == "replaying" or state.startswith("eager: replaying its CUDA graphs took"), (schedule, state)
        pipe.close()
    return "ok"


@pytest.mark.parametrize("recompute", [True, dropout_blocks], ids=["whole-stages", "selective"])
def test_dropout_in_recomputed_stages_draws_the_forward_masks(tmp_path, recompute):
    run_ranks(2, dropout_masks_survive_recomputation, tmp_path, recompute, timeout=120)


@needs_cuda
@pytest.mark.parametrize("kind", ["cuda-graphs", "cuda-auto"])
@pytest.mark.parametrize("recompute", [True, dropout_blocks], ids=["whole-stages", "selective"])
def test_dropout_in_recomputed_stages_replaying_cuda_graphs_draws_the_forward_masks(tmp_path, recompute, kind):
    """Each backward graph's recomputation redraws its forward's masks: it replays from where its forward's replay
    began (a captured recomputation rewinds the generator within its own graph, which alone drew other masks)."""
    run_ranks(2, dropout_masks_survive_recomputation, tmp_path, recompute, kind, 5, timeout=240)


def graphs_draw_as_eager_does(rank: int, world_size: int, recompute) -> str:
    """The same seeded steps with and without CUDA graphs, dropout in every stage, one and two stages per rank (a rank's
    stages captured together): every gradient equal. (zb-v and zb-h2 rebuild their order from measured costs, which
    may order a rank's draws otherwise from one run to the next.)"""
    device = rank_device(rank, "cuda")
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        runs = []
        for cuda_graphs in (False, True):
            torch.manual_seed(0)
            stages = [nn.Sequential(DropoutBlock(), nn.Linear(HIDDEN, HIDDEN)) for _ in range(world_size * chunks)]
            mine = held_stages(schedule, world_size, MICRO_BATCHES, chunks, rank)
            modules = [stages[s].to(device) for s in mine]
            pipe = pipecomm.Pipeline(modules, stage=mine, num_stages=len(stages), loss_fn=mse,
                                     micro_batches=MICRO_BATCHES, schedule=schedule, timeout=30, recompute=recompute,
                                     cuda_graphs=cuda_graphs)
            grads = []
            for step in range(STEPS):
                x, target = (tensor.to(device) for tensor in batch(step))
                torch.manual_seed(seed(step, rank))
                pipe.step(x, target=target)
                grads.append([param.grad.clone() for module in modules for param in module.parameters()])
                for module in modules:
                    module.zero_grad(set_to_none=True)
            assert not cuda_graphs or set(pipe.cuda_graph_states.values()) == {"replaying"}, pipe.cuda_graph_states
            pipe.close()
            runs.append(grads)
        for step, (eager, graphed) in enumerate(zip(*runs)):
            for index, (one, other) in enumerate(zip(eager, graphed)):
                torch.testing.assert_close(other, one, rtol=1e-6, atol=1e-7, msg=f"{schedule}, step {step}, #{index}")
    return "ok"


@needs_cuda
@pytest.mark.parametrize("recompute", [False, True, dropout_blocks], ids=["none", "whole-stages", "selective"])
def test_cuda_graphs_draw_the_random_numbers_eager_draws(tmp_path, recompute):
    run_ranks(2, graphs_draw_as_eager_does, tmp_path, recompute, timeout=240)


# -- what stays alive between forward and backward -----------------------------------------------


def stage_backward(x: torch.Tensor, outputs: list, grads: list, params: list) -> tuple:
    """The executor's backward of a non-last stage: gradients of ``outputs`` w.r.t. ``x`` and ``params``."""
    return stage_runner.run_backward(outputs, grads, [x] + params, keep_graph=False)


@pytest.mark.parametrize("recompute", [True, blocks_and_gates], ids=["whole-stage", "selective"])
def test_sent_outputs_are_freed_only_where_no_recomputation_reads_them(recompute):
    torch.manual_seed(0)
    stage = Gated(last=False)
    reference = copy.deepcopy(stage)
    undo = checkpoint_stages([stage], recompute)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    outputs = list(stage(x))
    freeable = stage_runner.held_only_by_themselves(outputs)
    pointers = [output.untyped_storage().data_ptr() for output in outputs]
    stage_runner.free_data(freeable)
    freed = [output.untyped_storage().data_ptr() != pointer for output, pointer in zip(outputs, pointers)]
    # Whole: the stage's outputs are recomputed. Selective: the gate's keyword input, also sent, is read by its
    # recomputation, so it stays; the gate's own output is recomputed.
    assert freed == ([True, True] if recompute is True else [True, False])
    if recompute is True:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda t: t):
            stage(x)
        assert {tensor.untyped_storage().data_ptr() for tensor in saved} == {x.untyped_storage().data_ptr()}, \
            "only the stage's input is kept for its backward"

    grads = [torch.randn(BATCH, HIDDEN) for _ in outputs]
    params = [p for p in stage.parameters() if p.requires_grad]
    results = stage_backward(x, outputs, grads, params)
    ref_x = x.detach().requires_grad_()
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    expected = torch.autograd.grad(reference(ref_x), [ref_x] + ref_params, grads)
    for result, value in zip(results, expected):
        torch.testing.assert_close(result, value)
    undo()


@pytest.mark.parametrize("recompute", [True, blocks_and_gates], ids=["whole-stage", "selective"])
def test_deferred_weight_gradients_take_their_inputs_from_the_recomputation(recompute):
    torch.manual_seed(0)
    stage = Gated(last=False)
    reference = copy.deepcopy(stage)
    store = WeightGradStore()
    undo_deferral = defer_linear_weight_grads([stage], store)
    undo_recompute = checkpoint_stages([stage], recompute)  # as the Pipeline does: recomputing the deferring forward
    linear_inputs = []
    pin_check = stage.block.proj.register_forward_pre_hook(
        lambda _, args: linear_inputs.append(weakref.ref(args[0])) if not linear_inputs else None)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    store.recording = deferrals = []
    outputs = list(stage(x))
    store.recording = None
    assert sorted(name for name, _ in deferrals) == ["block.proj", "gate.proj", "side"]
    assert linear_inputs[0]() is None, "a checkpointed Linear's input is not pinned until the backward"

    grads = [torch.randn(BATCH, HIDDEN) for _ in outputs]
    params = [p for p in stage.parameters() if p.requires_grad]
    store.collecting = collected = []
    results = stage_backward(x, outputs, grads, params)
    store.collecting = None
    check_reported(deferrals, outputs, "the test's backward")  # raises if a deferral went unreported
    assert len(collected) == 3
    sink = GradientSink(list(stage.parameters()), main_grad=False)
    sink.add(results[1:], params)
    sink.add_weight_grads(collected)

    ref_x = x.detach().requires_grad_()
    torch.autograd.backward(reference(ref_x), grads)
    torch.testing.assert_close(results[0], ref_x.grad)
    for (name, param), ref_param in zip(stage.named_parameters(), reference.parameters()):
        if ref_param.grad is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, ref_param.grad, msg=name)
    pin_check.remove()
    undo_deferral()
    undo_recompute()


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [True, lambda module: isinstance(module, nn.BatchNorm1d)],
                         ids=["stage", "picked"])
def test_recomputation_leaves_batch_norm_statistics_as_one_forward_does(recompute):
    """The recomputation ran batch norm's forward again, in training: every micro-batch updated its running
    statistics twice (24 batches tracked where one process has 12), and eval outputs and checkpoints differed."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    reference = copy.deepcopy(module)
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             recompute=recompute)
    for step in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        pipe.step(x, target=y)
        for a, b in zip(x.chunk(4), y.chunk(4)):
            (nn.functional.mse_loss(reference(a), b) / 4).backward()
    for name, buffer in reference[1].named_buffers():
        torch.testing.assert_close(module[1].get_buffer(name), buffer, rtol=0, atol=0, msg=name)
    for param, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


class RunningMean(nn.Module):
    """Updates a running mean in its forward and reads it back: a recomputation would compute with the next value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.linear(x - self.mean)


class EMATarget(nn.Module):
    """An online network and its moving-average target, kept as frozen parameters and updated by the forward, as
    BYOL, MoCo and DINO keep theirs."""

    def __init__(self):
        super().__init__()
        self.online, self.target = nn.Linear(8, 8), nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for mine, online in zip(self.target.parameters(), self.online.parameters()):
                mine.mul_(0.9).add_(online, alpha=0.1)
        return self.online(x) + self.target(x)


@pytest.mark.parametrize(("updating", "changed"), [(RunningMean, "'mean'"), (EMATarget, "'target.weight'")],
                         ids=["buffer", "frozen-parameter"])
@pytest.mark.parametrize("recompute", [True, "picked"], ids=["stage", "picked"])
def test_a_recomputation_that_changes_a_buffer_or_frozen_parameter_again_is_refused(recompute, updating, changed):
    # It computed with the updated values (2% off one process's loss, gradients 10-100% for the running mean;
    # 1.4-2.8e-3 for the EMA target), silently.
    pipe = pipecomm.Pipeline(nn.Sequential(updating(), nn.Linear(8, 8)), stage=0, num_stages=1, micro_batches=4,
                             loss_fn=nn.functional.mse_loss,
                             recompute=recompute if recompute is True else lambda module: isinstance(module, updating))
    with pytest.raises(RuntimeError, match=rf"recomputing {updating.__name__}'s forward changed its buffer\(s\) or "
                       rf"frozen parameter\(s\) \[{changed}" if recompute is not True else
                       rf"frozen parameter\(s\) \[{changed.replace(chr(39), chr(39) + '0.', 1)}"):
        pipe.step(torch.randn(16, 8), target=torch.randn(16, 8))


@pytest.mark.parametrize("recompute", ["full", 1, None])
def test_recompute_must_be_a_bool_or_a_callable(recompute):
    with pytest.raises(ValueError, match="recompute must be True, False or a callable"):
        checkpoint_stages([Block()], recompute)


def test_the_callable_must_answer_with_a_bool():
    with pytest.raises(ValueError, match=r"recompute\(Block\) returned None"):
        checkpoint_stages([Block()], lambda module: None)


def test_only_the_outermost_picked_modules_are_wrapped_and_undo_restores_every_forward():
    shared = Gate()
    outer = nn.ModuleDict({"gate": shared, "again": shared, "block": Block(), "linear": nn.Linear(HIDDEN, HIDDEN)})
    own_forward = outer["linear"].forward

    def forward(x):  # an instance attribute, as torch.compile and others set
        return own_forward(x)

    outer["linear"].forward = forward
    before = {name: module.forward for name, module in outer.named_modules()}
    undo = checkpoint_stages([outer], lambda module: isinstance(module, (Gate, Block, nn.Linear)))
    wrapped = {name for name, module in outer.named_modules() if module.forward != before[name]}
    assert wrapped == {"gate", "block", "linear"}, "picked modules, once each, none inside a picked one"
    undo()
    assert {name: module.forward for name, module in outer.named_modules()} == before
    assert outer["linear"].forward is forward
    assert not any("forward" in module.__dict__ for name, module in outer.named_modules() if name != "linear")


# -- copies, and what a picked module reads besides its arguments --------------------------------


def _one_stage_pipeline(module: nn.Module, recompute, schedule: str = "1f1b") -> pipecomm.Pipeline:
    return pipecomm.Pipeline(module, stage=0, num_stages=1, loss_fn=mse, micro_batches=MICRO_BATCHES,
                             schedule=schedule, recompute=recompute)


@pytest.mark.parametrize("recompute", [True, lambda module: isinstance(module, Block)], ids=["whole-stage",
                                                                                             "selective"])
def test_a_copy_made_while_the_pipeline_recomputes_runs_its_own_weights(recompute):
    """An EMA or teacher model deep-copied from a stage the Pipeline holds (torch.optim.swa_utils.AveragedModel) ran
    the original's weights: the copy's forward was a closure over the original module."""
    torch.manual_seed(0)
    stage = nn.Sequential(Block(), Block())
    pipe = _one_stage_pipeline(stage, recompute)
    copied = copy.deepcopy(stage)
    with torch.no_grad():
        for param in copied.parameters():
            param.mul_(0.5)
    reference = copy.deepcopy(copied)
    for module in reference.modules():
        module.__dict__.pop("forward", None)  # plain modules, as they were before the Pipeline
    x = torch.randn(BATCH, SEQ, HIDDEN)
    torch.testing.assert_close(copied(x), reference(x), rtol=0, atol=0)
    assert not torch.equal(copied(x), stage(x))
    torch.save(stage, io.BytesIO())  # and the stage pickles
    pipe.close()


class Stashing(nn.Module):
    """Sets a tensor on its child before calling it, which the child reads beside its argument."""

    def __init__(self):
        super().__init__()
        self.block = StashReader()

    def forward(self, x):
        self.block.scale = x.mean(dim=-1, keepdim=True)
        return self.block(x)


class StashReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.scale = None

    def forward(self, x):
        return self.proj(x) * self.scale


class StashingInPlace(Stashing):
    def __init__(self):
        super().__init__()
        self.block.scale = torch.zeros(BATCH // MICRO_BATCHES, SEQ, 1)

    def forward(self, x):
        self.block.scale.copy_(x.mean(dim=-1, keepdim=True))
        return self.block(x)


@pytest.mark.parametrize(("parent", "how"), [(Stashing, "replaced"), (StashingInPlace, "changed in place")])
def test_a_picked_module_reading_a_tensor_its_parent_stashed_on_it_is_refused(parent, how):
    """gpipe runs every micro-batch's forward before the first backward: the recomputation of micro-batch 0 would read
    micro-batch 3's tensor, and its gradients came out 7-64% off, silently."""
    torch.manual_seed(0)
    pipe = _one_stage_pipeline(parent(), lambda module: isinstance(module, StashReader), schedule="gpipe")
    with pytest.raises(RuntimeError, match=f"the recomputed StashReader reads its tensor attribute 'scale', which was "
                                           f"{how} between this micro-batch's forward and its recomputation"):
        x, target = batch(0)
        pipe.step(x, target=target)
    pipe.close()


class Passing(nn.Module):
    """The same, its tensor passed as an argument; the child keeps its own output for logging."""

    def __init__(self):
        super().__init__()
        self.block = OutputKeeper()

    def forward(self, x):
        return self.block(x, x.mean(dim=-1, keepdim=True))


class OutputKeeper(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, scale):
        self.last = torch.tanh(x).detach()  # set by the forward, not read by it
        return self.proj(x) * scale


def test_attributes_a_picked_module_sets_itself_are_not_refused():
    torch.manual_seed(0)
    module = Passing()
    reference = copy.deepcopy(module)
    pipe = _one_stage_pipeline(module, lambda module: isinstance(module, OutputKeeper), schedule="gpipe")
    x, target = batch(0)
    loss = pipe.step(x, target=target)
    ref_loss = sum(mse(reference(xs), ts) for xs, ts in zip(x.chunk(MICRO_BATCHES), target.chunk(MICRO_BATCHES)))
    (ref_loss / MICRO_BATCHES).backward()
    torch.testing.assert_close(loss, ref_loss.detach() / MICRO_BATCHES, **TOLERANCE)
    for param, ref_param in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, **TOLERANCE)
    pipe.close()
