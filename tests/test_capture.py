"""split() of models with their own forward: captured, cut by annotations at any depth, exact, and loud when it cannot be."""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import re

import pytest
import torch
from torch import nn

from models import VOCAB, LongSkip, ResidualCNN, gpt2, llama

import pipecomm
from pipecomm.splitting.capture import CapturedStage



def split_in_two_like_the_model(model: nn.Module) -> list:
    """``model`` (one example of 4 features) split in two stages, checked bit for bit against an unsplit copy."""
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    x = torch.randn(3, 4)
    torch.testing.assert_close(chain(stages, x), reference(x), rtol=0, atol=0)
    return stages


def evaluated_like_the_model(model: nn.Module) -> tuple[list, torch.Tensor]:
    """``model`` split in two, then put in eval mode: its stages run as the unsplit model does, bit for bit; returns
    them and the input they ran on."""
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    x = torch.randn(3, 4)
    model.eval()
    torch.testing.assert_close(chain(stages, x), model(x), rtol=0, atol=0)
    return stages, x


def raises(message: str):
    return pytest.raises(ValueError, match=re.escape(message))


def chain(stages, *inputs, **kwargs):
    """The stages one after the other, as the pipeline runs them (a tuple is the next stage's positional arguments)."""
    output = stages[0](*inputs, **kwargs)
    for stage in stages[1:]:
        output = stage(*output) if isinstance(output, tuple) else stage(output)
    return output


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_same_grads(model, reference):
    """Gradients equal to rounding: an absolute error up to 1e-6 of each gradient's largest entry (a token embedding's
    sums, up to 53 in a Llama here, differ in the last bits between op orders on some CPUs: 7.6e-6 on an AMD EPYC)."""
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        scale = max(1.0, ref_param.grad.abs().max().item()) if ref_param.grad is not None else 1.0
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_hugging_face_models_split_on_their_own_submodules_are_exact(build, num_stages):
    model = build(num_stages)
    reference = copy.deepcopy(model)
    mask = torch.ones(2, 8, dtype=torch.long)
    stages = pipecomm.split(model, num_stages, list(range(num_stages)), example_inputs=(tokens(2, 8),),
                            example_kwargs={"attention_mask": mask})
    assert all(isinstance(stage, CapturedStage) for stage in stages)
    # Another batch and sequence length than the example, with padding: the capture is shape-generic.
    inputs, mask = tokens(3, 11, seed=1), torch.ones(3, 11, dtype=torch.long)
    mask[0, :4] = 0
    output = chain(stages, inputs, attention_mask=mask)
    expected = reference(inputs, attention_mask=mask)
    assert type(output) is type(expected)
    torch.testing.assert_close(output.logits, expected.logits, rtol=1e-5, atol=1e-6)
    output.logits.square().mean().backward()
    expected.logits.square().mean().backward()
    assert_same_grads(model, reference)
    # Each stage calls the user's own blocks; the tied embedding/head is reported as shared.
    blocks = model.transformer.h if build is gpt2 else model.model.layers
    called = [stage.get_submodule(name) for stage in stages for name in stage.layer_names]
    assert all(any(block is unit for unit in called) for block in blocks)
    if build is gpt2:
        assert stages[0].shared_parameters == {"transformer.wte.weight": (0, num_stages - 1)}
        assert stages[-1].shared_parameters == {"lm_head.weight": (0, num_stages - 1)}


def test_checkpoints_of_captured_stages_load_strictly_into_a_fresh_model():
    model = gpt2(2)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens(2, 8),))
    merged = pipecomm.merge_checkpoints([stage.state_dict() for stage in stages])
    fresh = gpt2(2)
    for param in fresh.parameters():
        nn.init.zeros_(param)
    fresh.load_state_dict(merged, strict=True)
    inputs = tokens(2, 8, seed=3)
    torch.testing.assert_close(fresh(inputs).logits, model(inputs).logits)


