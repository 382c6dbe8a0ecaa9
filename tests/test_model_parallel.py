"""Model-level features on CPU processes: annotated split, tied weights across stages, data parallel × pipeline, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ranks import run_ranks

import pipecomm

VOCAB = 32
HIDDEN = 16
SEQ = 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


class TiedLM(nn.Module):
    """Embedding on the first stage, LM head on the last, sharing one weight; children run in order."""

    def __init__(self, num_stages: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2 * num_stages))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.embed.pipeline_stage = 0
        for index, block in enumerate(self.blocks):
            block.pipeline_stage = index // 2
        self.norm.pipeline_stage = num_stages - 1
        self.head.pipeline_stage = num_stages - 1

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tokens(seed: int, batch: int):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def build(num_stages: int) -> TiedLM:
    torch.manual_seed(0)
    return TiedLM(num_stages)


def tied_weights(rank: int, world_size: int, schedule: str) -> str:
    """Three steps with clipping and SGD; under zb-v the embedding (stage 0) and the head (the last stage) both sit on
    rank 0, one Parameter in two stage modules: it counts once in the norm and the optimizer."""
    num_stages = 2 * world_size if schedule == "zb-v" else world_size
    mine = list(pipecomm.make_schedule(schedule, world_size, 4).stages_of(rank)) if schedule == "zb-v" else [rank]
    model = build(num_stages)
    reference = copy.deepcopy(model)
    stages = pipecomm.split(model, num_stages, mine, example_inputs=tokens(0, 2)[:1])
    for stage, index in zip(stages, mine):
        if index in (0, num_stages - 1):
            assert stage.shared_parameters == {"embed.weight" if index == 0 else "head.weight": (0, num_stages - 1)}
    pipe = pipecomm.Pipeline(stages, stage=mine, num_stages=num_stages, loss_fn=loss_fn, micro_batches=4,
                             schedule=schedule, timeout=60)
    params = list(pipe.parameters())
    assert len(params) == len({id(param) for param in params})
    named = list(pipe.named_parameters())  # the same, under the model's own names
    assert [id(param) for _, param in named] == [id(param) for param in params]
    assert {name for name, _ in named} <= set(dict(reference.named_parameters(remove_duplicate=False)))
    optimizer = torch.optim.SGD(params, lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        inputs, targets = tokens(step, 8)
        loss = pipe.step(inputs, target=targets)
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        # A bound small enough to scale every step: the tied weight counts once in the norm.
        norm = pipe.clip_grad_norm_(0.05)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05),
                                   rtol=1e-5, atol=1e-6)
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for stage in stages:
            for name, param in stage.named_parameters(remove_duplicate=False):
                # The tied weight's gradient sums the embedding's and the head's uses on both stages.
                torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    if 0 in mine or num_stages - 1 in mine:
        torch.testing.assert_close(model.embed.weight, reference.embed.weight)
    pipe.close()
    return "ok"


@pytest.mark.parametrize(("world_size", "schedule"), [(2, "1f1b"), (4, "1f1b"), (2, "zb-v")])
def test_tied_embedding_and_head_match_the_single_model(tmp_path, world_size, schedule):
    run_ranks(world_size, tied_weights, tmp_path, schedule, timeout=120)


def tied_weight_renormalized(rank: int, world_size: int, schedule: str) -> str:
    num_stages = 2 * world_size if schedule == "zb-v" else world_size
    mine = list(pipecomm.make_schedule(schedule, world_size, 4).stages_of(rank)) if schedule == "zb-v" else [rank]
    model = build(num_stages)
    model.embed.max_norm = 1.0  # renormalizes the rows it looks up, in place, in every forward
    stages = pipecomm.split(model, num_stages, mine, example_inputs=tokens(0, 2)[:1])
    pipe = pipecomm.Pipeline(stages, stage=mine, num_stages=num_stages, loss_fn=loss_fn, micro_batches=4,
                             schedule=schedule, timeout=60)
    with pytest.raises(RuntimeError) as raised:
        pipe.step(*tokens(0, 8)[:1], target=tokens(0, 8)[1])
    return str(raised.value)


@pytest.mark.parametrize(("world_size", "schedule"), [(2, "1f1b"), (2, "zb-v")])
def test_a_tied_weight_changed_in_place_by_the_forward_is_refused(tmp_path, world_size, schedule):
    # One process renormalizes each micro-batch's rows before the head reads them; the pipeline runs the embedding's
    # forwards ahead of the head's, and under 1f1b the head's rank holds a copy the renormalization never reaches.
    for text in run_ranks(world_size, tied_weight_renormalized, tmp_path, schedule, timeout=120):
        assert "the parameter 'embed.weight', which several stages use, was changed in place during the step" in text


def data_times_pipeline(rank: int, world_size: int) -> str:
    context = pipecomm.init(pipeline_size=2, data_size=2)
    assert (context.num_stages, context.data_size) == (2, 2)
    model = build(2)
    model.blocks[-1].idle = nn.Linear(HIDDEN, HIDDEN)  # no replica uses it: no gradient, so no weight decay either
    reference = copy.deepcopy(model)
    stage = pipecomm.split(model, 2, context.stage, example_inputs=tokens(0, 2)[:1])
    pipe = pipecomm.Pipeline(
        stage, stage=context.stage, num_stages=2, loss_fn=loss_fn, micro_batches=2,
        group=context.pipeline_group, data_group=context.data_group, timeout=60,
    )
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        inputs, targets = tokens(step, 8)  # the global batch; each replica trains on its half
        half = slice(4 * context.dp_rank, 4 * context.dp_rank + 4)
        pipe.step(inputs[half], target=targets[half])
        loss_fn(reference(inputs), targets).backward()
        grads = {name: param.grad for name, param in stage.named_parameters()}
        assert [name for name, grad in grads.items() if grad is None] == (["blocks.3.idle.weight", "blocks.3.idle.bias"]
                                                                           if context.stage == 1 else []), grads
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in stage.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(param, ref_params[name], rtol=1e-5, atol=1e-6)
    pipe.close()
    return f"stage {context.stage} replica {context.dp_rank}"


def test_data_parallel_times_pipeline_equals_single_process_on_the_global_batch(tmp_path):
    results = run_ranks(4, data_times_pipeline, tmp_path, timeout=120)
    assert sorted(results) == ["stage 0 replica 0", "stage 0 replica 1", "stage 1 replica 0", "stage 1 replica 1"]


def checkpoint_round_trip(rank: int, world_size: int) -> str:
    model = build(world_size)
    stage = pipecomm.split(model, world_size, rank, example_inputs=tokens(0, 2)[:1])
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(2):
        inputs, targets = tokens(step, 4)
        pipe.step(inputs, target=targets)
        optimizer.step()
        optimizer.zero_grad()
    states = [None] * world_size
    dist.all_gather_object(states, pipe.state_dict())
    merged = pipecomm.merge_checkpoints(states)
    unsplit = TiedLM(world_size)
    unsplit.load_state_dict(merged, strict=True)
    inputs, _ = tokens(99, 4)
    output = pipe.forward(inputs, broadcast_result=True)
    with torch.no_grad():
        torch.testing.assert_close(output, unsplit(inputs))
    # Loading a rank's own state back is exact; a key of another stage is an error, raised before anything loads;
    # the whole model's checkpoint loads with strict=False.
    pipe.load_state_dict(pipe.state_dict())
    before = {key: value.clone() for key, value in pipe.state_dict().items()}
    zeroed = {key: torch.zeros_like(value) for key, value in pipe.state_dict().items()}
    with pytest.raises(ValueError, match=r"have no keys \['not.a.key'\]; nothing was loaded"):
        pipe.load_state_dict({**zeroed, "not.a.key": torch.zeros(1)})
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    pipe.load_state_dict(merged, strict=False)
    pipe.close()
    return "ok"


def test_checkpoint_merge_loads_into_the_unsplit_model(tmp_path):
    run_ranks(2, checkpoint_round_trip, tmp_path, timeout=120)


def bad_mesh(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match=r"data_size × pipeline_size × tensor_size must equal the world size: "
                                         r"1 × 3 × 1 != 2"):
        pipecomm.init(pipeline_size=3)
    with pytest.raises(ValueError, match=r"1 × 2 × 2 != 2"):
        pipecomm.init(pipeline_size=2, tensor_size=2)
    with pytest.raises(ValueError, match=r"not divisible by data_size × tensor_size = 3 × 1"):
        pipecomm.init(data_size=3)
    with pytest.raises(ValueError, match=r"not divisible by data_size × tensor_size = 1 × 4"):
        pipecomm.init(tensor_size=4)
    with pytest.raises(ValueError, match=r"tensor_size must be a positive int, got 0"):
        pipecomm.init(tensor_size=0)
    context = pipecomm.init(tensor_size=2)
    assert (context.num_stages, context.tensor_size, context.tp_rank) == (1, 2, rank)
    assert context.mesh.mesh_dim_names == ("dp", "pp", "tp")
    return "ok"


def test_init_checks_the_sizes_and_builds_the_dp_pp_tp_mesh(tmp_path):
    run_ranks(2, bad_mesh, tmp_path)
