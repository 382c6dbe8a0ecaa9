"""Trains a Hugging Face Llama-architecture model, built from a config, pipeline-parallel: annotate, split, train."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import pipecomm
from pipecomm.schedules.simulation import simulate

# interleaved-1f1b's chunks per rank (rank r: r and r + p); zb-v places its two per rank in a V (r and 2p - 1 - r).
INTERLEAVED_CHUNKS = 2


def loss_fn(output, labels):
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start: learnable, so the loss visibly falls."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, args.vocab, (args.micro_batches * args.micro_batch_size, 1), generator=generator)
    tokens = (starts + torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: the world size)")
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention's key/value heads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    context = pipecomm.init(pipeline_size=args.pp)
    # "auto" runs zb-h1 while it measures, then plans for the one stage per rank it was given.
    start = pipecomm.starting_schedule(args.schedule, context.num_stages, args.micro_batches,
                                       INTERLEAVED_CHUNKS if args.schedule == "interleaved-1f1b" else None)
    num_stages = start.num_stages
    if args.layers < num_stages:
        raise SystemExit(f"--layers {args.layers} must be at least the {num_stages} stages of {args.schedule}")
    torch.manual_seed(0)  # every rank builds the same model
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, use_cache=False,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    # Annotate the model's own submodules: that is all the adapting it needs.
    model.model.embed_tokens.pipeline_stage = 0
    for index, layer in enumerate(model.model.layers):
        layer.pipeline_stage = index * num_stages // args.layers
    model.model.norm.pipeline_stage = model.lm_head.pipeline_stage = num_stages - 1

    stages = list(start.stages_of(context.stage))
    inputs, labels = batch(0, args)
    held = pipecomm.split(model, num_stages, stages, example_inputs=(inputs[: args.micro_batch_size],),
                          device=context.device)
    on_gpu = context.device.type == "cuda"
    pipe = pipecomm.Pipeline(held, stage=stages, num_stages=num_stages,
                             loss_fn=loss_fn, micro_batches=args.micro_batches, schedule=args.schedule,
                             group=context.pipeline_group, data_group=context.data_group, device=context.device,
                             device_timing=on_gpu)  # the bubble the GPUs saw, not the host's launch time
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    rates, bubbles = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        inputs, labels = batch(step, args)
        loss = pipe.step(inputs, target=labels)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()  # waits for the step, so the time below is the step's
        tokens_per_second = inputs.numel() / (time.perf_counter() - started)
        bubble = pipe.bubble_fraction()
        rates.append(tokens_per_second)
        bubbles.append(bubble)
        if context.rank == 0:
            print(f"step {step:3d}  loss {loss_value:.4f}  {tokens_per_second:9.0f} tokens/s  bubble {bubble:.3f}",
                  flush=True)
    if on_gpu:
        print(f"rank {context.rank} (stages {', '.join(map(str, stages))}): peak memory "
              f"{torch.cuda.max_memory_allocated(context.device) / 1e9:.3f} GB", flush=True)
    if context.rank == 0:
        # The later half of the steps: "auto" has switched to its plan by then, and warm-up is over.
        settled = slice(args.steps // 2, None)
        theory = simulate(pipe.schedule).bubble_fraction
        print(f"summary: schedule {args.schedule} (running {pipe.schedule.name}) pp={context.num_stages}: median "
              f"{statistics.median(rates[settled]):.0f} tokens/s, rank 0 bubble {statistics.median(bubbles[settled]):.3f} "
              f"(simulated {theory:.3f}), {', '.join(stage.layer_names[0] for stage in pipe.modules.values())} "
              f"first on rank 0", flush=True)
    pipe.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
