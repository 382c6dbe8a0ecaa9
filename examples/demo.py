"""Demo: a Hugging Face Llama cut by pipecomm.split, trained on 2 ranks against torch's Schedule1F1B, checked, drawn.

The model is built from a config (nothing is downloaded) and annotated on its own submodules. After pipecomm's run,
the same stage modules train from the same weights on torch.distributed.pipelining's Schedule1F1B; the first step's
gradients are checked against plain PyTorch on one process, and the last step is drawn per rank from pipe.trace().
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import pipecomm
from pipecomm.timeline_png import write_timeline_png

NUM_STAGES = 2
WARMUP_STEPS = 3  # not timed: channels connect, torch infers shapes, the allocator warms up


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    micro_batch_size: int
    micro_batches: int
    steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq


# On GPUs the model is large enough that compute, not the host, sets the pace; fp32 with TF32 matmuls on both sides.
# The gradient check runs with exact_kernels instead: then pipecomm and one process agree to rounding.
TOLERANCE = 1e-5  # largest gradient difference, relative to the gradient's largest entry, that counts as exact
SIZES = {
    "cpu": Size(hidden=64, layers=4, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch_size=4, micro_batches=8,
                steps=30),
    "cuda": Size(hidden=2048, layers=8, heads=16, kv_heads=4, vocab=32000, seq=1024, micro_batch_size=4,
                 micro_batches=8, steps=20),
}


def build_model(size: Size) -> LlamaForCausalLM:
    """The same weights on every rank, annotated with the stage each of its own submodules runs on."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=4 * size.hidden,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq, use_cache=False,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    model.model.embed_tokens.pipeline_stage = 0
    for index, layer in enumerate(model.model.layers):
        layer.pipeline_stage = index * NUM_STAGES // size.layers
    model.model.norm.pipeline_stage = model.lm_head.pipeline_stage = NUM_STAGES - 1
    return model


def make_batch(step: int, size: Size, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start: learnable, so the loss visibly falls."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, size.vocab, (size.micro_batches * size.micro_batch_size, 1), generator=generator)
    tokens = (starts + torch.arange(size.seq + 1)) % size.vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
    """pipecomm hands the loss the model's own output object."""
    return lm_loss(output.logits, labels)


class TorchStage(nn.Module):
    """A split stage as torch's PipelineStage takes it: floating tensors between stages, a tensor out of the last.

    torch 2.11's PipelineStage makes every tensor it receives require grad, which only floating tensors can: it cannot
    pass the split's position ids (int64) and causal mask (bool) between stages. These are the same for every
    micro-batch of these unpadded batches, so the first stage computes them once (``constants``), the last stage is
    given them, and only the floating tensors cross: torch moves fewer bytes per micro-batch than pipecomm does.
    """

    def __init__(self, stage: nn.Module, constants: dict[int, torch.Tensor], first: bool, last: bool):
        super().__init__()
        self.stage, self.constants, self.first, self.last = stage, constants, first, last

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.first:
            inputs = list(inputs)
            for position in sorted(self.constants):
                inputs.insert(position, self.constants[position])
        outputs = self.stage(*inputs)
        if self.last:
            return outputs.logits  # pipecomm hands its loss the model's own output object; torch wants a tensor
        return tuple(output for output in outputs if output.is_floating_point())


def boundary_constants(stage: nn.Module, rank: int, size: Size, device: torch.device) -> dict[int, torch.Tensor]:
    """The first stage's non-floating outputs by position, computed there on two different micro-batches, checked
    equal and sent to every rank (see TorchStage)."""
    found: list[dict[int, torch.Tensor] | None] = [None]
    if rank == 0:
        with torch.no_grad():
            seen = [{position: output.cpu() for position, output in enumerate(stage(inputs[:size.micro_batch_size]))
                     if not output.is_floating_point()}
                    for inputs in (make_batch(0, size, device)[0], make_batch(1, size, device)[0])]
        if seen[0].keys() != seen[1].keys() or any(not torch.equal(seen[0][k], seen[1][k]) for k in seen[0]):
            raise RuntimeError("the first stage's non-floating outputs differ between micro-batches: torch's "
                               "PipelineStage cannot carry them, so the comparison would not be the same model")
        found = [seen[0]]
    dist.broadcast_object_list(found, src=0, device=device if device.type == "cuda" else None)
    return {position: tensor.to(device) for position, tensor in found[0].items()}


@contextlib.contextmanager
def exact_kernels():
    """Full fp32 matmuls and the math attention, which reduce in a fixed order: TF32's rounding and the fused
    attention backward's atomics would each make one process and the pipeline differ by more than rounding."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def largest_gradient_difference(stage: nn.Module, model: nn.Module, size: Size, device: torch.device) -> float:
    """``stage``'s gradients after one pipeline step against plain PyTorch on one process accumulating over the same
    micro-batches: the largest absolute difference, relative to each gradient's largest entry."""
    inputs, labels = make_batch(0, size, device)  # the batch of the pipeline's step
    for micro_inputs, micro_labels in zip(inputs.chunk(size.micro_batches), labels.chunk(size.micro_batches)):
        (loss_fn(model(micro_inputs), micro_labels) / size.micro_batches).backward()
    reference = dict(model.named_parameters())
    return max(((param.grad - reference[name].grad).abs().max() / reference[name].grad.abs().max()).item()
               for name, param in stage.named_parameters())


def train(name: str, step: Callable[[torch.Tensor, torch.Tensor], float], parameters, size: Size,
          device: torch.device, show: bool) -> tuple[list[float], float]:
    """``size.steps`` AdamW steps, a progress bar on the rank that ``show``s it; each step's seconds (after a barrier,
    so that no rank starts one ahead) and the last loss."""
    optimizer = torch.optim.AdamW(parameters, lr=3e-3)
    bar = tqdm(total=size.steps * size.tokens_per_step, desc=name, unit="tok", unit_scale=True, disable=not show,
               file=sys.stdout, bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} tokens "
                                           "[{elapsed}, {rate_fmt}{postfix}]")
    seconds, loss = [], float("nan")
    for index in range(size.steps):
        inputs, labels = make_batch(index + 1, size, device)
        dist.barrier()
        started = time.perf_counter()
        loss = step(inputs, labels)  # a float: the step has finished on this rank
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.update(size.tokens_per_step)
    bar.close()
    return seconds, loss


