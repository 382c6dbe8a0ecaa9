"""split() cuts a model into stages that reuse its modules and chain to its output; errors; checkpoint round trip."""

from __future__ import annotations

import collections
import copy
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import MaskedBlock
from ranks import run_ranks

from pipecomm.splitting.partition import StageModule, merge_checkpoints, split

HIDDEN = 16
VOCAB = 11
BATCH = 4
SEQ = 6


def raises(message: str):
    return pytest.raises(ValueError, match=re.escape(message))


def mlp() -> nn.Sequential:
    """Eight layers, four of them with parameters."""
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(HIDDEN, HIDDEN), nn.ReLU())])


def run_stages(stages: list[StageModule], *inputs):
    """What the pipeline does between stages: a tuple output becomes the next stage's positional arguments."""
    output = inputs
    for stage in stages:
        output = stage(*(output if isinstance(output, tuple) else (output,)))
    return output


def layers_of(stages: list[StageModule]) -> list[nn.Module]:
    return [stage.get_submodule(name) for stage in stages for name in stage.layer_names]


class Embed(nn.Module):
    """Returns a tuple: the hidden states and a padding mask, which every later block also receives."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, tokens):
        return self.embedding(tokens), tokens != 0


class MaskedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x, mask):
        return self.norm(x) * mask.unsqueeze(-1)


class TinyLM(nn.Module):
    """Ordered children (not a Sequential), blocks in a ModuleList, the head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(MaskedBlock(HIDDEN) for _ in range(4))
        self.norm = MaskedNorm()
        self.act = nn.Tanh()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.embedding.weight

    def forward(self, tokens):
        x, mask = self.embed(tokens)
        for block in self.blocks:
            x, mask = block(x, mask)
        return self.head(self.act(self.norm(x, mask)))


def chain_lm() -> nn.Sequential:
    """TinyLM's layers as a chain split can place without capture (it is never called whole)."""
    model = TinyLM()
    return nn.Sequential(collections.OrderedDict(
        embed=model.embed, blocks=model.blocks, norm=model.norm, act=model.act, head=model.head))


def annotate(model) -> None:
    for module, stage in [(model.embed, 0), (model.blocks[0], 0), (model.blocks[1], 1), (model.blocks[2], 2),
                          (model.blocks[3], 2), (model.norm, 3), (model.head, 3)]:
        module.pipeline_stage = stage


def annotated_chain() -> nn.Sequential:
    model = chain_lm()
    annotate(model)
    return model


def annotated_lm() -> TinyLM:
    """Four stages: embed + blocks.0 | blocks.1 | blocks.2 + blocks.3 | norm + act (unannotated) + head."""
    model = TinyLM()
    for module, stage in [(model.embed, 0), (model.blocks[0], 0), (model.blocks[1], 1), (model.blocks[2], 2),
                          (model.blocks[3], 2), (model.norm, 3), (model.head, 3)]:
        module.pipeline_stage = stage
    return model


def tokens() -> torch.Tensor:
    values = torch.randint(1, VOCAB, (BATCH, SEQ))
    values[:, -2:] = 0
    return values


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("balance", [None, "parameters", "uniform", "list", "profile"])
def test_sequential_stages_chain_to_the_model_output_with_its_own_layers(num_stages, balance):
    model = mlp()
    x = torch.randn(BATCH, HIDDEN)
    sizes = {2: [3, 5], 4: [1, 2, 3, 2]}[num_stages]
    chosen = sizes if balance == "list" else balance
    original = list(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 8 layers divide evenly: no warning
        # One call for all stages: each call of the profile mode measures anew.
        stages = split(model, num_stages, list(range(num_stages)), balance=chosen, sample_inputs=(x,))
    assert torch.equal(run_stages(stages, x), model(x))
    assert len(layers_of(stages)) == len(original)
    assert all(mine is theirs for mine, theirs in zip(layers_of(stages), original, strict=True))
    assert [stage.stage_index for stage in stages] == list(range(num_stages))
    if balance == "list":
        assert [len(stage.layer_names) for stage in stages] == sizes
    elif balance in (None, "parameters", "uniform"):
        # Four Linear+ReLU pairs: both rules keep every ReLU with its Linear.
        assert [len(stage.layer_names) for stage in stages] == [8 // num_stages] * num_stages
    assert all(stage.shared_parameters == {} for stage in stages)


def test_parameters_balance_minimises_the_largest_stage_while_uniform_counts_layers():
    big, small = (lambda: nn.Linear(32, 32)), (lambda: nn.Linear(4, 4))  # 1056 and 20 parameters
    model = nn.Sequential(big(), small(), small(), small())
    assert [split(model, 2, index).layer_names for index in range(2)] == [("0",), ("1", "2", "3")]
    assert [split(model, 2, index, balance="uniform").layer_names for index in range(2)] == [("0", "1"), ("2", "3")]


def test_uniform_gives_the_later_stages_the_extra_layers_and_warns():
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(7)])
    with pytest.warns(UserWarning, match=re.escape("split: 7 layers do not divide evenly into 3 stages")):
        stages = split(model, 3, [0, 1, 2], balance="uniform")
    assert [len(stage.layer_names) for stage in stages] == [2, 2, 3]


