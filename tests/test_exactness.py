"""Pipeline training equals one process exactly: frozen parameters, outputs autograd saved, gradient-free and structured boundary values, kwargs, inference of any batch size."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from equivalence import BATCH, SCHEDULES, SEQ, STEPS, TOLERANCE, float_batch, mse, one_process, train_like_one_process
from models import HIDDEN, Block
from ranks import held_stages, needs_cuda, run_ranks

import pipecomm
from pipecomm.runtime import executor, stage_runner

# -- frozen parameters -------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen base layer plus a trainable low-rank update, as LoRA trains it."""

    def __init__(self, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.down = nn.Linear(HIDDEN, rank, bias=False)
        self.up = nn.Linear(rank, HIDDEN, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class LoRABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN).requires_grad_(False)
        self.mlp = LoRALinear()

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


def lora_stages(num_stages: int) -> list[nn.Module]:
    return [nn.Sequential(LoRABlock(), LoRABlock()) for _ in range(num_stages)]


def test_lora_adapters_on_a_frozen_backbone(tmp_path):
    run_ranks(2, train_like_one_process, tmp_path, lora_stages, float_batch, mse)


def frozen_stages(num_stages: int) -> list[nn.Module]:
    """Every other stage frozen: the first (its outputs then require no grad at all) and, of four, a middle one."""
    stages = [nn.Sequential(Block(), Block()) for _ in range(num_stages)]
    for stage in stages[::2]:
        stage.requires_grad_(False)
    return stages


def freeze_all_at_the_last_step(step: int, stages: list[nn.Module]) -> None:
    if step == STEPS:
        for stage in stages:
            stage.requires_grad_(False)


def tied(rank: int) -> nn.Module:
    """Stage ``rank`` of a model whose two stages share a weight, named as pipecomm.split names one."""
    stage = Block()
    stage.shared_parameters = {"proj.weight": (0, 1)}
    return stage


def frozen_around_the_pipeline(rank: int, world_size: int) -> str:
    """Frozen stages in every schedule, then a step of an all-frozen model; frozen parameters that data-parallel
    replicas and stages sharing a weight would otherwise reduce."""
    train_like_one_process(rank, world_size, frozen_stages, float_batch, mse, before_step=freeze_all_at_the_last_step,
                           steps=STEPS + 1)

    # Data parallel (two replicas of one stage), with a frozen layer.
    context = pipecomm.init(pipeline_size=1, data_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, loss_fn=mse, micro_batches=2, group=context.pipeline_group,
                             data_group=context.data_group, timeout=30)
    optimizer, ref_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(reference.parameters())
    for step in range(STEPS):
        (x,), _, target = float_batch(step)
        half = slice(BATCH // 2 * context.dp_rank, BATCH // 2 * (context.dp_rank + 1))
        pipe.step(x[half], target=target[half])
        mse(reference(x), target).backward()
        assert all(p.grad is None for p in model[0].parameters()), "a data-parallel reduction invented a gradient"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    for param, ref_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref_param, **TOLERANCE)
    pipe.close()

    # A frozen weight shared by both stages (a tied embedding and head that are not trained).
    torch.manual_seed(0)
    stages = [tied(0), tied(1)]
    stages[1].proj.weight = stages[0].proj.weight
    for stage in stages:
        stage.proj.weight.requires_grad_(False)
    reference = copy.deepcopy(stages)
    stage = copy.deepcopy(stages[rank])
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=2, loss_fn=mse, micro_batches=2, timeout=30)
    optimizer, ref_optimizer = torch.optim.AdamW(stage.parameters()), torch.optim.AdamW(
        [p for module in reference for p in module.parameters()])
    for step in range(STEPS):
        args, kwargs, target = float_batch(step)
        torch.testing.assert_close(pipe.step(*args, target=target), one_process(reference, args, kwargs, target, mse),
                                   **TOLERANCE)
        assert stage.proj.weight.grad is None, "the shared-parameter reduction invented a gradient"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    for param, ref_param in zip(stage.parameters(), reference[rank].parameters()):
        torch.testing.assert_close(param, ref_param, **TOLERANCE)
    pipe.close()
    return "ok"


def test_frozen_stages_an_all_frozen_model_and_frozen_parameters_in_reductions(tmp_path):
    run_ranks(2, frozen_around_the_pipeline, tmp_path, timeout=120)