def join(rank: int, device_type: str, store_path: str) -> torch.device:
    """This rank's device, and the process group."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:  # the ranks share the machine's cores: more threads each would only make them contend
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // NUM_STAGES))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.FileStore(store_path, NUM_STAGES),
                            rank=rank, world_size=NUM_STAGES)
    return device


def describe(stage: nn.Module, model: nn.Module, size: Size, device: torch.device, last: bool) -> None:
    layers = [None] * NUM_STAGES
    dist.all_gather_object(layers, stage.layer_names)
    if last:
        parameters = sum(param.numel() for param in model.parameters())
        print(f"pipecomm {pipecomm.__version__}: LlamaForCausalLM from a config ({size.layers} layers, hidden "
              f"{size.hidden}, {parameters / 1e6:.1f} M parameters), annotated and cut by pipecomm.split into "
              f"{NUM_STAGES} stages, one per {'GPU' if device.type == 'cuda' else 'CPU process'}; "
              f"{size.micro_batches} micro-batches of {size.micro_batch_size} x {size.seq} tokens a step")
        for index, names in enumerate(layers):
            print(f"  stage {index}: {', '.join(names)}")


def train_pipecomm(stage: nn.Module, reference: nn.Module, rank: int, size: Size, device: torch.device,
                   schedule: str, trace: str) -> dict:
    """The first step's gradients against ``reference``, then the training run, then the last step's trace."""
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=NUM_STAGES, loss_fn=loss_fn,
                             micro_batches=size.micro_batches, schedule=schedule, device=device,
                             device_timing=device.type == "cuda")  # the GPUs' bubble, not the host's launch time
    inputs, labels = make_batch(0, size, device)
    with exact_kernels():
        pipe.step(inputs, target=labels)
        differences = [None] * NUM_STAGES
        dist.all_gather_object(differences, largest_gradient_difference(stage, reference, size, device))
    for param in pipe.parameters():
        param.grad = None
    seconds, loss = train(f"pipecomm {schedule}", lambda inputs, labels: pipe.step(inputs, target=labels).item(),
                          pipe.parameters(), size, device, show=rank == NUM_STAGES - 1)
    pipe.trace(trace)
    bubbles = [None] * NUM_STAGES
    dist.all_gather_object(bubbles, pipe.bubble_fraction())
    simulated = pipecomm.simulate(pipe.schedule).bubble_fraction
    pipe.close()
    return dict(seconds=seconds, loss=loss, worst=max(differences), bubbles=bubbles, simulated=simulated)


def train_torch(stage: nn.Module, rank: int, size: Size, device: torch.device) -> dict:
    last = rank == NUM_STAGES - 1
    module = TorchStage(stage, boundary_constants(stage, rank, size, device), first=rank == 0, last=last)
    schedule = Schedule1F1B(PipelineStage(module, rank, NUM_STAGES, device), size.micro_batches, loss_fn=lm_loss)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        if not last:
            schedule.step(inputs)
            return float("nan")
        losses: list[torch.Tensor] = []
        schedule.step(target=labels, losses=losses)
        return torch.stack(losses).mean().item()

    seconds, loss = train("torch Schedule1F1B", step, module.parameters(), size, device, show=last)
    return dict(seconds=seconds, loss=loss)


def report(ours: dict, theirs: dict, size: Size, schedule: str, device: torch.device, out: str) -> None:
    ours_step, theirs_step = (statistics.median(run["seconds"][WARMUP_STEPS:]) for run in (ours, theirs))
    print(f"step time, median of steps {WARMUP_STEPS + 1}-{size.steps}: pipecomm {schedule} {ours_step * 1e3:.1f} ms "
          f"({size.tokens_per_step / ours_step:,.0f} tokens/s), torch Schedule1F1B {theirs_step * 1e3:.1f} ms: "
          f"pipecomm runs at {theirs_step / ours_step:.2f}x torch's speed; last loss {ours['loss']:.4f} against "
          f"{theirs['loss']:.4f}")
    print(f"gradients of the first step against one process (plain PyTorch, the same micro-batches): largest "
          f"difference {ours['worst']:.1e} of the gradient's largest entry -> "
          f"{'exact' if ours['worst'] <= TOLERANCE else 'MISMATCH'}")
    trace, picture = str(Path(out) / "trace.json"), str(Path(out) / "timeline.png")
    notes = [f"bubble {bubble:.0%}" for bubble in ours["bubbles"]]
    write_timeline_png(trace, picture, f"pipecomm {schedule}, {NUM_STAGES} ranks, {size.micro_batches} micro-batches: "
                       f"step {size.steps} on {device.type}; simulated bubble {ours['simulated']:.0%}", notes)
    print(f"bubble of the last step: {', '.join(f'rank {index} {note}' for index, note in enumerate(notes))} "
          f"({schedule}'s simulated: {ours['simulated']:.0%})")
    print(f"one step's timeline per rank: {picture}; its Chrome trace: {trace} (chrome://tracing or ui.perfetto.dev)")


def run(rank: int, store_path: str, device_type: str, out: str, schedule: str, steps: int | None) -> None:
    size = SIZES[device_type] if steps is None else dataclasses.replace(SIZES[device_type], steps=steps)
    device = join(rank, device_type, store_path)
    last = rank == NUM_STAGES - 1
    model = build_model(size)
    reference = copy.deepcopy(model).to(device)
    example, _ = make_batch(0, size, torch.device("cpu"))  # where the model is while it is captured
    stage = pipecomm.split(model, NUM_STAGES, rank, example_inputs=(example[:size.micro_batch_size],), device=device)
    initial = {name: value.clone() for name, value in stage.state_dict().items()}
    describe(stage, reference, size, device, last)
    ours = train_pipecomm(stage, reference, rank, size, device, schedule, str(Path(out) / "trace.json"))
    del reference
    stage.load_state_dict(initial)  # torch trains the same stage module from the same weights
    theirs = train_torch(stage, rank, size, device)
    dist.barrier()  # rank 0 has written the trace
    if last:
        report(ours, theirs, size, schedule, device, out)
    dist.destroy_process_group()
    if ours["worst"] > TOLERANCE:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1", "zb-h2"])
    parser.add_argument("--out", default="build/demo", help="where the picture and the trace go")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each library (default: by device)")
    args = parser.parse_args()
    if args.steps is not None and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} untimed warm-up steps")
    on_gpus = pipecomm.cuda_built() and torch.cuda.device_count() >= NUM_STAGES
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # CPU ranks are forked, inheriting the imports (seconds of CPU each on a small machine); a process that asked
    # the driver for its GPUs cannot fork CUDA users, so GPU ranks start from a clean fork server.
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(run, args=(os.path.join(scratch, "store"), "cuda" if on_gpus else "cpu", args.out,
                                      args.schedule, args.steps),
                           nprocs=NUM_STAGES, start_method="forkserver" if on_gpus else "fork")


if __name__ == "__main__":
    main()
