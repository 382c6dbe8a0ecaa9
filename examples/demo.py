"""Demo: a pipeline-parallel training run on CPU processes (or GPUs when present), checked against single-process gradients."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipecomm


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build_stages(num_stages: int, layers_per_stage: int, hidden: int, vocab: int) -> list[nn.Module]:
    """A small GPT-shaped model (embedding, residual MLP blocks, LM head), cut into equal stages."""
    torch.manual_seed(0)
    blocks = [Block(hidden) for _ in range(num_stages * layers_per_stage)]
    stages = []
    for index in range(num_stages):
        layers: list[nn.Module] = [nn.Embedding(vocab, hidden)] if index == 0 else []
        layers += blocks[index * layers_per_stage : (index + 1) * layers_per_stage]
        if index == num_stages - 1:
            layers += [nn.LayerNorm(hidden), nn.Linear(hidden, vocab)]
        stages.append(nn.Sequential(*layers))
    return stages


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start: learnable, so the loss visibly falls."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, args.vocab, (args.batch, 1), generator=generator)
    tokens = (starts + torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def progress(step: int, total: int, loss: float, samples_per_second: float) -> str:
    filled = round(20 * step / total)
    return f"[{'#' * filled}{'.' * (20 - filled)}] step {step:3d}/{total}  loss {loss:.4f}  {samples_per_second:8.1f} samples/s"


def run(rank: int, world_size: int, store_path: str, args) -> None:
    # The stages share the machine's cores: more threads each would only make them contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size and pipecomm.cuda_built()
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world_size)
    stages = build_stages(world_size, args.layers, args.hidden, args.vocab)
    reference = copy.deepcopy(stages)
    module = stages[rank].to(device)
    pipe = pipecomm.Pipeline(
        module, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=args.micro_batches,
        schedule=args.schedule, device=device,
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    last = rank == world_size - 1
    if last:
        print(f"pipecomm {pipecomm.__version__}: {world_size} stages on {device.type}, schedule {args.schedule}, "
              f"{args.micro_batches} micro-batches of {args.batch // args.micro_batches}", flush=True)
    for step in range(1, args.steps + 1):
        inputs, targets = make_batch(step, args)
        started = time.perf_counter()
        loss = pipe.step(inputs, target=targets)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()  # the demo prints every step; a training loop need not sync
        if last:
            print(progress(step, args.steps, loss_value, args.batch / (time.perf_counter() - started)), flush=True)

    # One more batch, compared with the unsplit model (the trained weights of every stage) on one process.
    inputs, targets = make_batch(0, args)
    pipe.step(inputs, target=targets)
    states = [None] * world_size
    dist.all_gather_object(states, {k: v.cpu() for k, v in module.state_dict().items()})
    for index, state in enumerate(states):
        reference[index].load_state_dict(state)
    logits = inputs
    for stage in reference:
        logits = stage(logits)
    loss_fn(logits, targets).backward()
    worst = max(
        ((mine.grad.cpu() - ref.grad).norm() / ref.grad.norm().clamp_min(1e-12)).item()
        for mine, ref in zip(module.parameters(), reference[rank].parameters())
    )
    worst_all = [None] * world_size
    dist.all_gather_object(worst_all, worst)
    if last:
        verdict = "OK" if max(worst_all) < 1e-4 else "MISMATCH"
        print(f"gradients vs single process: worst relative error {max(worst_all):.2e} per stage "
              f"{[f'{w:.1e}' for w in worst_all]} -> {verdict}", flush=True)
    pipe.close()
    dist.destroy_process_group()
    if last and max(worst_all) >= 1e-4:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and pipecomm.cuda_built() else 0
    parser.add_argument("--stages", type=int, default=gpus if gpus >= 2 else 2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="blocks per stage")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(run, args=(args.stages, os.path.join(scratch, "store"), args), nprocs=args.stages, join=True)


if __name__ == "__main__":
    main()
