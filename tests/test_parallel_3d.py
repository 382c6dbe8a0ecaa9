"""The pipeline composed with torch's FSDP2 (dp) and tensor parallelism (tp): exact against one process on the global batch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import pipecomm
from pipecomm.runtime import offload_planner
from ranks import held_stages, run_ranks

WIDTH, SEQUENCE, STEPS, MICRO_BATCHES = 8, 4, 3, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model(num_stages: int) -> nn.Sequential:
    """Per stage: an input layer (the first stage's), blocks, a head (the last stage's)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(2 * num_stages)], nn.Linear(WIDTH, WIDTH))


def stage_of(model: nn.Sequential, stage: int, num_stages: int) -> nn.Sequential:
    """Stage s holds blocks 2s and 2s + 1; the first also the input layer, the last the head."""
    first = 0 if stage == 0 else 1 + 2 * stage
    last = len(model) if stage == num_stages - 1 else 1 + 2 * (stage + 1)
    return nn.Sequential(*model[first:last])


def batch(step: int, size: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, SEQUENCE, WIDTH, generator=generator), torch.randn(size, SEQUENCE, WIDTH, generator=generator)


def tensor_parallel(block: Block, mesh, sequence_parallel: bool, first: bool, last: bool) -> None:
    """Megatron's MLP split: up by columns, down by rows. With sequence parallelism the blocks pass sequence shards
    (across stage boundaries too) and run the norm on them; the model's first block shards its input, its last
    gathers its output."""
    if not sequence_parallel:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return
    plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}
    if first:
        plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                      use_local_output=True)
    parallelize_module(block, mesh, plan)
    if last:
        parallelize_module(block, mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                            desired_output_layouts=(Replicate(),)))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_and_compare(rank: int, world_size: int, pipeline_size: int, data_size: int, tensor_size: int,
                      schedule: str, fsdp: str, sequence_parallel: bool = False, recompute: bool = False,
                      offload: bool = False) -> str:
    """``fsdp``: "none", "blocks" (each block sharded) or "stage" (the blocks, then the whole stage as FSDP's root).
    With ``offload``, copies that take no time: every wait's activations go to host memory from the second step."""
    if offload:
        offload_planner.copy_speeds = lambda device: (math.inf, math.inf)
    ctx = pipecomm.init(pipeline_size=pipeline_size, data_size=data_size, tensor_size=tensor_size)
    stages = held_stages(schedule, pipeline_size, MICRO_BATCHES, 2 if schedule == "zb-v" else 1, ctx.stage)
    num_stages = pipeline_size * len(stages)
    model, reference = make_model(num_stages), make_model(num_stages)
    modules = [stage_of(model, stage, num_stages) for stage in stages]
    blocks = [layer for layer in model if isinstance(layer, Block)]
    for module in modules:
        for layer in module:
            if isinstance(layer, Block):
                if tensor_size > 1:
                    tensor_parallel(layer, ctx.mesh["tp"], sequence_parallel, layer is blocks[0], layer is blocks[-1])
                if fsdp != "none":
                    fully_shard(layer, mesh=ctx.mesh["dp"])
        if fsdp == "stage":
            fully_shard(module, mesh=ctx.mesh["dp"])
    pipe = pipecomm.Pipeline(modules, stage=stages, num_stages=num_stages, loss_fn=F.mse_loss,
                             micro_batches=MICRO_BATCHES, schedule=schedule, group=ctx.pipeline_group,
                             data_group=ctx.data_group, timeout=60, recompute=recompute, offload=offload)
    optimizer = torch.optim.AdamW([p for module in modules for p in module.parameters()], lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    local = 2 * MICRO_BATCHES
    for step in range(STEPS):
        inputs, target = batch(step, local * data_size)  # the global batch; each replica trains on its share
        share = slice(local * ctx.dp_rank, local * (ctx.dp_rank + 1))
        if step == 1:  # inference between steps: FSDP must reshard after it, or the next step reads stale weights
            with torch.no_grad():
                torch.testing.assert_close(pipe.forward(inputs[share], broadcast_result=True),
                                           reference(inputs[share]), rtol=1e-4, atol=1e-5)
        loss = pipe.step(inputs[share], target=target[share])
        ref_loss = F.mse_loss(reference(inputs), target)
        ref_loss.backward()
        # A small bound, so that clipping scales every step: the norm must count sharded gradients whole.
        norm = pipe.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        if data_size == 1:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    for stage, module in zip(stages, modules):
        expected = dict(stage_of(reference, stage, num_stages).named_parameters())
        for name, param in module.named_parameters():
            torch.testing.assert_close(full(param.detach()), expected[name].detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda text, name=name: f"stage {stage} {name}: {text}")
    assert not offload or pipe.offload_plan.offloaded[ctx.stage], "nothing was offloaded"
    pipe.close()
    return f"pp {ctx.stage} dp {ctx.dp_rank} tp {ctx.tp_rank}"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize("fsdp", ["blocks", "stage"])
def test_fsdp_stages_train_like_one_process(tmp_path, schedule, fsdp):
    results = run_ranks(4, train_and_compare, tmp_path, 2, 2, 1, schedule, fsdp, timeout=180)
    assert len(set(results)) == 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_stages_train_like_one_process(tmp_path, schedule, sequence_parallel):
    results = run_ranks(4, train_and_compare, tmp_path, 2, 1, 2, schedule, "none", sequence_parallel, timeout=180)
    assert len(set(results)) == 4


def test_fsdp_stages_recompute_with_deferred_weight_gradients(tmp_path):
    results = run_ranks(4, train_and_compare, tmp_path, 2, 2, 1, "zb-h1", "stage", False, True, timeout=180)
    assert len(set(results)) == 4


@pytest.mark.parametrize("data_size, tensor_size, fsdp", [(2, 1, "blocks"), (1, 2, "none")], ids=["fsdp", "tp"])
def test_fsdp_and_tensor_parallel_stages_offload_exactly(tmp_path, data_size, tensor_size, fsdp):
    results = run_ranks(4, train_and_compare, tmp_path, 2, data_size, tensor_size, "zb-h1", fsdp, False, False, True,
                        timeout=180)
    assert len(set(results)) == 4


def test_data_pipeline_and_tensor_parallel_together_train_like_one_process(tmp_path):
    results = run_ranks(8, train_and_compare, tmp_path, 2, 2, 2, "zb-h1", "blocks", True, True, timeout=300)
    assert len(set(results)) == 8


class Gathered(nn.Module):
    """Reads its input as the whole DTensor it is (a plain shard has no full_tensor)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.full_tensor())


def dtensor_across(rank: int, world_size: int, schedule: str) -> str:
    """Stage 0's column-parallel layer hands stage 1 a DTensor (sharded features): it crosses as local shards, each
    tp rank to its peer, and is rebuilt with its placements, which stage 1 gathers."""
    ctx = pipecomm.init(pipeline_size=2, tensor_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH))
    reference = copy.deepcopy(model)
    layer = model[ctx.stage]
    if ctx.stage == 0:
        parallelize_module(layer, ctx.mesh["tp"], ColwiseParallel(use_local_output=False))
    module = layer if ctx.stage == 0 else Gathered(layer)
    pipe = pipecomm.Pipeline(module, stage=ctx.stage, num_stages=2, loss_fn=F.mse_loss, micro_batches=MICRO_BATCHES,
                             schedule=schedule, group=ctx.pipeline_group, timeout=60)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        inputs, target = batch(step, 2 * MICRO_BATCHES)
        loss = pipe.step(inputs, target=target)
        ref_loss = F.mse_loss(reference(inputs), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
        for optim in (optimizer, ref_optimizer):
            optim.step()
            optim.zero_grad()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(full(param.detach()), dict(reference[ctx.stage].named_parameters())[name],
                                   rtol=1e-4, atol=1e-5)
    pipe.close()
    return f"pp {ctx.stage} tp {ctx.tp_rank}"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_dtensor_crosses_a_stage_boundary_as_shards_and_is_rebuilt(tmp_path, schedule):
    assert len(set(run_ranks(4, dtensor_across, tmp_path, schedule, timeout=120))) == 4