class TwoTiedPairs(nn.Module):
    """Two embeddings of one shape, each tied to a head; the heads called in the other order, so the last stage lists
    its shared weights the other way round from the first."""

    def __init__(self, num_stages: int):
        super().__init__()
        self.embed_a, self.embed_b = nn.Embedding(16, HIDDEN), nn.Embedding(16, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(num_stages))
        self.head_b, self.head_a = nn.Linear(HIDDEN, 16, bias=False), nn.Linear(HIDDEN, 16, bias=False)
        self.head_a.weight, self.head_b.weight = self.embed_a.weight, self.embed_b.weight
        self.embed_a.pipeline_stage = self.embed_b.pipeline_stage = 0
        for index, block in enumerate(self.blocks):
            block.pipeline_stage = index
        self.head_a.pipeline_stage = self.head_b.pipeline_stage = num_stages - 1

    def forward(self, tokens):
        h = self.embed_a(tokens) + torch.tanh(self.embed_b(tokens))
        for block in self.blocks:
            h = block(h)
        return 2 * self.head_b(torch.tanh(h)) + self.head_a(h)


def two_tied_pairs(num_stages: int) -> list[nn.Module]:
    return pipecomm.split(TwoTiedPairs(num_stages), num_stages, list(range(num_stages)),
                          example_inputs=(torch.zeros(2, SEQ, dtype=torch.long),))


def token_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return (torch.randint(0, 16, (BATCH, SEQ), generator=generator),), {}, torch.randint(0, 16, (BATCH, SEQ),
                                                                                        generator=generator)


def logits_loss(output, target):
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def test_shared_parameters_listed_in_another_order_on_each_holder_pair_by_name(tmp_path):
    # The holders reduced their shared weights in their own orders: the first stage summed embed_a's gradient with
    # the last stage's head_b's (the other pair, of the same shape), and broadcast the values crosswise, silently.
    run_ranks(2, train_like_one_process, tmp_path, two_tied_pairs, token_batch, logits_loss,
              (("1f1b", 1), ("zb-v", 2)), timeout=120)


