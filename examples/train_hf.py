"""Trains a Hugging Face Llama-architecture model, built from a config, pipeline-parallel: annotate, split, train."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import pipecomm


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
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default: the world size)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    context = pipecomm.init(pipeline_size=args.pp)
    torch.manual_seed(0)  # every rank builds the same model
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    # Annotate the model's own submodules: that is all the adapting it needs.
    model.model.embed_tokens.pipeline_stage = 0
    for index, layer in enumerate(model.model.layers):
        layer.pipeline_stage = index * context.num_stages // args.layers
    model.model.norm.pipeline_stage = model.lm_head.pipeline_stage = context.num_stages - 1

    inputs, labels = batch(0, args)
    stage = pipecomm.split(model, context.num_stages, context.stage, example_inputs=(inputs[: args.micro_batch_size],),
                           device=context.device)
    pipe = pipecomm.Pipeline(stage, stage=context.stage, num_stages=context.num_stages, loss_fn=loss_fn,
                             micro_batches=args.micro_batches, schedule=args.schedule, group=context.pipeline_group,
                             data_group=context.data_group, device=context.device)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(args.steps):
        started = time.perf_counter()
        inputs, labels = batch(step, args)
        loss = pipe.step(inputs, target=labels)
        optimizer.step()
        optimizer.zero_grad()
        if context.rank == 0:
            tokens_per_second = inputs.numel() / (time.perf_counter() - started)
            print(f"step {step:3d}  loss {loss.item():.4f}  {tokens_per_second:9.0f} tokens/s", flush=True)
    if context.rank == 0:
        print(f"stage 0 ran {', '.join(stage.layer_names)} on {context.device}")
    pipe.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
