"""Trains a small GPT with a tied embedding, data × pipeline × tensor parallel: torchrun --nproc_per_node N
examples/train_gpt.py --pp P --dp D --tp T [--fsdp] [--recompute]."""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import pipecomm
from pipecomm.schedules.simulation import simulate


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_size = hidden // heads
        self.attention_norm = nn.LayerNorm(hidden)
        # Separate projections, so that tensor parallelism gives each rank whole heads of each.
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.projection = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        batch, seq, _ = x.shape
        normed = self.attention_norm(x)
        # -1 heads: under tensor parallelism this rank's share of them.
        q, k, v = (layer(normed).view(batch, seq, -1, self.head_size).transpose(1, 2)
                   for layer in (self.query, self.key, self.value))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))

    def parallelize(self, mesh) -> None:
        """Megatron's split: heads and the MLP's inner width across the mesh, one all-reduce after each half."""
        parallelize_module(self, mesh, {"query": ColwiseParallel(), "key": ColwiseParallel(),
                                        "value": ColwiseParallel(), "projection": RowwiseParallel(),
                                        "up": ColwiseParallel(), "down": RowwiseParallel()})


class GPT(nn.Module):
    """Children run in order (what pipecomm.split supports); the LM head shares the embedding's weight."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.positions = _Positions(context, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # tied: it also scales the first logits


class _Positions(nn.Module):
    def __init__(self, context: int, hidden: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(context, hidden))

    def forward(self, x):
        return x + self.table[: x.shape[1]]


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Data:
    """Byte-level windows of a text file, or synthetic counting sequences (learnable) by default."""

    def __init__(self, path: str | None, seq: int, vocab: int):
        self.seq, self.vocab = seq, vocab
        self.text = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long() if path else None
        if self.text is not None and len(self.text) <= seq + 1:
            raise SystemExit(f"{path} has {len(self.text)} bytes; need more than --seq + 1 = {seq + 1}")

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        if self.text is None:
            starts = torch.randint(0, self.vocab, (size, 1), generator=generator)
            tokens = (starts + torch.arange(self.seq + 1)) % self.vocab
        else:
            offsets = torch.randint(0, len(self.text) - self.seq - 1, (size,), generator=generator)
            tokens = torch.stack([self.text[o : o + self.seq + 1] for o in offsets.tolist()])
        return tokens[:, :-1], tokens[:, 1:]


VOCAB = 256  # byte-level


def build_stages(context: pipecomm.ParallelContext, hidden: int, heads: int, layers: int, seq: int, stages: list[int],
                 fsdp: bool) -> tuple[GPT, list[nn.Module]]:
    """The whole GPT (every rank builds the same one) and this rank's stages of it (``stages``: the same count on
    every rank), split by parameter count, their blocks tensor-parallel over the "tp" mesh and, with ``fsdp``, sharded
    over the "dp" mesh."""
    torch.manual_seed(0)
    model = GPT(VOCAB, hidden, heads, layers, seq)
    modules = pipecomm.split(model, context.num_stages * len(stages), stages, balance="parameters",
                             device=context.device)
    for block in (layer for module in modules for layer in module.modules() if isinstance(layer, Block)):
        if context.tensor_size > 1:
            block.parallelize(context.mesh["tp"])
        if fsdp:
            fully_shard(block, mesh=context.mesh["dp"])  # the tied embedding and head stay replicated
    return model, modules


def build_pipeline(context: pipecomm.ParallelContext, modules: list[nn.Module], stages: list[int], micro_batches: int,
                   schedule: str = "1f1b", **options) -> pipecomm.Pipeline:
    """A Pipeline of this rank's stages over pipecomm.init's pipeline and data-parallel groups; ``options`` are
    Pipeline's own (cuda_graphs, recompute, ...)."""
    return pipecomm.Pipeline(modules, stage=stages, num_stages=context.num_stages * len(stages), loss_fn=loss_fn,
                             micro_batches=micro_batches, schedule=schedule, group=context.pipeline_group,
                             data_group=context.data_group, device=context.device, **options)