class HandMadeTied(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.add_module(name, nn.Linear(HIDDEN, HIDDEN))
        self.shared_parameters = {f"{name}.weight": (0, 1)}


def hand_made_stages_naming_a_shared_weight_apart(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match=r"rank 0 shares a parameter with ranks \(0, 1\) under the key 'first.weight' "
                                         r"\(8, 8\) torch.float32, and rank 1 holds no such parameter"):
        pipecomm.Pipeline(HandMadeTied("first" if rank == 0 else "last"), stage=rank, num_stages=2, loss_fn=mse,
                          micro_batches=2, timeout=30)
    return "ok"


def test_hand_made_stages_that_name_a_shared_weight_apart_are_refused_on_every_rank(tmp_path):
    assert run_ranks(2, hand_made_stages_naming_a_shared_weight_apart, tmp_path) == ["ok", "ok"]


def a_shared_weight_frozen_on_one_holder(rank: int, world_size: int) -> str:
    stage = HandMadeTied("shared")
    stage.shared.weight.requires_grad_(rank == 0)
    with pytest.raises(ValueError, match=r"the parameter shared among ranks \(0, 1\) under the key 'shared.weight' is "
                                         r"frozen \(requires_grad=False\) on ranks \[1\] only"):
        pipecomm.Pipeline(stage, stage=rank, num_stages=2, loss_fn=mse, micro_batches=2, timeout=30)
    return "ok"


def test_a_shared_weight_frozen_on_one_holder_only_is_refused_at_construction(tmp_path):
    # The trainable holder waited out the timeout (300 s by default) in the gradient's all-reduce at the first step.
    assert run_ranks(2, a_shared_weight_frozen_on_one_holder, tmp_path) == ["ok", "ok"]


class PartlyFrozen(nn.Module):
    """Frozen weights beside trainable biases, a frozen free parameter, and a trainable gate."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.block.norm.weight.requires_grad_(False)
        self.block.proj.weight.requires_grad_(False)
        self.offset = nn.Parameter(torch.randn(HIDDEN), requires_grad=False)
        self.gate = nn.Parameter(torch.randn(HIDDEN))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.out(self.block(x + self.offset)) * self.gate


def partly_frozen_stages(num_stages: int) -> list[nn.Module]:
    return [PartlyFrozen() for _ in range(num_stages)]


def unfreeze_then_freeze_again(step: int, stages: list[nn.Module]) -> None:
    """Between steps, as fine-tuning recipes do: a frozen weight thaws for step 1; at step 2 it freezes again, and
    so do its bias and a weight trainable so far."""
    for stage in stages:
        stage.block.proj.weight.requires_grad_(step == 1)
        stage.block.proj.bias.requires_grad_(step < 2)
        stage.out.weight.requires_grad_(step < 2)


def test_partly_frozen_modules_frozen_and_unfrozen_between_steps(tmp_path):
    run_ranks(2, train_like_one_process, tmp_path, partly_frozen_stages, float_batch, mse, SCHEDULES,
              unfreeze_then_freeze_again)


def test_main_grad_buffers_skip_frozen_parameters_and_come_with_unfreezing():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    model[0].proj.requires_grad_(False)
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, loss_fn=mse, micro_batches=2, main_grad=True)
    (x,), _, target = float_batch(0)
    x, target = x.to(torch.bfloat16), target.to(torch.bfloat16)
    pipe.step(x, target=target)
    for name, param in model.named_parameters():
        assert param.grad is None, name
        assert hasattr(param, "main_grad") == param.requires_grad, name
        if param.requires_grad:
            assert param.main_grad.dtype == torch.float32 and param.main_grad.abs().sum() > 0, name
    model[0].proj.requires_grad_(True)
    pipe.step(x, target=target)
    assert model[0].proj.weight.grad is None and model[0].proj.weight.main_grad.dtype == torch.float32
    assert model[0].proj.weight.main_grad.abs().sum() > 0
    pipe.close()


# -- outputs autograd saved ---------------------------------------------------------------------


class SavesItsOutput(nn.Module):
    """Returns ``(f(h), h)`` where computing f saved h for backward: a multiply by a parameter (for the
    parameter's gradient) or an nn.Linear (for its weight's)."""

    def __init__(self, linear: bool):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.scale = nn.Parameter(torch.randn(HIDDEN))
        self.out = nn.Linear(HIDDEN, HIDDEN) if linear else None

    def forward(self, x, skip=None):
        h = torch.tanh(self.proj(x if skip is None else x + skip))
        return (self.out(h) if self.out is not None else h * self.scale), h


class Sum(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, skip):
        return self.proj(x) * skip


def saved_output_stages(linear: bool):
    def build(num_stages: int) -> list[nn.Module]:
        return [SavesItsOutput(linear) for _ in range(num_stages - 1)] + [Sum()]
    return build


def scale_times_hidden(num_stages: int) -> list[nn.Module]:
    return saved_output_stages(linear=False)(num_stages)


def linear_of_hidden(num_stages: int) -> list[nn.Module]:
    return saved_output_stages(linear=True)(num_stages)


def saved_outputs(rank: int, world_size: int) -> str:
    train_like_one_process(rank, world_size, scale_times_hidden, float_batch, mse)
    train_like_one_process(rank, world_size, linear_of_hidden, float_batch, mse)
    # Compiled stages save through AOT autograd's own function: one more user of what it saves.
    return train_like_one_process(rank, world_size, scale_times_hidden, float_batch, mse, (("1f1b", 1),),
                                  prepare=functools.partial(torch.compile, backend="aot_eager"))


def test_an_output_autograd_saved_keeps_its_data_after_the_send(tmp_path):
    run_ranks(2, saved_outputs, tmp_path, timeout=120)


def sent(outputs: list[torch.Tensor], freeable: list[torch.Tensor]) -> list[bool]:
    """Which of ``outputs`` lost their data when the executor freed ``freeable`` after their send."""
    # Sizes, not addresses: the placeholder's one element may be allocated where the freed data was.
    sizes = [tensor.untyped_storage().nbytes() for tensor in outputs]
    stage_runner.free_data(freeable)
    return [tensor.untyped_storage().nbytes() != size for tensor, size in zip(outputs, sizes)]


def test_only_outputs_nothing_else_holds_are_freed():
    x = torch.randn(4, HIDDEN, requires_grad=True)
    scale = torch.randn(HIDDEN, requires_grad=True)
    h = torch.tanh(x)  # tanh saves its own output
    product = h * scale  # saves h (and scale)
    summed = product + 1  # saved by nothing
    recomputed = product - 1
    sine = checkpoint(torch.sin, recomputed, use_reentrant=False)  # keeps its input for the recomputation
    alone = summed * 2  # saved by nothing, no view of it
    view = summed[:2]  # holds summed's memory: freeing summed would give back nothing
    outputs = [alone, h, recomputed, view, x, summed, alone]  # a view, a leaf, one output twice
    freeable = stage_runner.held_only_by_themselves(outputs)
    assert sent(outputs, freeable) == [True, False, False, False, False, False, True]
    torch.testing.assert_close(view, (product + 1)[:2])
    sine.sum().backward()  # reads the kept input
    tanh = torch.tanh(x.detach())
    torch.testing.assert_close(x.grad, torch.cos(tanh * scale.detach() - 1) * scale.detach() * (1 - tanh ** 2))


def test_nothing_is_freed_under_the_callers_saved_tensor_hooks():
    """An identity pack hook keeps the output object itself, which no use count shows."""
    x = torch.randn(4, HIDDEN, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
        output = x * 2
        output.sin()  # saves its input, the output, as the hook returned it
        assert stage_runner.held_only_by_themselves([output]) == []
    assert stage_runner.held_only_by_themselves([x * 2]) != []


def test_an_output_a_compiled_region_saved_is_kept():
    x = torch.randn(4, HIDDEN, requires_grad=True)
    region = torch.compile(lambda t: torch.tanh(t) * 2, backend="aot_eager")
    output = region(x)
    others = torch.compile(lambda t: torch.tanh(t), backend="aot_eager")(x)  # saves its output for tanh's backward
    assert sent([output, others], stage_runner.held_only_by_themselves([output, others])) == [True, False]


# -- what crosses a boundary --------------------------------------------------------------------

RECEIVED_REQUIRES_GRAD: list[list[bool]] = []  # per call of a later WithSideInputs stage, in this process


class WithSideInputs(nn.Module):
    """Carries a bool mask, int position ids, rotary-like cos values and a float constant, none of which needs a
    gradient, beside the hidden state."""

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.block = Block()
        self.first, self.last = first, last

    def forward(self, x, mask, positions, cos=None, scale=None):
        if self.first:
            cos, scale = torch.cos(positions.float()), 0.5
        else:
            RECEIVED_REQUIRES_GRAD.append([t.requires_grad for t in (x, mask, positions, cos)])
        h = self.block(x) * mask.unsqueeze(-1) + scale * cos.unsqueeze(-1)
        return h if self.last else (h, mask, positions, cos, scale)


def side_input_stages(num_stages: int) -> list[nn.Module]:
    return [WithSideInputs(index == 0, index == num_stages - 1) for index in range(num_stages)]


def side_input_batch(step: int):
    (x,), _, target = float_batch(step)
    mask = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(step)) > 0.3
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return (x, mask, positions), {}, target


def gradient_free_values(rank: int, world_size: int) -> tuple[list, list]:
    """Trains with every schedule; returns, per gradient message this rank sent, which entries held a gradient."""
    sent: list[list[bool]] = []
    send_backward = executor.StageExecutor._send_backward

    def recording(self, stage, micro_batch):
        sent.append([grad is not None for grad in self.stages[stage].record(micro_batch).input_grads])
        send_backward(self, stage, micro_batch)

    executor.StageExecutor._send_backward = recording
    train_like_one_process(rank, world_size, side_input_stages, side_input_batch, mse)
    return sent, RECEIVED_REQUIRES_GRAD


def test_tensors_that_need_no_gradient_cross_without_one(tmp_path):
    (sent_by_0, received_by_0), (sent_by_1, received_by_1) = run_ranks(2, gradient_free_values, tmp_path, timeout=120)
    # (hidden, mask, positions, cos): only the hidden state requires grad where it arrives and gets a gradient back.
    assert sent_by_1 and received_by_1
    assert all(flags == [True, False, False, False] for flags in sent_by_0 + sent_by_1), (sent_by_0, sent_by_1)
    assert all(flags == [True, False, False, False] for flags in received_by_0 + received_by_1)


@dataclasses.dataclass
class Hidden:
    """A dataclass no one registered as a pytree node."""

    states: torch.Tensor
    rows: int
    note: str = "hidden"


def wrapped(kind: str, h: torch.Tensor):
    """``h`` inside the structure stage outputs of this kind take, with non-tensor leaves the next stage uses."""
    from transformers.modeling_outputs import BaseModelOutput

    if kind == "dict":
        return {"flat": h.flatten(0, 1), "rows": h.shape[0], "scale": 0.5, "dtype": h.dtype, "nothing": None,
                "shape": h.shape}
    if kind == "dataclass":
        return Hidden(states=h, rows=h.shape[0])
    if kind == "logits":
        return {"logits": h, "states": (h * 2, None), "width": HIDDEN}
    return BaseModelOutput(last_hidden_state=h, hidden_states=(h * 2, h))


def unwrapped(structure) -> torch.Tensor:
    if type(structure) is dict and "logits" in structure:
        return structure["logits"] - structure["states"][0] / structure["width"]
    if type(structure) is dict:  # a ModelOutput is a dict too
        assert structure["dtype"] is torch.float32 and structure["nothing"] is None
        assert structure["shape"] == torch.Size([structure["rows"], SEQ, HIDDEN])
        return structure["flat"].reshape(structure["rows"], -1, HIDDEN) / structure["scale"]
    if isinstance(structure, Hidden):
        assert structure.note == "hidden"
        return structure.states.reshape(structure.rows, SEQ, HIDDEN)
    return structure.last_hidden_state + structure.hidden_states[0]


KINDS = ("dict", "dataclass", "model_output", "dict")


class Structured(nn.Module):
    """Takes the previous stage's structure (the first: a dict input and keyword arguments), returns its own kind."""

    def __init__(self, kind: str, first: bool):
        super().__init__()
        self.block = Block()
        self.kind, self.first = kind, first

    def forward(self, inputs, attention_mask=None, shift=None):
        if self.first:
            h = inputs["x"] * attention_mask.unsqueeze(-1) + shift["bias"].unsqueeze(1) * shift["factor"]
        else:
            h = unwrapped(inputs)
        return wrapped(self.kind, self.block(h))


def structured_stages(num_stages: int, kinds: tuple[str, ...] = KINDS) -> list[nn.Module]:
    return [Structured(kinds[index % len(kinds)], index == 0) for index in range(num_stages)]


def structured_batch(step: int):
    """A dict positional input, tensor and pytree keyword inputs, a dict target."""
    (x,), _, target = float_batch(step)
    generator = torch.Generator().manual_seed(100 + step)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()
    kwargs = {"attention_mask": mask, "shift": {"bias": torch.randn(BATCH, HIDDEN, generator=generator), "factor": 3}}
    return ({"x": x},), kwargs, {"y": target, "weight": torch.rand(BATCH, generator=generator)}


def structured_loss(output, target: dict) -> torch.Tensor:
    """Receives the structure the model produced, and the target's."""
    error = (unwrapped(output) - target["y"]).pow(2).mean(dim=(1, 2))
    return (error * target["weight"]).mean()


def test_dicts_dataclasses_and_model_outputs_cross_and_kwargs_split_into_micro_batches(tmp_path):
    run_ranks(2, train_like_one_process, tmp_path, structured_stages, structured_batch, structured_loss, timeout=120)


class Skips(nn.Module):
    """The first stage sends (hidden, skip, side); later ones pass the skip through unchanged, some after using it
    too, and drop ``side`` (so its gradient is None); the last adds the skip back."""

    def __init__(self, index: int, num_stages: int):
        super().__init__()
        self.block = Block()
        self.side = nn.Linear(HIDDEN, HIDDEN)
        self.index, self.num_stages = index, num_stages

    def forward(self, x, skip=None, side=None):
        if self.index == 0:
            return self.block(x), x * 2, self.side(x)
        h = self.block(x)
        if self.index == self.num_stages - 1:
            return h + skip
        if self.index % 2:
            h = h + 0.5 * skip  # used and passed on: its gradient is the sum of both
        return h, skip, self.side(h) if self.index == 1 else side


def skip_stages(num_stages: int) -> list[nn.Module]:
    return [Skips(index, num_stages) for index in range(num_stages)]


def test_a_skip_crosses_several_stages_and_an_unused_input_gets_no_gradient(tmp_path):
    run_ranks(4, train_like_one_process, tmp_path, skip_stages, float_batch, mse, timeout=120)


# -- torch's checkpoints -------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A Linear, then a block under torch.utils.checkpoint (Hugging Face's gradient checkpointing calls it so)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.pre, self.block, self.reentrant = nn.Linear(HIDDEN, HIDDEN), Block(), reentrant

    def forward(self, x):
        return torch.tanh(checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant))