def test_profile_balances_time_and_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(HIDDEN, 512), nn.BatchNorm1d(512), nn.Dropout(0.5), nn.Linear(512, HIDDEN))
    x = torch.randn(BATCH, HIDDEN)
    before = copy.deepcopy(model.state_dict())
    rng_before = torch.get_rng_state()
    stages = split(model, 2, [0, 1], balance="profile", sample_inputs=(x,))
    assert [len(stage.layer_names) for stage in stages] in ([1, 3], [2, 2], [3, 1])
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())
    assert all(param.grad is None for param in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng_before)


class Pause(nn.Module):
    """Takes longer on some ranks than on others, as timings of one model differ between processes."""

    def __init__(self, seconds_by_rank: dict[int, float]):
        super().__init__()
        self.seconds_by_rank = seconds_by_rank

    def forward(self, x):
        time.sleep(self.seconds_by_rank.get(dist.get_rank(), 0.0))
        return x


def profiled_placement(rank: int, world_size: int) -> list[tuple[str, ...]]:
    model = nn.Sequential(Pause({0: 0.02}), Pause({}), Pause({}), Pause({1: 0.02}))
    stages = split(model, 2, [0, 1], balance="profile", sample_inputs=(torch.randn(BATCH, HIDDEN),))
    return [stage.layer_names for stage in stages]


def test_profile_places_layers_identically_on_every_rank(tmp_path):
    # Alone, rank 0 would put layer 0 on a stage of its own and rank 1 layer 3.
    placements = run_ranks(2, profiled_placement, tmp_path)
    assert placements[0] == placements[1]


def test_annotations_place_ordered_children_and_detect_the_tied_head():
    model = annotated_lm()
    inputs = tokens()
    stages = split(model, 4, [0, 1, 2, 3], example_inputs=(inputs,))
    assert [stage.layer_names for stage in stages] == [
        ("embed", "blocks.0"), ("blocks.1",), ("blocks.2", "blocks.3"), ("norm", "act", "head"),
    ]
    assert isinstance(stages[0](inputs), tuple)  # (hidden states, mask) crosses the stage boundary
    assert torch.equal(run_stages(stages, inputs), model(inputs))
    expected_layers = [model.embed, *model.blocks, model.norm, model.act, model.head]
    assert all(mine is theirs for mine, theirs in zip(layers_of(stages), expected_layers, strict=True))
    assert stages[0].shared_parameters == {"embed.embedding.weight": (0, 3)}
    assert stages[1].shared_parameters == stages[2].shared_parameters == {}
    assert stages[3].shared_parameters == {"head.weight": (0, 3)}
    assert stages[3].get_parameter("head.weight") is stages[0].get_parameter("embed.embedding.weight")


