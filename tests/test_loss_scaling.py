"""fp16-style loss scaling through a pipeline: the loss scaled by torch's ShardedGradScaler inside ``loss_fn`` on the
last stage, every rank's scaler agreeing on inf/NaN over the pipeline's group, trains as one process with torch's
GradScaler: the same steps taken and skipped, the same scale after each, the same parameters."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import pipecomm
from ranks import run_ranks

STEPS, MICRO_BATCHES = 4, 4
SKIPPED = 1  # the step whose gradients get an inf on the first stage


def stages() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 4), nn.Tanh()))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)


def poison(module: nn.Module) -> None:
    """An overflow in the first Linear's weight gradient, as fp16 gives one."""
    module[0][0].weight.grad[0, 0] = float("inf")


def scaled_steps(rank: int, world_size: int) -> list[tuple[float, float]]:
    model = stages()
    reference = copy.deepcopy(model)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.zeros(()))  # starts the scale on every rank: only the last stage's scales a loss
    pipe = pipecomm.Pipeline(model[rank], stage=rank, num_stages=world_size, micro_batches=MICRO_BATCHES,
                             loss_fn=lambda output, target: scaler.scale(nn.functional.mse_loss(output, target)))
    optimizer = torch.optim.SGD(model[rank].parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        scale = scaler.get_scale()
        loss = pipe.step(x, target=y)
        if step == SKIPPED and rank == 0:
            poison(model)
        scaler.unscale_(optimizer)  # every rank's inf check, summed over the group
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

        ref_loss = sum(nn.functional.mse_loss(reference(a), b) for a, b in zip(x.chunk(MICRO_BATCHES),
                                                                                 y.chunk(MICRO_BATCHES)))
        ref_scaler.scale(ref_loss / MICRO_BATCHES).backward()
        if step == SKIPPED:
            poison(reference)
        ref_scaler.unscale_(ref_optimizer)
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        ref_optimizer.zero_grad()

        torch.testing.assert_close(loss / scale, ref_loss.detach() / MICRO_BATCHES, msg=f"step {step}")
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
        seen.append((scale, scaler.get_scale()))
    for param, ref in zip(model[rank].parameters(), reference[rank].parameters()):
        torch.testing.assert_close(param, ref)
    pipe.close()
    return seen


def test_a_step_with_an_overflow_on_one_rank_is_skipped_on_every_rank_as_in_one_process(tmp_path):
    scales = run_ranks(2, scaled_steps, tmp_path, timeout=120)
    assert scales[0] == scales[1]
    assert scales[0][SKIPPED][1] == scales[0][SKIPPED][0] / 2, scales[0]  # the skip halved the scale