def checkpointed_stages(reentrant: bool, num_stages: int) -> list[nn.Module]:
    return [Checkpointed(reentrant) for _ in range(num_stages)]


def test_checkpointed_blocks_train_exactly(tmp_path):
    """use_reentrant=False under every schedule; use_reentrant=True, whose backward accumulates into .grad itself,
    under the schedules whose backward lets autograd accumulate (the others refuse it: below)."""
    run_ranks(2, train_like_one_process, tmp_path, functools.partial(checkpointed_stages, False), float_batch, mse,
              timeout=120)
    whole = tuple(entry for entry in SCHEDULES if not entry[0].startswith("zb"))
    run_ranks(2, train_like_one_process, tmp_path, functools.partial(checkpointed_stages, True), float_batch, mse,
              whole, timeout=120)


@pytest.mark.parametrize(("schedule", "options", "asks"), [
    ("zb-h1", {}, "the zero-bubble schedule's split backward"),
    ("1f1b", {"main_grad": True}, "main_grad=True's accumulation"),
])
def test_a_reentrant_checkpoint_where_gradients_are_asked_for_by_name_is_refused_saying_what_to_do(schedule, options,
                                                                                                   asks):
    pipe = pipecomm.Pipeline(Checkpointed(reentrant=True), stage=0, num_stages=1, loss_fn=mse, micro_batches=2,
                             schedule=schedule, **options)
    (x,), _, target = float_batch(0)
    with pytest.raises(RuntimeError, match=f"use_reentrant=True.*{asks}.*use_reentrant=False") as raised:
        pipe.step(x, target=target)
    where = "I pass (input gradients)" if schedule == "zb-h1" else "backward"
    assert raised.value.__notes__ == [f"pipecomm: in the {where} of stage 0, micro-batch 0, on pipeline rank 0"]