def test_a_deep_copy_of_a_captured_stage_is_a_stage_with_its_own_parameters():
    # What AveragedModel, an EMA or a teacher model does to the stage a rank holds.
    model = ReadsItsOwnValues(dropout=True)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    copies = [copy.deepcopy(stage) for stage in stages]
    for stage, copied in zip(stages, copies):
        assert isinstance(copied, CapturedStage) and type(copied).__name__ == type(stage).__name__
        for name in ("stage_index", "num_stages", "layer_names", "shared_parameters", "boundary_names"):
            assert getattr(copied, name) == getattr(stage, name), name
        for param, copied_param in zip(stage.parameters(), copied.parameters(), strict=True):
            assert copied_param is not param and torch.equal(copied_param, param)
    x = torch.randn(3, 4)
    torch.manual_seed(0)
    expected = chain(stages, x)
    torch.manual_seed(0)
    torch.testing.assert_close(chain(copies, x), expected, rtol=0, atol=0)
    averaged = torch.optim.swa_utils.AveragedModel(stages[1])
    assert averaged(torch.randn(3, 4)).shape == (3, 4)
    # A copy's mode is its own, as a teacher's: copies in eval run the eval capture while the stages go on training.
    for copied in copies:
        copied.eval()
    model.eval()
    expected = model(x)
    model.train()
    torch.testing.assert_close(chain(copies, x), expected, rtol=0, atol=0)
    torch.manual_seed(0)
    trained = chain(stages, x)
    torch.manual_seed(0)
    torch.testing.assert_close(trained, model(x), rtol=0, atol=0)
    assert not torch.equal(trained, expected)
    model.settings.temperature = 0.5  # and refuse a value changed since the capture, as the stages do
    with raises("Settings (settings).temperature: 1.0 at the capture, 0.5 now"):
        copies[0](x)


@dataclasses.dataclass
class HiddenAndAux:  # a plain dataclass, registered as a pytree by no one
    hidden: torch.Tensor
    aux: torch.Tensor


class ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.linear(x)
        return HiddenAndAux(hidden, hidden.square().mean())


class CarriesADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = ReturnsADataclass(), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1

    def forward(self, x):
        out = self.first(x)
        return self.second(out.hidden) + out.aux


def test_a_dataclass_a_block_returns_is_captured_and_crosses_as_its_tensors():
    # torch.export refused it at the block's call ("Only Tensors or scalars are supported"), where the runtime's
    # boundary registers such a dataclass itself.
    split_in_two_like_the_model(CarriesADataclass())