def test_leading_unannotated_layers_without_parameters_join_stage_0():
    model = nn.Sequential(nn.Identity(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
    model[1].pipeline_stage, model[2].pipeline_stage = 0, 1
    assert split(model, 2, 0).layer_names == ("0", "1")


def test_a_module_list_annotated_as_a_whole_places_its_elements_unless_they_say_otherwise():
    model = chain_lm()
    model.embed.pipeline_stage, model.blocks.pipeline_stage = 0, 1
    model.blocks[3].pipeline_stage = model.norm.pipeline_stage = model.head.pipeline_stage = 2
    stages = split(model, 3, [0, 1, 2])
    assert [stage.layer_names for stage in stages] == [
        ("embed",), ("blocks.0", "blocks.1", "blocks.2"), ("blocks.3", "norm", "act", "head"),
    ]
    assert stages[0].shared_parameters == {"embed.embedding.weight": (0, 2)}
    assert stages[2].shared_parameters == {"head.weight": (0, 2)}


def test_interleaved_stages_come_back_as_a_list_in_the_order_asked():
    stages = split(mlp(), 4, [2, 0])
    assert [stage.stage_index for stage in stages] == [2, 0]
    assert [stage.layer_names for stage in stages] == [("4", "5"), ("0", "1")]


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda m: setattr(m.blocks[3], "pipeline_stage", 1),
         "split: 'blocks.3' has pipeline_stage=1 but comes after 'blocks.2' on stage 2; stages must not decrease"),
        (lambda m: setattr(m.head, "pipeline_stage", 2),
         "split: 'head' has pipeline_stage=2 but comes after 'act' on stage 3; stages must not decrease"),
        (lambda m: delattr(m.blocks[1], "pipeline_stage"),
         "split: 'blocks.1' has parameters but no pipeline_stage"),
        (lambda m: setattr(m.head, "pipeline_stage", 4),
         "split: 'head' has pipeline_stage=4; it must be an int in [0, 4)"),
        (lambda m: setattr(m.head, "pipeline_stage", -1),
         "split: 'head' has pipeline_stage=-1; it must be an int in [0, 4)"),
        (lambda m: setattr(m.head, "pipeline_stage", "3"),
         "split: 'head' has pipeline_stage='3'; it must be an int in [0, 4)"),
        (lambda m: (setattr(m.blocks[2], "pipeline_stage", 3), setattr(m.blocks[3], "pipeline_stage", 3)),
         "split: stage 2 gets no layer: 'blocks.1' is on stage 1 and the next layer, 'blocks.2', on stage 3"),
        (lambda m: (setattr(m.norm, "pipeline_stage", 2), setattr(m.head, "pipeline_stage", 2)),
         "split: stage 3 gets no layer: the last layer, 'head', is on stage 2 of 4"),
        (lambda m: (setattr(m.embed, "pipeline_stage", 1), setattr(m.blocks[0], "pipeline_stage", 1)),
         "split: stage 0 gets no layer: the first layer, 'embed', is on stage 1"),
        (lambda m: setattr(m.blocks[0].up, "pipeline_stage", 0),
         "split: Sequential defines its own forward (or carries annotations below its children), which split "
         "captures to cut exactly; pass example_inputs="),
    ],
    ids=["decreasing", "decreasing-after-unannotated", "missing", "too-large", "negative", "not-an-int", "empty-middle",
         "empty-last", "empty-first", "nested"],
)
def test_annotation_errors_name_the_module(break_it, message):
    model = annotated_chain()
    break_it(model)
    with raises(message):
        split(model, 4, 0)


def test_balance_cannot_be_combined_with_annotations():
    with raises("split: balance='uniform' cannot be combined with pipeline_stage annotations (found on 'embed')"):
        split(annotated_chain(), 4, 0, balance="uniform")


@pytest.mark.parametrize(
    "balance, message",
    [
        ([4, 4, 0], "split: balance lists 3 stage sizes for num_stages=2"),
        ([8, 0], "split: balance [8, 0] must give every stage a whole number >= 1 of layers"),
        ([4.0, 4], "split: balance [4.0, 4] must give every stage a whole number >= 1 of layers"),
        ([3, 4], "split: balance [3, 4] places 7 layers but the model has 8"),
        ("flops", "split: unknown balance 'flops'; known: parameters, uniform, profile or a list of layer counts"),
        ("profile", "split: balance='profile' needs sample_inputs, the first layer's positional inputs"),
    ],
)
def test_bad_balance(balance, message):
    with raises(message):
        split(mlp(), 2, 0, balance=balance)


def test_stage_argument_errors():
    with raises("split: num_stages must be >= 1, got 0"):
        split(mlp(), 0, 0)
    with raises("split: num_stages=9 but the model has only 8 layers; every stage needs at least one"):
        split(mlp(), 9, 0)
    with raises("split: stage 2 is out of range for num_stages=2"):
        split(mlp(), 2, 2)
    with raises("split: stage -1 is out of range for num_stages=2"):
        split(mlp(), 2, [0, -1])
    with raises("split: stages [1, 1] name a stage more than once"):
        split(mlp(), 2, [1, 1])