# -- the caller's tensors that require grad ----------------------------------------------------------


class TemperedLoss(nn.Module):
    """A loss that holds parameters of its own (a head and a learned temperature), trained with the pipeline."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, HIDDEN)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, output, target):
        return mse(self.head(output) / self.temperature, target)


class UnregisteredScale(nn.Module):
    """A scale trained as a plain tensor attribute, no parameter of the module (kept so, or in a Python list)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.full((HIDDEN,), 1.5, requires_grad=True)

    def forward(self, x):
        return x * self.scale


def data_gradients(rank: int, world_size: int, options: dict) -> list[str]:
    """A step of every schedule whose inputs and targets require grad, with a loss_fn that holds parameters and
    stages that train a tensor of no module's parameters: their gradients, the parameters' and the loss equal one
    process's, where loss.backward() sends gradients into the caller's graph and into every leaf too."""
    checked = []
    for schedule, chunks in SCHEDULES:
        num_stages = world_size * chunks
        torch.manual_seed(0)
        stages = [nn.Sequential(Block(), nn.Tanh(), UnregisteredScale()) for _ in range(num_stages)]
        loss_fn = TemperedLoss()
        reference, ref_loss_fn = copy.deepcopy(stages), copy.deepcopy(loss_fn)
        mine = held_stages(schedule, world_size, 4, chunks, rank)
        pipe = pipecomm.Pipeline([stages[s] for s in mine], stage=mine, num_stages=num_stages, loss_fn=loss_fn,
                                 micro_batches=4, schedule=schedule, timeout=30, **options)
        (x,), kwargs, target = float_batch(0)
        ref_x, ref_target = x.clone().requires_grad_(), target.clone().requires_grad_()
        loss = pipe.step(x.requires_grad_(), target=target.requires_grad_())
        pipe.close()
        torch.testing.assert_close(loss, one_process(reference, (ref_x,), kwargs, ref_target, ref_loss_fn),
                                   **TOLERANCE)
        last = num_stages - 1 in mine
        for name, data, ref, held in (("input", x, ref_x, 0 in mine), ("target", target, ref_target, last),
                                      *((f"loss_fn's {name}", param, ref, last) for (name, param), ref in
                                        zip(loss_fn.named_parameters(), ref_loss_fn.parameters())),
                                      *((f"stage {s}'s scale", stages[s][2].scale, reference[s][2].scale, s in mine)
                                        for s in range(num_stages))):
            if held:
                torch.testing.assert_close(data.grad, ref.grad, **TOLERANCE, msg=f"{schedule}: the {name}'s gradient")
            else:  # another rank's stage reads it
                assert data.grad is None, f"{schedule}: the {name} of a rank without its stage got a gradient"
        if not options:
            for s in mine:
                for (name, param), ref in zip(stages[s].named_parameters(), reference[s].parameters()):
                    torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE, msg=f"{schedule}, {s}: {name}")
        checked.append(schedule)
    return checked


