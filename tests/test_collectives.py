"""The pipeline's broadcasts: on CPU over the step's links, down a tree from the last stage's rank, exact on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ranks import run_ranks

import pipecomm
from pipecomm.runtime.collectives import broadcast_parents
from pipecomm.schedules.schedule import make_schedule


@pytest.mark.parametrize(("name", "num_ranks", "parents"), [
    ("1f1b", 1, {0: None}),
    ("1f1b", 4, {3: None, 2: 3, 1: 2, 0: 1}),  # a chain, down the pipeline
    ("interleaved-1f1b", 4, {3: None, 0: 3, 2: 3, 1: 0}),  # a ring: stage 3 on rank 3 feeds stage 4 on rank 0
    ("zb-v", 4, {0: None, 1: 0, 2: 1, 3: 2}),  # the V's last stage is on rank 0
])
def test_the_tree_starts_at_the_last_stage_and_follows_the_links(name, num_ranks, parents):
    schedule = make_schedule(name, num_ranks, 8, 2 if name in ("interleaved-1f1b", "zb-v") else 1)
    assert broadcast_parents(schedule, schedule.stage_rank(schedule.num_stages - 1)) == parents


def losses_and_results(rank: int, world_size: int, dtype: torch.dtype) -> tuple[list[bytes], bytes]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(world_size))).to(dtype)
    pipe = pipecomm.Pipeline(pipecomm.split(model, world_size, rank), stage=rank, num_stages=world_size,
                             loss_fn=nn.functional.mse_loss, micro_batches=4, timeout=60)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = (torch.randn(8, 8, generator=generator).to(dtype) for _ in range(2))
        loss = pipe.step(x, target=y)
        with torch.no_grad():  # one process: the mean of the micro-batches' losses, summed in their order
            expected = sum(nn.functional.mse_loss(model(part), target) / 4
                           for part, target in zip(x.chunk(4), y.chunk(4)))
        assert loss.dtype == dtype and torch.equal(loss, expected), (loss, expected)
        losses.append(loss.float().numpy().tobytes())
    with torch.no_grad():
        result = pipe.forward(x, broadcast_result=True)
        torch.testing.assert_close(result, model(x))
    pipe.close()
    return losses, result.float().numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_losses_and_results_are_the_last_stages_bit_for_bit_on_every_rank(tmp_path, dtype):
    # The loss in its own dtype: a float64 model's is not rounded to float32 on the way.
    outcomes = run_ranks(3, losses_and_results, tmp_path, dtype)
    assert all(outcome == outcomes[-1] for outcome in outcomes), outcomes