class ProjectsBothWays(nn.Module):
    """One weight read directly at the start and, transposed, at the end, as a tied projection in a forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1

    def forward(self, x):
        return self.second(self.first(x @ self.weight)) @ self.weight.t()


def test_what_only_parameters_feed_is_computed_where_it_is_used():
    # weight.t() ran on stage 0 and crossed the boundary with the activations at every micro-batch (its gradient
    # coming back the same way), and the received contiguous copy took another BLAS path than one process.
    model = ProjectsBothWays()
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    assert len(stages[0].boundary_names) == 1, stages[0].boundary_names  # the activations alone
    assert stages[0].shared_parameters == {"weight": (0, 1)}
    x = torch.randn(3, 4)
    chain(stages, x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=0, atol=0)


def test_functional_ops_between_children_are_kept_where_the_data_flow_puts_them():
    model = ResidualCNN()
    model.stem.pipeline_stage = model.conv1.pipeline_stage = 0
    model.conv2.pipeline_stage = model.head.pipeline_stage = 1
    reference = copy.deepcopy(model)
    images = torch.randn(2, 3, 8, 8)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(images,))
    # The residual (stem's relu output) crosses the cut next to conv1's output.
    assert len(stages[0].boundary_names) == 2
    images = torch.randn(5, 3, 8, 8)
    output = chain(stages, images)
    torch.testing.assert_close(output, reference(images), rtol=1e-5, atol=1e-6)
    output.sum().backward()
    reference(images).sum().backward()
    assert_same_grads(model, reference)


def test_a_skip_over_three_stages_crosses_every_boundary_in_between():
    model = LongSkip()
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, 4, [0, 1, 2, 3], example_inputs=(torch.randn(2, 8),))
    # Stage 0's output is both the skip and the next block's input: sent once, then carried by stages 1 and 2.
    skip, = stages[0].boundary_names
    assert all(skip in stage.boundary_names and len(stage.boundary_names) == 2 for stage in stages[1:3])
    x = torch.randn(3, 8)
    output = chain(stages, x)
    torch.testing.assert_close(output, reference(x))
    output.sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference)


def test_annotations_at_any_depth_and_inherited_from_the_nearest_ancestor():
    model = gpt2(2)
    for module in [model.transformer.wte, model.transformer.wpe, *model.transformer.h, model.transformer.ln_f]:
        del module.pipeline_stage
    model.transformer.pipeline_stage = 0  # everything inside, but for what is annotated otherwise
    model.transformer.h[2].pipeline_stage = 1
    model.transformer.h[3].pipeline_stage = 1
    model.transformer.ln_f.pipeline_stage = 1
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens(2, 8),))
    assert "transformer.h.1" in stages[0].layer_names and "transformer.h.2" in stages[1].layer_names
    inputs = tokens(2, 8, seed=2)
    torch.testing.assert_close(chain(stages, inputs).logits, model(inputs).logits)


def test_module_hooks_run_on_the_users_own_modules():
    model = gpt2(2)
    calls = []
    model.transformer.h[3].register_forward_hook(lambda module, args, output: calls.append(module))
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens(2, 8),))
    calls.clear()
    chain(stages, tokens(2, 8))
    assert calls == [model.transformer.h[3]]


class Doubling(nn.Module):
    """Two blocks on two stages; a forward pre-hook on each annotated block changes its input."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        for stage, block in enumerate(self.blocks):
            block.pipeline_stage = stage
            block.register_forward_pre_hook(lambda module, args: (args[0] * 2 + 0.1,))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_forward_pre_hooks_on_annotated_modules_run_once():
    """torch.export marks a module call's start after its pre-hooks: what they computed landed in the captured glue,
    then ran again in the module's own call."""
    model = Doubling()
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    x = torch.randn(3, 4)
    torch.testing.assert_close(chain(stages, x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_is_captured_and_recomputes(reentrant):
    """A reentrant checkpoint (Hugging Face's default) runs under no_grad inside an autograd.Function, which the
    capture could not cut into module calls (an IndexError deep in the rebuild); the layers still checkpoint."""
    model = llama(2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens(2, 8),))
    calls = {"split": 0, "one process": 0}
    for name, layer in (("split", model.model.layers[0]), ("one process", reference.model.layers[0])):
        layer.self_attn.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    inputs = tokens(2, 8, seed=2)
    chain(stages, inputs).logits.sum().backward()
    reference(inputs).logits.sum().backward()
    assert calls == {"split": 2, "one process": 2}  # the forward, and its recomputation in the backward
    assert_same_grads(model, reference)


class Residual(nn.Module):
    """A block whose forward has functional ops of its own (a wrapped module's call that torch.export loses shows)."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x):
        return x + nn.functional.gelu(self.linear(self.norm(x)))


@pytest.mark.parametrize("annotated", ["block", "wrapper"])
def test_torch_compile_wrappers_run_on_their_stage_as_the_model_calls_them(annotated):
    """Through a torch.compile wrapper the capture records no call of the block, whose body then landed in the glue,
    on the first stage (every block there, exact but not pipelined), and the stage called no compiled code."""
    blocks = nn.ModuleList(Residual() for _ in range(4))
    for index in range(4):
        if annotated == "block":
            blocks[index].pipeline_stage = index // 2
        blocks[index] = torch.compile(blocks[index], backend="eager")
        if annotated == "wrapper":
            blocks[index].pipeline_stage = index // 2
    model = Chain(blocks)
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    assert [stage.layer_names for stage in stages] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    assert stages[1].get_submodule("blocks.2") is blocks[2]
    x = torch.randn(3, 4)
    torch.testing.assert_close(chain(stages, x), reference(x), rtol=0, atol=0)


class Chain(nn.Module):
    def __init__(self, blocks: nn.ModuleList):
        super().__init__()
        self.blocks = blocks

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@dataclasses.dataclass
class Settings:
    temperature: float = 1.0
    verbose: bool = False


class ReadsItsOwnValues(nn.Module):
    """A forward that reads its training flag (a functional dropout, or a warning only) and a config's temperature
    outside its annotated modules, which the capture makes constants."""

    def __init__(self, dropout: bool):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
        self.settings = Settings()
        self.dropout = dropout

    def forward(self, x):
        h = self.first(x)
        if self.dropout:
            h = nn.functional.dropout(h, 0.5, self.training)
        elif self.training and self.settings.verbose:
            print("training")  # the flag changes nothing the capture holds
        return self.second(h / self.settings.temperature)


@pytest.mark.parametrize(("change", "dropout", "message"), [
    (lambda m: m.eval(), True, None),  # split captured the eval mode too
    (lambda m: m.eval(), False, None),
    (lambda m: setattr(m.settings, "temperature", 0.25),
     False, "Settings (settings).temperature: 1.0 at the capture, 0.25 now"),
], ids=["dropout-eval", "warning-eval", "config"])
def test_values_the_captured_forward_read_are_checked_before_each_call(change, dropout, message):
    model = ReadsItsOwnValues(dropout)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    change(model)
    x = torch.randn(3, 4)
    if message is None:
        torch.testing.assert_close(chain(stages, x), model(x), rtol=0, atol=0)
        return
    with raises(f"with these values as constants, and they have changed since: {message}."):
        stages[0](x)
    with raises(message):
        stages[1](torch.randn(3, 4))


def test_a_model_whose_forward_reads_its_training_flag_evaluates_and_trains_again():
    # Once, stage.eval() turned off the stage's own modules' dropout, but the capture's F.dropout(h, 0.5,
    # self.training) in the model's forward kept running, silently; then it was refused, and a Hugging Face model
    # (BART, Whisper) could not evaluate mid-training. Now each stage runs the capture its mode picks.
    model = ReadsItsOwnValues(dropout=True)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    x = torch.randn(64, 4)
    for stage in stages:
        stage.eval()
    torch.testing.assert_close(chain(stages, x), x @ model.first.weight.T @ model.second.weight.T
                               + model.first.bias @ model.second.weight.T + model.second.bias)
    model.eval()
    expected = model(x)
    for stage in stages:
        stage.train()
    assert model.training
    torch.manual_seed(0)
    trained = chain(stages, x)
    torch.manual_seed(0)
    torch.testing.assert_close(trained, model(x), rtol=0, atol=0)
    assert not torch.equal(trained, expected)  # the dropout runs again
    model.eval()
    torch.testing.assert_close(chain(stages, x), expected, rtol=0, atol=0)


class TwoBlocks(nn.Module):
    """Two Linear blocks annotated onto two stages; subclasses write the forward around them."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1


class DropsOutTwice(TwoBlocks):
    """Two training flags read outside the annotated modules: its own and its second block's."""

    def forward(self, x):
        h = nn.functional.dropout(self.first(x), 0.5, self.training)
        return self.second(nn.functional.dropout(h, 0.5, self.second.training))


class EitherFlag(TwoBlocks):
    """Drops out while either of two flags is set: a flip of either alone changes nothing."""

    def forward(self, x):
        h = self.first(x)
        if self.training or self.second.training:
            h = nn.functional.dropout(h, 0.5, True)
        return self.second(h)


def test_flags_that_change_the_code_together_only_are_watched():
    # Each flag was judged alone and dropped (its flip alone changed nothing): after model.eval() the training code,
    # its dropout included, kept running, silently.
    model = EitherFlag()
    evaluated_like_the_model(model)


class NoisyInTraining(TwoBlocks):
    """Adds noise to the first block's output in training only: in eval that output itself crosses the boundary."""

    def forward(self, x):
        h = self.first(x)
        if self.training:
            h = h + 0.1 * torch.randn_like(h)
        return self.second(h)


def test_a_module_output_crossing_in_one_mode_only_keeps_both_modes():
    # The comparison of the two captures' boundaries saw no value for a module's output: the eval mode was dropped and
    # model.eval() refused.
    model = NoisyInTraining()
    evaluated_like_the_model(model)


def test_training_flags_that_pick_neither_capture_are_refused():
    model = DropsOutTwice()
    stages, x = evaluated_like_the_model(model)
    model.train()
    model.second.eval()  # one of the two: neither the training capture nor the eval one
    with raises("Linear (second).training: True at the capture, False now. It was captured in training and in eval "
                "mode, with these flags all True or all False"):
        stages[0](x)


class SetsItsDefault(nn.Module):
    """Writes a setting it reads at its first call, as a Hugging Face classifier sets config.problem_type."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
        self.settings = Settings()
        self.settings.kind = None

    def forward(self, x):
        if self.settings.kind is None:
            self.settings.kind = "tanh"
        h = self.first(x)
        return self.second(torch.tanh(h) if self.settings.kind == "tanh" else h)


def test_a_value_the_forward_writes_at_its_first_call_is_captured_as_it_leaves_it():
    model = SetsItsDefault()
    stages = split_in_two_like_the_model(model)
    model.settings.kind = "linear"  # a change after the capture is still refused
    with raises("Settings (settings).kind: 'tanh' at the capture, 'linear' now"):
        stages[0](torch.randn(3, 4))


@dataclasses.dataclass(frozen=True)
class FrozenSettings:
    scale: float = 2.0


class HoldsOddObjects(nn.Module):
    """A frozen dataclass (which refuses every assignment, __class__ too), an enum member and a logger, held by the
    module whose forward the capture records: split must take them as they are."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
        self.settings, self.kind, self.log = FrozenSettings(), enum.Enum("Kind", "A").A, logging.getLogger("probe")

    def forward(self, x):
        return self.second(self.first(x) * self.settings.scale)


class ReadsItsBlocks(nn.Module):
    """A forward reading, outside its blocks, a block's training flag and a value the block holds: constants to the
    capture too, though the blocks' own code reads them afresh at each call."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
        self.first.scale = 1.0

    def forward(self, x):
        h = nn.functional.dropout(self.first(x) * self.first.scale, 0.5, self.second.training)
        return self.second(h)


def test_values_the_captured_forward_read_from_its_blocks_are_checked():
    model = ReadsItsBlocks()
    stages, x = evaluated_like_the_model(model)  # the block's flag picks the eval capture
    model.first.scale = 3.0
    with raises("Linear (first).scale: 1.0 at the capture, 3.0 now"):
        stages[0](x)


def test_objects_that_refuse_a_recording_class_are_still_split_and_watched():
    model = HoldsOddObjects()
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 4),))
    assert type(model.settings) is FrozenSettings and type(model.log) is logging.Logger
    x = torch.randn(3, 4)
    torch.testing.assert_close(chain(stages, x), model(x), rtol=0, atol=0)
    object.__setattr__(model.settings, "scale", 3.0)
    with raises("FrozenSettings (settings).scale: 2.0 at the capture, 3.0 now"):
        stages[0](x)


def test_a_model_with_its_own_forward_needs_example_inputs():
    with raises("split: ResidualCNN defines its own forward (or carries annotations below its children), which split "
                "captures to cut exactly; pass example_inputs="):
        pipecomm.split(ResidualCNN(), 2, 0)
    with raises("split: balance='uniform' splits an nn.Sequential chain; ResidualCNN defines its own forward"):
        pipecomm.split(ResidualCNN(), 2, 0, balance="uniform", example_inputs=(torch.randn(2, 3, 8, 8),))
    with raises("split: ResidualCNN defines its own forward, so split cuts it by pipeline_stage annotations on its "
                "submodules, and none carries one"):
        pipecomm.split(ResidualCNN(), 2, 0, example_inputs=(torch.randn(2, 3, 8, 8),))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1

    def forward(self, x):
        h = self.first(x)
        if h.sum() > 0:  # a branch on tensor contents
            h = -h
        return self.second(h)


def test_data_dependent_control_flow_is_refused_naming_the_construct():
    with pytest.raises(ValueError) as error:
        pipecomm.split(DataDependent(), 2, 0, example_inputs=(torch.randn(2, 4),))
    message = str(error.value)
    assert "control flow or a Python value that depends on tensor contents" in message, message
    assert "test_capture.py" in message and "annotate at a coarser level" in message, message


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda m: (setattr(m.conv1, "pipeline_stage", 1), setattr(m.conv2, "pipeline_stage", 0)),
         "split: 'conv2' (pipeline_stage 0) uses a value that the operation relu_default_1 (File "),
        (lambda m: setattr(m.head, "pipeline_stage", 2), "split: 'head' has pipeline_stage=2; it must be an int in [0, 2)"),
        (lambda m: [setattr(x, "pipeline_stage", 0) for x in (m.conv2, m.head)],
         "split: stage 1 gets nothing to compute; annotate modules onto every stage in [0, 2)"),
    ],
    ids=["decreasing", "out-of-range", "empty-stage"],
)
def test_annotation_errors_name_the_module(break_it, message):
    model = ResidualCNN()
    model.stem.pipeline_stage = model.conv1.pipeline_stage = 0
    model.conv2.pipeline_stage = model.head.pipeline_stage = 1
    break_it(model)
    with raises(message):
        pipecomm.split(model, 2, 0, example_inputs=(torch.randn(2, 3, 8, 8),))


def test_inputs_the_capture_does_not_hold_for_are_refused():
    model = gpt2(2)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(tokens(2, 8),))
    with raises("split: the model was captured with arguments ['input_ids'] but is called with"):
        stages[0](tokens(2, 8), attention_mask=torch.ones(2, 8, dtype=torch.long))
    stages = pipecomm.split(LongSkip(), 4, [0], example_inputs=(torch.randn(2, 8),))
    with raises("split: these inputs do not fit the captured forward: Expected input at *args[0].shape[1] to be "
                "equal to 8, but got 9. The capture holds for that size only"):
        stages[0](torch.randn(2, 9))  # the Linear layers fixed the feature dimension at 8


class TakesStructures(nn.Module):
    """A forward whose arguments are a dict and a list of tensors, and a mask that may be left out."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.pipeline_stage, self.second.pipeline_stage = 0, 1

    def forward(self, batch, extras, mask=None):
        h = self.first(batch["x"]) * batch["w"] + extras[0]
        if mask is not None:
            h = h.masked_fill(mask, 0.0) if mask.dtype == torch.bool else h * mask
        return self.second(h)


def structured_example(batch: int, mask=None) -> tuple:
    return ({"x": torch.randn(batch, 4), "w": torch.randn(batch, 4)}, [torch.randn(batch, 4)]), \
        ({} if mask is None else {"mask": mask})


def test_arguments_that_are_structures_of_tensors_are_split():
    # Stage 0's code took its arguments by the names of their leaves: forward() missing 'batch_w', for any nested one.
    model = TakesStructures()
    args, kwargs = structured_example(2)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=args, example_kwargs=kwargs)
    args, kwargs = structured_example(3)
    torch.testing.assert_close(chain(stages, *args, **kwargs), model(*args, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize(("captured", "called", "message"), [
    (None, torch.ones(3, 4), "the input mask is a torch.float32 tensor, where the example split captured was None"),
    (torch.ones(2, 4), torch.zeros(3, 4, dtype=torch.bool),
     "the input mask is a torch.bool tensor, where the example split captured was a torch.float32 tensor"),
], ids=["none-then-tensor", "dtype"])
def test_an_input_captured_as_none_or_of_another_dtype_is_refused(captured, called, message):
    # A mask given where the example had None was dropped (the captured code never reads it), and a model branching
    # on a mask's dtype kept the example's branch: both silently.
    model = TakesStructures()
    args, kwargs = structured_example(2, captured)
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=args,
                            example_kwargs={"mask": None} if captured is None else kwargs)
    args, _ = structured_example(3)
    with raises(message):
        stages[0](*args, mask=called)


class Patches(nn.Module):
    """Patch embeddings with a class token, sliced position embeddings by the sequence's size (CLIP's, Blip-2's)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 17, 8))

    def forward(self, x):
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.conv(x).flatten(2).transpose(1, 2)], 1)
        return h + self.pos[:, : h.size(1)]


class ReadsAnInnerSize(nn.Module):
    """Its own forward builds a mask of the embeddings' size, which torch.export computed inside the vision module."""

    def __init__(self):
        super().__init__()
        self.vision, self.head = Patches(), nn.Linear(8, 4)
        self.vision.pipeline_stage, self.head.pipeline_stage = 0, 1

    def forward(self, x):
        embeddings = self.vision(x)
        mask = torch.ones(embeddings.size()[:-1])
        return self.head(embeddings * mask[..., None]).mean(1)


def test_a_size_computed_inside_a_module_and_read_outside_is_read_again_from_its_output():
    # It was refused as a value escaping the module ("add_1, computed inside 'vision'"): Blip-2 could not be split.
    torch.manual_seed(0)
    model = ReadsAnInnerSize()
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.randn(2, 3, 8, 8),))
    for size in (8, 12, 16):
        x = torch.randn(3, 3, size, size)
        torch.testing.assert_close(chain(stages, x), model(x), rtol=0, atol=0)