class RoutedHeads(nn.Module):
    """A loss with two heads of one shape, each micro-batch using the one its data picks: replicas meet them in other
    orders, or one of them only."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))  # the third is never used

    def forward(self, output, target):
        return mse(self.heads[int(target.sum() > 0)](output), target)


def replicas_with_a_loss_holding_parameters(rank: int, world_size: int, schedule: str, loss_kind: str) -> str:
    """Two data-parallel replicas of one stage, each on half the batch, with a loss_fn that holds parameters: their
    gradients average over the replicas, as the stage's, exactly as one process's over the whole batch; a tensor
    no module names (held by a closure) is refused."""
    context = pipecomm.init(pipeline_size=1, data_size=2)
    torch.manual_seed(0)
    model, loss_fn = nn.Sequential(Block()), {"tempered": TemperedLoss, "routed": RoutedHeads}[loss_kind]()
    reference, ref_loss_fn = copy.deepcopy(model), copy.deepcopy(loss_fn)
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, loss_fn=loss_fn, micro_batches=2, schedule=schedule,
                             group=context.pipeline_group, data_group=context.data_group, timeout=30)
    (x,), _, target = float_batch(context.dp_rank if loss_kind == "routed" else 0)  # routed: each its own data
    xs, ys = [None] * 2, [None] * 2
    torch.distributed.all_gather_object(xs, x[:BATCH // 2])
    torch.distributed.all_gather_object(ys, target[:BATCH // 2])
    pipe.step(x[:BATCH // 2], target=target[:BATCH // 2])
    for part_x, part_y in zip(torch.cat(xs).chunk(4), torch.cat(ys).chunk(4)):
        (ref_loss_fn(reference(part_x), part_y) / 4).backward()
    for (name, mine), ref in zip([*model.named_parameters(), *loss_fn.named_parameters()],
                                 [*reference.parameters(), *ref_loss_fn.parameters()]):
        if ref.grad is None:
            assert mine.grad is None, name
        else:
            torch.testing.assert_close(mine.grad, ref.grad, **TOLERANCE, msg=name)
    pipe.close()
    temperature = nn.Parameter(torch.tensor(2.0))
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, micro_batches=2, schedule=schedule,
                             loss_fn=lambda output, target: mse(output / temperature, target),
                             group=context.pipeline_group, data_group=context.data_group, timeout=30)
    with pytest.raises(ValueError, match=r"under data parallelism, the step trained 1 tensor\(s\) of shapes \[\(\)\] "
                                         "beside the stages' parameters that no module names"):
        pipe.step(x[:BATCH // 2], target=target[:BATCH // 2])
    return "ok"


@pytest.mark.parametrize("loss_kind", ["tempered", "routed"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_data_parallel_replicas_average_the_gradients_of_a_loss_fns_parameters(tmp_path, schedule, loss_kind):
    # Each replica kept its own half-batch gradient for loss_fn's parameters, which then drifted apart, silently; and
    # averaged in each replica's order of meeting them, heads of one shape were summed crosswise.
    assert run_ranks(2, replicas_with_a_loss_holding_parameters, tmp_path, schedule, loss_kind) == ["ok", "ok"]


@pytest.mark.parametrize("options", [{}, {"main_grad": True}], ids=["grad", "main_grad"])
def test_inputs_targets_and_a_loss_fns_parameters_get_one_process_gradients(tmp_path, options):
    """Every schedule, whether autograd accumulates the parameters' gradients (1f1b into .grad) or the pipeline adds
    them (zero-bubble, main_grad): the first stage's inputs and the last stage's targets get theirs, and so do the
    parameters loss_fn holds (zero-bubble and main_grad dropped theirs, silently)."""
    names = [name for name, _ in SCHEDULES]
    assert run_ranks(2, data_gradients, tmp_path, options, timeout=120) == [names, names]



def inference(rank: int, world_size: int, schedule: str, chunks: int) -> str:
    num_stages = world_size * chunks
    torch.manual_seed(0)
    stages = structured_stages(num_stages, ("model_output", "logits"))
    mine = held_stages(schedule, world_size, 4, chunks, rank)
    pipe = pipecomm.Pipeline([stages[s] for s in mine], stage=mine, num_stages=num_stages, loss_fn=structured_loss,
                             micro_batches=4, schedule=schedule, timeout=30)
    first, last = 0 in mine, num_stages - 1 in mine
    for batch_size in (1, 3, BATCH):
        (inputs,), kwargs, _ = structured_batch(batch_size)
        inputs = {"x": inputs["x"][:batch_size]}
        kwargs = {"attention_mask": kwargs["attention_mask"][:batch_size],
                  "shift": {"bias": kwargs["shift"]["bias"][:batch_size], "factor": 3}}
        with torch.no_grad():
            expected = one_process_forward(stages, inputs, kwargs)
        output = pipe.forward(inputs, **kwargs) if first else pipe.forward()
        if last:
            torch.testing.assert_close(output, expected, **TOLERANCE)
        else:
            assert output is None
        broadcast = pipe.forward(inputs, broadcast_result=True, **kwargs) if first else pipe.forward(broadcast_result=True)
        torch.testing.assert_close(broadcast, expected, **TOLERANCE)
    pipe.close()
    return "ok"


def one_process_forward(stages, inputs, kwargs):
    output = stages[0](inputs, **kwargs)
    for stage in stages[1:]:
        output = stage(output)
    return output


@pytest.mark.parametrize("ranks, schedule, chunks", [(2, "1f1b", 1), (2, "interleaved-1f1b", 2), (2, "zb-v", 2),
                                                     (4, "zb-v", 2)])
def test_inference_of_any_batch_size_returns_the_model_structure_on_every_rank(tmp_path, ranks, schedule, chunks):
    """Through the executor's forward-only schedule on the training schedule's placement: looped, interleaved (a
    rank's stages talk to each other's ranks) and V (the turn hands over on one rank)."""
    run_ranks(ranks, inference, tmp_path, schedule, chunks, timeout=120)


SCENARIOS = {
    "lora": (lora_stages, float_batch, mse),
    "side inputs": (side_input_stages, side_input_batch, mse),
    "structures": (structured_stages, structured_batch, structured_loss),
    "skips": (skip_stages, float_batch, mse),
}


@pytest.mark.parametrize("scenario", ["side inputs", "structures", "skips"])
def test_stages_of_one_process_hand_over_through_the_loopback_alike(scenario):
    RECEIVED_REQUIRES_GRAD.clear()
    train_like_one_process(0, 1, *SCENARIOS[scenario], (("interleaved-1f1b", 4),))
    assert all(flags == [True, False, False, False] for flags in RECEIVED_REQUIRES_GRAD)  # side inputs: see above


@needs_cuda
@pytest.mark.parametrize("kind", ["cuda", "cuda-graphs", "cuda-auto"])
@pytest.mark.parametrize("scenario", ["lora", "side inputs", "structures"])
def test_on_gpus_eager_and_replaying_cuda_graphs(tmp_path, scenario, kind):
    """The same over CUDA IPC, eager, replaying CUDA graphs from the first step, and by default (graphs adopted at the
    third step; zb-h2 and zb-v, rebuilt after the first, at the fourth), with every schedule."""
    steps = 5 if kind == "cuda-auto" else STEPS
    run_ranks(2, train_like_one_process, tmp_path, *SCENARIOS[scenario], SCHEDULES, None, steps, 4, None, kind,
              timeout=300)