def replica_batch(data: Data, step: int, context: pipecomm.ParallelContext,
                  size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's sequences of a step: each replica draws its own."""
    return data.batch(step * context.data_size + context.dp_rank, size)


def make_optimizer(parameters, lr: float) -> torch.optim.AdamW:
    """AdamW over a stage's parameters. Under tensor parallelism or FSDP some are DTensors and some (the replicated
    embedding, head and norms) plain tensors, a mix that the multi-tensor kernels AdamW uses on GPUs refuse."""
    parameters = list(parameters)
    mixed = len({isinstance(param, DTensor) for param in parameters}) > 1
    return torch.optim.AdamW(parameters, lr=lr, foreach=False if mixed else None)


def train_step(pipe: pipecomm.Pipeline, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               max_grad_norm: float | None = 1.0) -> torch.Tensor:
    """Forward, backward, clipping (unless ``max_grad_norm`` is None) and the optimizer's step; returns the loss."""
    loss = pipe.step(inputs, target=targets)
    if max_grad_norm is not None:
        pipe.clip_grad_norm_(max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default: world size / dp)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (heads and MLP split)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard each block over the data-parallel replicas with torch's fully_shard")
    parser.add_argument("--recompute", action="store_true", help="recompute each stage's forward in its backward")
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto"])
    parser.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank for interleaved-1f1b")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cuda-graphs", nargs="?", choices=("auto", "on", "off"), default="auto", const="on",
                        help="CUDA graphs: auto (the Pipeline's default: where a stage is host-bound, checked), on "
                             "(from the first step; the flag alone), off")
    parser.add_argument("--data", default=None, help="a text file to train on (bytes); synthetic data otherwise")
    args = parser.parse_args()

    context = pipecomm.init(pipeline_size=args.pp, data_size=args.dp, tensor_size=args.tp)
    if args.heads % args.tp:
        raise SystemExit(f"--heads {args.heads} must be divisible by --tp {args.tp}")
    # "auto" starts from zb-h1 and plans for the stages it was given; zb-v places two per rank in a V.
    start = pipecomm.starting_schedule(args.schedule, context.num_stages, args.micro_batches,
                                       args.virtual_stages if args.schedule == "interleaved-1f1b" else None)
    num_stages = start.num_stages
    if args.layers % num_stages:
        raise SystemExit(f"--layers {args.layers} must be divisible by the {num_stages} stages")
    stages = list(start.stages_of(context.stage))
    model, modules = build_stages(context, args.hidden, args.heads, args.layers, args.seq, stages, args.fsdp)
    pipe = build_pipeline(
        context, modules, stages, args.micro_batches, args.schedule,
        cuda_graphs={"auto": "auto", "on": True, "off": False}[args.cuda_graphs],
        device_timing=context.device.type == "cuda",  # the bubble the GPUs saw, not the host's launch time
        recompute=args.recompute,
    )
    optimizer = make_optimizer(pipe.parameters(), args.lr)
    data = Data(args.data, args.seq, VOCAB)
    batch_size = args.micro_batches * args.micro_batch_size  # per replica
    global_tokens = batch_size * args.seq * context.data_size
    theory = simulate(start).bubble_fraction
    reporter = context.stage == context.num_stages - 1 and context.dp_rank == 0 and context.tp_rank == 0
    if reporter:
        print(f"GPT {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, pp={context.num_stages} "
              f"dp={context.data_size}{' (FSDP)' if args.fsdp else ''} tp={context.tensor_size} on {context.device.type}, schedule {args.schedule}, "
              f"theoretical bubble {theory:.3f}", flush=True)
    for step in range(1, args.steps + 1):
        inputs, targets = replica_batch(data, step, context, batch_size)
        started = time.perf_counter()
        loss = train_step(pipe, optimizer, inputs, targets)
        loss_value = loss.item()  # logging syncs once per step
        elapsed = time.perf_counter() - started
        if reporter:
            print(f"step {step:4d}  loss {loss_value:.4f}  {global_tokens / elapsed:10.0f} tokens/s  "
                  f"bubble {pipe.bubble_fraction():.3f}", flush=True)
        if not math.isfinite(loss_value):
            raise SystemExit("loss is not finite")
    if context.device.type == "cuda" and context.dp_rank == 0:
        print(f"stage {context.stage}: peak memory {torch.cuda.max_memory_allocated(context.device) / 1e9:.3f} GB",
              flush=True)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