class Scales(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, kind):
        return self.linear(x) * (2.0 if kind == "double" else 1.0)


class PassesAString(nn.Module):
    """Calls an annotated module with a str, which torch.export cannot keep at the module's call."""

    def __init__(self):
        super().__init__()
        self.scales, self.second = Scales(), nn.Linear(4, 4)
        self.scales.pipeline_stage, self.second.pipeline_stage = 0, 1

    def forward(self, x):
        return self.second(self.scales(x, "double"))


def test_a_module_called_with_a_value_the_capture_cannot_keep_is_named():
    # The message said "a module that runs whole on a stage" without saying which (ModernBERT, Swin).
    with raises("a module that runs whole on a stage is called with, or returns, a value torch.export cannot keep at "
                "a module's call (a str, a size read from a tensor's shape, an object of its own) ('scales' is called "
                "with the str 'double')"):
        pipecomm.split(PassesAString(), 2, [0, 1], example_inputs=(torch.randn(2, 4),))


class SharedEmbedding(nn.Module):
    """An embedding registered as ``shared`` and used only through a tied one, as BART's and T5's."""

    def __init__(self):
        super().__init__()
        self.shared, self.embed, self.head = nn.Embedding(10, 4), nn.Embedding(10, 4), nn.Linear(4, 4)
        self.embed.weight = self.shared.weight
        self.embed.pipeline_stage, self.head.pipeline_stage = 0, 1

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_a_parameter_under_a_name_no_stage_holds_is_saved_under_it_too():
    # The merged checkpoint lacked shared.weight, so a strict load into the unsplit model failed.
    model = SharedEmbedding()
    stages = pipecomm.split(model, 2, [0, 1], example_inputs=(torch.zeros(2, 3, dtype=torch.long),))
    merged = pipecomm.merge_checkpoints([stage.state_dict() for stage in stages])
    fresh = SharedEmbedding()
    fresh.load_state_dict(merged, strict=True)
    torch.testing.assert_close(fresh.shared.weight, model.shared.weight, rtol=0, atol=0)
    for stage in stages:
        stage.load_state_dict(stage.state_dict(), strict=True)