def test_models_split_cannot_run_are_rejected():
    class OwnParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(HIDDEN, HIDDEN)
            self.scale = nn.Parameter(torch.ones(()))

    with raises("split: the model holds scale itself, outside every child"):
        split(OwnParameter(), 1, 0)
    with raises("split: TinyLM defines its own forward (or carries annotations below its children), which split "
                "captures to cut exactly; pass example_inputs="):
        split(annotated_lm(), 4, 0)
    with raises("split: 'table' (ModuleDict) has no forward, but split calls every layer in order"):
        split(nn.Sequential(collections.OrderedDict(layer=nn.Linear(HIDDEN, HIDDEN), table=nn.ModuleDict())), 1, 0)


def test_a_layer_named_like_a_stage_attribute_is_rejected():
    model = nn.Module()
    model.layer_names = nn.Linear(HIDDEN, HIDDEN)
    with raises("split: layer 'layer_names' is named like the StageModule attribute 'layer_names'; rename it"):
        split(model, 1, 0)


def test_original_names_round_trip_through_merge_checkpoints():
    model = annotated_lm()
    inputs = tokens()
    stages = split(model, 4, [0, 1, 2, 3], example_inputs=(inputs,))
    for stage in stages:
        assert set(stage.original_names().values()) <= set(model.state_dict())
    per_stage = [{stage.original_names()[key]: value for key, value in stage.state_dict().items()} for stage in stages]
    merged = merge_checkpoints(per_stage)
    assert set(merged) == set(model.state_dict())
    torch.manual_seed(1)
    fresh = TinyLM()
    assert not torch.equal(fresh(inputs), model(inputs))
    fresh.load_state_dict(merged, strict=True)
    assert torch.equal(fresh(inputs), model(inputs))


def test_merge_checkpoints_accepts_equal_duplicates_and_rejects_different_ones():
    weight = torch.randn(3)
    merged = merge_checkpoints([{"a": weight, "shared": weight}, {"shared": weight.clone(), "b": 1}])
    assert list(merged) == ["a", "shared", "b"] and merged["shared"] is weight
    with raises("merge_checkpoints: 'shared' differs between state dict 0 and state dict 2"):
        merge_checkpoints([{"shared": weight}, {"b": 1}, {"shared": weight + 1}])
    with raises("merge_checkpoints: 'shared' differs between state dict 0 and state dict 1"):
        merge_checkpoints([{"shared": weight}, {"shared": weight.double()}])


def test_device_moves_only_the_requested_stages_layers():
    model = mlp()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    stage = split(model, 4, 2, device="meta")  # layers 4 and 5
    assert all(param.is_meta for param in stage.parameters())
    for name, param in model.named_parameters():
        if name.split(".")[0] in ("4", "5"):
            assert param.is_meta
        else:
            assert param.device.type == "cpu" and torch.equal(param, before[name])


class _Notebook:
    """Plain object two modules share: what one writes, the other reads, outside any forward's outputs."""


class _NotebookUser(nn.Module):
    def __init__(self, notebook):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.notebook = notebook


class _Writer(_NotebookUser):
    def forward(self, x):
        self.notebook.note = self.linear(x) * 2
        return x + 1


class _Reader(_NotebookUser):
    def forward(self, x):
        return self.linear(x) + self.notebook.note


class _WriterThenReader(nn.Module):
    def __init__(self):
        super().__init__()
        notebook = _Notebook()
        self.writer, self.reader = _Writer(notebook), _Reader(notebook)

    def forward(self, x):
        return self.reader(self.writer(x))


def test_a_value_one_module_hands_another_on_the_side_is_refused():
    # Called as its own module on another stage, the reader would find no note (or a stale one).
    model = _WriterThenReader()
    model.writer.pipeline_stage, model.reader.pipeline_stage = 0, 1
    with pytest.raises(ValueError, match=r"computed inside 'writer', is used outside it without being one of its outputs"):
        split(model, 2, 0, example_inputs=(torch.randn(2, 4),))


def test_parameters_of_two_stages_sharing_memory_are_refused_and_disjoint_views_of_one_buffer_are_not():
    # A Parameter viewing another stage's weight: each rank updated its own copy, and they drifted apart silently.
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = nn.Parameter(first.weight.data[:4])
    with pytest.raises(ValueError, match=r"the parameter '1.weight' of stage 1 shares memory with '0.weight' on stage 0"):
        split(nn.Sequential(first, second), 2, 0, balance=[1, 1])
    flat = torch.zeros(2 * 16)  # every weight a view of one flat buffer, each its own part
    first.weight, second.weight = (nn.Parameter(flat[16 * index:16 * (index + 1)].view(4, 4)) for index in range(2))
    split(nn.Sequential(first, second), 2, 0, balance=[1, 1])
