"""GPU benchmark: end-to-end pipeline training step, pipecomm's schedules vs torch.distributed.pipelining, on p GPUs.

Spawns --ranks p ranks for each config (default 2; rank r on cuda:r, one NCCL process group), which run its rows
in turn, torch's first; a config's processes are its own, so that no earlier config's rows weigh on its memory
columns. The model is a GPT
block stack in bf16 (pre-norm causal self-attention through scaled_dot_product_attention, then a 4x
MLP), --layers L (default 8), split into p stages of L/p layers (interleaved schedules: 2p
chunks, rank r holds chunks r and r + p; zb-v, torch's ZBVZeroBubble and DualPipeV: 2p chunks in a V, rank r
holds chunks r and 2p - 1 - r). The batch is micro_batch_size * micro_batches sequences;
the loss is the MSE against a random target. The llama config is a Hugging Face Llama built from a config instead
(bench/llama_stage.py; d = 2048, heads d / 128, key-value heads d / 256, a 4x MLP, vocabulary 8192, --layers decoder
layers, issue 33's shape): the first stage also holds the embedding and takes token ids, the last the final norm and
LM head, and the loss is the next-token cross entropy. Each layer is initialised from its own seed, so every schedule
trains the same model on the same data (the loss column must agree across rows).

Per config (d / seq / micro-batch size / micro-batches; compute, medium and overhead are the three of
../shared/GPU-BASELINES.md) and
schedule it reports the median step time (CUDA events, after warm-up; the slower rank), the
efficiency = one stage's pure compute time / step time, where the compute time is forward + backward
of one stage's layers on one micro-batch on one GPU without a pipeline, times micro_batches (the
slowest stage), the ideal 1F1B efficiency m / (m + p - 1), and each rank's peak memory
(torch.cuda.max_memory_allocated, reset before each schedule; model weights included; for CUDA-graph rows, after
the captures, plus the free part of the graphs' private memory pools, which their replays reuse), over the whole run
and, as "steady", over the timed steps alone (a capture's moment in the warm-up left out).

Schedules: pipecomm gpipe, 1f1b, interleaved-1f1b (v=2), zb-h1, zb-v, zb-h2, auto, and 1f1b, interleaved-1f1b,
zb-h1 and zb-v with CUDA graphs (Pipeline(cuda_graphs=True), rows "+graphs"), 1f1b eager (cuda_graphs=False, row
"1f1b+eager"; a plain row is the default, cuda_graphs="auto", graphs where they pay), and torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (v=2), ScheduleInterleavedZeroBubble (v=2),
ScheduleZBVZeroBubble and ScheduleDualPipeV (V) through PipelineStage, all in the same run. A schedule that
fails, or a torch schedule this torch lacks, is reported as an error string. "auto" (Pipeline(schedule="auto"))
runs zb-h1 for its measured steps before timing starts, whatever --warmup says, and reports the schedule it
planned and the F, I and W it planned for; its theory column is the plan's simulated bubble. Any pipecomm schedule
may also be named with "+eager", "+graphs", "+offload" (Pipeline(offload=True): "zb-h2+offload") or "+norms"
(Pipeline(recompute=...) picking the LayerNorm and RMSNorm layers: "1f1b+norms"), several in any order.

Targets, against torch 1F1B in the same run: compute: pipecomm 1f1b >= 1.0x speed at <= 0.85x peak memory;
the best pipecomm schedule >= 1.08x; the best at <= torch 1F1B's peak memory (the largest rank's; zb-h2, which
may hold twice 1F1B's activations, reported apart) >= 1.15x at p = 2, >= 1.35x at p >= 4; overhead: 1f1b
>= 1.25x; and per config, each pipecomm schedule faster than torch's of the same name (gpipe, 1f1b,
interleaved-1f1b, zb-v against GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble).

--smoke runs it on CPU (gloo, pipecomm's shared-memory channels, fp32, d=32, seq=16) to check the
control flow; its numbers mean nothing. --cpu is a real CPU measurement (gloo, fp32, one thread per
rank, d=128, seq=64, micro-batch size 2: a step of about 200 ms on two cores); both give the Llama a vocabulary of
128. --transport
shm,dist runs each pipecomm schedule once per channel backend (rows "1f1b@dist", ...). On CPU the
parent also computes the loss in one process without a pipeline, and a schedule whose loss differs
from it fails the run.

--share-gpu puts every rank on cuda:0 (gloo; pipecomm over CUDA IPC), for one GPU; torch's rows are errors there (its
pipelining needs send/recv of CUDA tensors, which NCCL gives only one rank per GPU and gloo not at all).
--memory-history DIR records the allocator's events over each pipecomm row's steps from its first (where
cuda_graphs=True captures), a pickle per rank, for scripts/peak_memory.py (what is live at the peak, by allocation
site); it slows those rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipecomm.schedules.auto_schedule import MEASURED_STEPS, WARMUP_STEPS
from pipecomm.schedules.schedule import looped_placement, make_schedule, v_placement
from pipecomm.schedules.simulation import simulate

from _common import RankFailure, environment, print_environment, print_table, spawn_ranks, start_rank, write_json
from llama_stage import LlamaStage, llama_config, token_batch, token_loss

VIRTUAL = 2  # chunks per rank for the interleaved schedules

GRAPHS = "+graphs"  # suffix: the same schedule with Pipeline(cuda_graphs=True)
EAGER = "+eager"  # suffix: with Pipeline(cuda_graphs=False); a plain row is the default, cuda_graphs="auto"
OFFLOAD = "+offload"  # suffix: with Pipeline(offload=True), activations to host memory where the plan says
NORMS = "+norms"  # suffix: with Pipeline(recompute=...) picking the normalization layers (selective recomputation)
SUFFIXES = (GRAPHS, EAGER, OFFLOAD, NORMS)
TRANSPORT = "@"  # "1f1b@dist": the schedule with Pipeline(transport="dist") (--transport)
TRANSPORTS = ("auto", "shm", "dist", "ipc")
AUTO = "auto"  # Pipeline(schedule="auto"): zb-h1 while it measures F, I and W, then its plan
PIPECOMM_SCHEDULES = ["gpipe", "1f1b", "1f1b" + EAGER, "interleaved-1f1b", "zb-h1", "zb-v", "zb-h2", AUTO,
                      "1f1b" + GRAPHS,
                      "interleaved-1f1b" + GRAPHS, "zb-h1" + GRAPHS, "zb-v" + GRAPHS]
# torch rows whose schedule pipecomm also generates, for the theoretical bubble (torch's zero-bubble
# schedules are different ones).
SAME_SCHEDULE = {"torch GPipe": "gpipe", "torch 1F1B": "1f1b", "torch Interleaved1F1B": "interleaved-1f1b"}
# Where a row's stages sit: "looped" one stage per rank, "interleaved" VIRTUAL looped stages per rank (stage s on
# rank s % p), "v" two per rank in zb-v's V (rank r holds r and 2p - 1 - r).
TORCH_SCHEDULES = {  # row name -> (class name in torch.distributed.pipelining, layout)
    "torch GPipe": ("ScheduleGPipe", "looped"),
    "torch 1F1B": ("Schedule1F1B", "looped"),
    "torch Interleaved1F1B": ("ScheduleInterleaved1F1B", "interleaved"),
    "torch InterleavedZB": ("ScheduleInterleavedZeroBubble", "interleaved"),
    "torch ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "torch DualPipeV": ("ScheduleDualPipeV", "v"),
}
BASELINE = "torch 1F1B"
# The project's targets, against torch 1F1B in the same run.
TARGET_COMPUTE_SPEED, TARGET_COMPUTE_MEMORY, TARGET_BEST_SPEED, TARGET_OVERHEAD_SPEED = 1.0, 0.85, 1.08, 1.25
# The best pipecomm schedule at no more than torch 1F1B's peak memory, by pipeline depth (ranks < 4, ranks >= 4).
TARGET_BEST_AT_MEMORY_SPEED = {2: 1.15, 4: 1.35}
UNBOUNDED_MEMORY = "zb-h2"  # holds up to 2x 1F1B's activations: kept out of the memory-bound target, reported apart
# pipecomm schedule -> torch's schedule of the same name, which it should beat.
SAME_NAME = {"gpipe": "torch GPipe", "1f1b": "torch 1F1B", "interleaved-1f1b": "torch Interleaved1F1B",
             "zb-v": "torch ZBVZeroBubble"}
REFERENCE_TOLERANCE = 1e-4  # relative, fp32 on CPU: a row's loss against the one-process loss

def columns(ranks: int) -> list[str]:
    return (["schedule", "step_ms", "wall_ms", "eff", "ideal", "bubble", "theory", "speed_vs_torch_1f1b"]
            + [f"mem{rank}_GB" for rank in range(ranks)] + ["mem/torch_1f1b", "steady/torch_1f1b", "rank_bubble",
                                                               "loss", "error"])


@dataclass(frozen=True)
class Config:
    name: str
    hidden: int
    seq: int
    micro_batch_size: int
    micro_batches: int
    model: str = "gpt"  # "gpt": GPT blocks on hidden states; "llama": a Hugging Face Llama on token ids
    vocab: int = 0  # llama's

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 128) if self.hidden >= 128 else max(1, self.hidden // 16)


CONFIGS = {
    "compute": Config("compute", 2048, 1024, 4, 8),
    "medium": Config("medium", 1024, 512, 2, 16),
    "overhead": Config("overhead", 512, 128, 1, 32),
    "llama": Config("llama", 2048, 1024, 2, 8, model="llama", vocab=8192),
}


# mode -> (hidden, seq, micro-batch size) replacing every config's own on CPU, micro-batch counts kept:
# toy sizes that only run the control flow, and sizes where compute, not Python, fills a CPU step.
CPU_SHAPES = {"smoke": (32, 16, 2), "cpu": (128, 64, 2)}
CPU_VOCAB = 128  # llama's on CPU: its LM head and logits would otherwise outweigh the toy layers


def config_named(name: str, mode: str) -> Config:
    """A config by name for a mode (gpu, cpu, smoke); "compute-m16" is compute with 16 micro-batches."""
    base, _, micro_batches = name.partition("-m")
    config = CONFIGS[base]
    if micro_batches:
        config = replace(config, name=name, micro_batches=int(micro_batches))
    if mode in CPU_SHAPES:
        hidden, seq, micro_batch_size = CPU_SHAPES[mode]
        config = replace(config, hidden=hidden, seq=seq, micro_batch_size=micro_batch_size,
                         vocab=CPU_VOCAB if config.model == "llama" else config.vocab)
    return config


# ---------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    """Pre-norm GPT block: causal self-attention (scaled_dot_product_attention), then a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_attention = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.projection = nn.Linear(hidden, hidden)
        self.norm_mlp = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(self.norm_attention(x)).view(batch, seq, 3, self.heads, hidden // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        x = x + self.projection(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.norm_mlp(x)), approximate="tanh"))


def build_chunk(layers: range, config: Config, device: torch.device, dtype: torch.dtype,
                last: bool = False) -> nn.Module:
    """Layers of the stack; layer i is initialised from seed i, so every split holds the same model. A Llama chunk
    also holds the embedding when it starts the stack, and the final norm and LM head when it is the ``last``."""
    if config.model == "llama":
        # num_hidden_layers only has to cover the layers' indexes: no layer reads it.
        llama = llama_config(config.hidden, layers.stop, config.seq, config.vocab)
        with torch.device(device):
            return LlamaStage(llama, layers, first=layers.start == 0, last=last).to(dtype)
    blocks = []
    for layer in layers:
        torch.manual_seed(1000 + layer)
        with torch.device(device):
            blocks.append(Block(config.hidden, config.heads))
    return nn.Sequential(*blocks).to(dtype)


def base_schedule(row_name: str) -> str:
    """A pipecomm row's schedule name without its suffixes (+graphs, +eager, +offload, +norms) and @transport."""
    return row_name.partition(TRANSPORT)[0].partition("+")[0]


def row_suffixes(row_name: str) -> set[str]:
    """The suffixes a row's name carries, in any order: "zb-v+norms+graphs" -> {"+norms", "+graphs"}."""
    return {"+" + word for word in row_name.partition(TRANSPORT)[0].split("+")[1:]}


def is_normalization(module: nn.Module) -> bool:
    """The layers +norms recomputes: LayerNorm, RMSNorm and their Hugging Face kin (LlamaRMSNorm), by class name."""
    return type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def layout_of(row_name: str) -> str:
    """Where a row's stages sit (see TORCH_SCHEDULES)."""
    if row_name in TORCH_SCHEDULES:
        return TORCH_SCHEDULES[row_name][1]
    schedule = base_schedule(row_name)
    return "interleaved" if schedule.startswith("interleaved") else "v" if schedule == "zb-v" else "looped"


def placement(layout: str, ranks: int) -> tuple[int, ...]:
    """Stage -> rank for a layout (see TORCH_SCHEDULES)."""
    if layout == "v":
        return v_placement(ranks)
    return looped_placement(ranks, ranks * (VIRTUAL if layout == "interleaved" else 1))


def chunk_layers(stage_ranks: tuple[int, ...], rank: int, layers: int) -> list[tuple[int, range]]:
    """(stage index, layers) of each stage that rank holds under stage_ranks (stage -> rank), in stage order;
    every stage gets layers / stages consecutive layers."""
    per_stage = layers // len(stage_ranks)
    return [(stage, range(stage * per_stage, (stage + 1) * per_stage))
            for stage, holder in enumerate(stage_ranks) if holder == rank]


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


def loss_for(config: Config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The GPT's MSE against a random target; the Llama's next-token cross entropy."""
    return token_loss if config.model == "llama" else mse_loss


def make_batch(config: Config, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs and targets on every rank, in every schedule and in the one-process reference: hidden states
    and a target of their shape for the GPT, token ids and the next tokens for the Llama."""
    if config.model == "llama":
        return token_batch(config.micro_batch_size * config.micro_batches, config.seq, config.vocab, device)
    generator = torch.Generator(device).manual_seed(7)
    shape = (config.micro_batch_size * config.micro_batches, config.seq, config.hidden)
    inputs = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    target = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return inputs.to(dtype), target.to(dtype)


def reference_loss(config: Config, layers: int) -> float:
    """The step's loss in one process without a pipeline: the mean of the micro-batches' losses."""
    model = build_chunk(range(layers), config, torch.device("cpu"), torch.float32, last=True)
    inputs, target = make_batch(config, torch.device("cpu"), torch.float32)
    loss_fn = loss_for(config)
    with torch.no_grad():
        losses = [loss_fn(model(micro_inputs), micro_target) for micro_inputs, micro_target
                  in zip(inputs.chunk(config.micro_batches), target.chunk(config.micro_batches))]
    return float(torch.stack(losses).mean())


# ---------------------------------------------------------------------------------------------
# One rank


class Rank:
    def __init__(self, rank: int, args: argparse.Namespace, store: Any):
        self.rank = rank
        self.args = args
        self.store = store
        self.cuda = args.mode == "gpu"
        self.device = torch.device("cuda", 0 if args.share_gpu else rank) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self._barriers = 0
        self.pools_left: dict[tuple, tuple[int, int]] = {}  # graph pools still reserved when the current row began
        self.warm_up_peak = 0  # bytes, the last time_steps' warm-up's peak

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[e2e] {message}", file=sys.stderr, flush=True)

    def barrier(self) -> None:
        """Through the store, not the process group: still works after a schedule failed mid-step."""
        self._barriers += 1
        self.store.set(f"e2e/barrier/{self._barriers}/{self.rank}", "1")
        self.store.wait([f"e2e/barrier/{self._barriers}/{rank}" for rank in range(self.args.ranks) if rank != self.rank])

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self, earlier: int = 0) -> float | None:
        """Peak allocated bytes since the last reset plus what the CUDA graphs of this row hold reserved for their
        replays in their private pools (the free part: what is allocated there counts already); or ``earlier``, a
        peak allocated before the reset (a warm-up's, with the captures in it), if higher.

        Captured graphs reuse their pools' memory at every replay, but the tensors that occupied it during capture
        were freed, so max_memory_allocated alone would not see it after the capture; during it, they count as
        allocated, so a peak then is not lifted by the pools' free part at the end (which the captures' freed tensors
        make). Pools that were there when the row began are an earlier row's (``pools_left``), not this one's.
        """
        if not self.cuda:
            return None
        graph_pools = sum(free for pool, (_, free) in self.graph_pools().items() if pool not in self.pools_left)
        return max(torch.cuda.max_memory_allocated(self.device) + graph_pools, earlier) / 1e9

    def reserved_gb(self) -> float | None:
        """The caching allocator's peak reserved bytes since the last reset, graph pools included: eager rows' and
        graphed rows' footprints alike, fragmentation and cached blocks counted on both."""
        return torch.cuda.max_memory_reserved(self.device) / 1e9 if self.cuda else None

    def graph_pools(self) -> dict[tuple, tuple[int, int]]:
        """Private (CUDA-graph) pool id -> (its reserved bytes, those of them not allocated), on this rank's device."""
        pools: dict[tuple, tuple[int, int]] = {}
        for segment in torch.cuda.memory_snapshot():
            pool = tuple(segment["segment_pool_id"])
            if segment["device"] == self.device.index and pool != (0, 0):
                reserved, free = pools.get(pool, (0, 0))
                size = segment["total_size"]
                pools[pool] = (reserved + size, free + size - segment["allocated_size"])
        return pools

    def batch(self, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(config, self.device, self.dtype)

    # -- timing --------------------------------------------------------------------------------

    def time_steps(self, step: Callable[[], object], warmup: int, steps: int) -> tuple[list[float], float]:
        """Per-step ms (CUDA events on the current stream; host clock on CPU) and wall ms per step. The peak memory
        of the warm-up (a CUDA-graph capture's, say) is kept in ``warm_up_peak`` and the count starts afresh."""
        for _ in range(warmup):
            step()
        self.synchronize()
        if self.cuda:
            self.warm_up_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.barrier()
        samples = []
        wall_start = time.perf_counter()
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)]
            for start, end in events:
                start.record()
                step()
                end.record()
            self.synchronize()
            samples = [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(steps):
                start = time.perf_counter()
                step()
                samples.append((time.perf_counter() - start) * 1e3)
        wall_ms = (time.perf_counter() - wall_start) * 1e3 / steps
        return samples, wall_ms

    @contextlib.contextmanager
    def memory_history(self, row: str, enabled: bool):
        """With --memory-history: the caching allocator's events (and their Python stacks) over the row's steps,
        written to DIR/<row>-rank<r>.pickle for torch's memory_viz or scripts/peak_memory.py."""
        if not (enabled and self.cuda and self.args.memory_history):
            yield
            return
        torch.cuda.memory._record_memory_history(max_entries=300_000, context="alloc", stacks="python")
        try:
            yield
        finally:
            folder = Path(self.args.memory_history)
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(folder / f"{row}-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def compute_ms(self, config: Config) -> tuple[float, dict[str, float] | None]:
        """One stage (this rank's layers), forward + backward of one micro-batch, no pipeline: median ms, and
        the stage's 1F1B memory floor."""
        [(stage, layers)] = chunk_layers(placement("looped", self.args.ranks), self.rank, self.args.layers)
        last = stage == self.args.ranks - 1
        module = build_chunk(layers, config, self.device, self.dtype, last=last)
        inputs, target = self.batch(config)
        micro_target = target[: config.micro_batch_size].clone()
        # What a stage receives and sends on: the batch's own inputs into stage 0 (the Llama's token ids), hidden
        # states between stages; a later stage's input needs its gradient, which it sends back in a pipeline.
        hidden = (config.micro_batch_size, config.seq, config.hidden)
        micro_inputs = (inputs[: config.micro_batch_size].clone() if stage == 0
                        else torch.randn(hidden, device=self.device, dtype=self.dtype, requires_grad=True))
        output_grad = torch.randn(hidden, device=self.device, dtype=self.dtype)
        loss_fn = loss_for(config)

        def forward_backward() -> None:
            output = module(micro_inputs)
            if last:
                (loss_fn(output, micro_target) / config.micro_batches).backward()
            else:
                output.backward(output_grad)
            micro_inputs.grad = None

        warmup, iters = (1, 3) if self.args.mode == "smoke" else (self.args.warmup + 2, max(self.args.steps, 10))
        forward_backward()
        samples, _ = self.time_steps(forward_backward, warmup, iters)
        memory = self.stage_memory(module, micro_inputs, forward_backward, in_flight=min(self.args.ranks - stage,
                                                                                          config.micro_batches))
        del module
        self.release()
        return statistics.median(samples), memory

    def stage_memory(self, module: nn.Module, micro_inputs: torch.Tensor, forward_backward: Callable[[], None],
                     in_flight: int) -> dict[str, float] | None:
        """What 1F1B cannot go below on this rank, measured on the stage alone (its gradients already exist).

        base = weights + gradients + the batch; saved = what one micro-batch's forward leaves for its
        backward; transient = how far one backward rises above that. 1F1B holds in_flight micro-batches
        (p - rank) at its peak, so floor = base + in_flight * saved + transient.
        """
        if not self.cuda:
            return None
        gb = 1e-9
        self.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        output = module(micro_inputs)
        saved = torch.cuda.memory_allocated(self.device) - base
        del output
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        forward_backward()
        self.synchronize()
        transient = torch.cuda.max_memory_allocated(self.device) - base - saved
        return {"base_gb": base * gb, "saved_gb": saved * gb, "transient_gb": transient * gb, "in_flight": in_flight,
                "floor_1f1b_gb": (base + in_flight * saved + transient) * gb}

    # -- schedules -----------------------------------------------------------------------------

    def build_chunks(self, config: Config, held: list[tuple[int, range]], num_stages: int) -> list[nn.Module]:
        """This rank's chunks, for chunk_layers' (stage, layers)."""
        return [build_chunk(layers, config, self.device, self.dtype, last=stage == num_stages - 1)
                for stage, layers in held]

    def pipecomm_runner(self, config: Config, schedule: str) -> tuple[Callable[[], torch.Tensor], Callable[[], None], Any]:
        import pipecomm

        schedule, _, backend = schedule.partition(TRANSPORT)
        suffixes = row_suffixes(schedule)
        cuda_graphs = True if GRAPHS in suffixes else False if EAGER in suffixes else "auto"
        offload = OFFLOAD in suffixes
        recompute = is_normalization if NORMS in suffixes else False
        schedule = base_schedule(schedule)
        stage_ranks = placement(layout_of(schedule), self.args.ranks)
        held = chunk_layers(stage_ranks, self.rank, self.args.layers)
        modules = self.build_chunks(config, held, len(stage_ranks))
        stages = [stage for stage, _ in held]
        pipe = pipecomm.Pipeline(
            modules if len(modules) > 1 else modules[0],
            stage=stages if len(stages) > 1 else stages[0],
            num_stages=len(stage_ranks),
            loss_fn=loss_for(config),
            micro_batches=config.micro_batches,
            schedule=schedule,
            device=self.device,
            transport=backend or ("ipc" if self.args.share_gpu else "auto"),
            timeout=float(self.args.timeout),
            cuda_graphs=cuda_graphs,
            offload=offload,
            recompute=recompute,
            device_timing=bool(self.args.trace) and self.cuda,
        )
        inputs, target = self.batch(config)

        def step() -> torch.Tensor:
            loss = pipe.step(inputs, target=target)
            for module in modules:
                module.zero_grad(set_to_none=True)
            return loss

        return step, pipe.close, pipe

    def torch_runner(self, config: Config, name: str) -> tuple[Callable[[], torch.Tensor | None], Callable[[], None], None]:
        import torch.distributed.pipelining as pipelining

        if self.args.share_gpu:
            # Measured (H200, torch 2.11): gloo's send of a CUDA tensor aborts the process ("writev: Bad address").
            raise RuntimeError("torch's pipelining cannot run two ranks on one GPU: NCCL takes one rank per GPU and "
                               "gloo sends no CUDA tensors")
        class_name, layout = TORCH_SCHEDULES[name]
        schedule_class = getattr(pipelining, class_name, None)
        if schedule_class is None:  # the newer schedules are missing from older torch releases
            raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.pipelining.{class_name}")
        stage_ranks = placement(layout, self.args.ranks)
        held = chunk_layers(stage_ranks, self.rank, self.args.layers)
        modules = self.build_chunks(config, held, len(stage_ranks))
        stages = [pipelining.PipelineStage(module, stage, len(stage_ranks), self.device)
                  for module, (stage, _) in zip(modules, held)]
        schedule = schedule_class(stages if len(stages) > 1 else stages[0], config.micro_batches,
                                  loss_fn=loss_for(config))
        inputs, target = self.batch(config)
        first = any(stage == 0 for stage, _ in held)
        last = any(stage == len(stage_ranks) - 1 for stage, _ in held)
        extra = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}

        def step() -> torch.Tensor | None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if first else ()
            if last:
                schedule.step(*args, target=target, losses=losses, **extra)
            else:
                schedule.step(*args, **extra)
            for module in modules:
                module.zero_grad(set_to_none=True)
            # loss_fn gives each micro-batch's mean; the step's loss is their mean, as pipecomm returns.
            return torch.stack([loss.detach().float() for loss in losses]).mean() if losses else None

        return step, lambda: None, None

    def run_until_settled(self, step: Callable[[], torch.Tensor], pipe: Any, result: dict[str, Any]) -> torch.Tensor:
        """schedule="auto" after its first step: the rest of its measured steps (zb-h1) and its trials of the plan and
        1f1b, then one untimed step of the schedule it settled on, whose loss it returns, so that the row checks,
        times and (peak memory) measures that schedule alone. Notes the schedule and the trials' step times."""
        most = 3 * (WARMUP_STEPS + MEASURED_STEPS)  # the starting schedule, the plan and 1f1b
        for _ in range(most - 1):
            if pipe.auto_step_times is not None:
                break
            step()
        if pipe.auto_step_times is None:
            raise RuntimeError(f"auto has not settled on a schedule after {most} steps")
        result["auto_step_times_ms"] = [(name, seconds * 1e3) for name, seconds in pipe.auto_step_times]
        result["planned_schedule"] = pipe.schedule.name
        result["planned_costs_ms"] = {kind: seconds * 1e3 for kind, seconds in pipe.planned_costs.items()}
        result["planned_theory"] = simulate(pipe.schedule).bubble_fraction
        if self.cuda:
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        return step()

    def run_schedule(self, config: Config, name: str) -> dict[str, Any]:
        result: dict[str, Any] = {"config": config.name, "schedule": name, "rank": self.rank}
        self.release()
        if self.cuda:
            # An earlier row's graphs outliving its Pipeline: reported, and kept out of this row's peak.
            self.pools_left = self.graph_pools()
            if self.pools_left:
                result["pools_left_gb"] = sum(reserved for reserved, _ in self.pools_left.values()) / 1e9
        close: Callable[[], None] = lambda: None  # noqa: E731
        try:
            # pipe: the pipecomm Pipeline being timed (None for torch's schedules), for --trace
            if name in TORCH_SCHEDULES:
                step, close, pipe = self.torch_runner(config, name)
            else:
                step, close, pipe = self.pipecomm_runner(config, name)
            with self.memory_history(f"{config.name}-{name}", enabled=pipe is not None):
                loss = step()  # first step: connects, infers shapes (cuda_graphs=True captures); not timed
                if base_schedule(name) == AUTO:
                    loss = self.run_until_settled(step, pipe, result)
                result["loss"] = float(loss) if loss is not None else None
                self.synchronize()
                samples, wall_ms = self.time_steps(step, self.args.warmup, self.args.steps)
            result.update(step_ms=samples, wall_ms=wall_ms, peak_gb=self.peak_gb(self.warm_up_peak),
                          steady_gb=self.peak_gb(), steady_reserved_gb=self.reserved_gb())
            if pipe is not None:
                result["cuda_graph_states"] = pipe.cuda_graph_states
            if self.args.trace and pipe is not None:
                # The last timed step, at the GPU's times (device_timing) when on GPUs.
                pipe.trace(str(Path(self.args.trace) / f"{config.name}-{name}.json"))
                result["rank_bubble"] = pipe.bubble_fraction()
        except Exception as error:
            message = f"{type(error).__name__}: {error}".splitlines()[0][:160]
            result["error"] = message
            result["traceback"] = traceback.format_exc()
            print(f"[e2e] rank {self.rank} {config.name} {name}: {message}", file=sys.stderr, flush=True)
        finally:
            with contextlib.suppress(Exception):
                close()
            step = close = pipe = None  # type: ignore[assignment]
            self.release()
        self.barrier()
        return result


def run_rank(rank: int, world_size: int, store_port: int, report: Callable[[Any], None],
             config: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**config)
    device, store = start_rank(rank, world_size, store_port, args.mode != "gpu", args.timeout, share_gpu=args.share_gpu)
    me = Rank(rank, args, store)
    env = environment(device) if rank == 0 else None
    if env is not None:
        env["ranks"] = f"{world_size} processes, rank r on {'cuda:0' if args.share_gpu else 'cuda:r' if me.cuda else 'cpu'}"
        env["process_group"] = dist.get_backend()
        if me.cuda:
            env["cards"] = [torch.cuda.get_device_properties(i).name for i in range(1 if args.share_gpu else world_size)]
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
        if not me.cuda:
            env["dtype"] = f"float32 ({args.mode}), {torch.get_num_threads()} thread(s) per rank"
    me.barrier()
    for name in args.config_list:
        config = config_named(name, args.mode)
        me.log(f"{name}: d={config.hidden} seq={config.seq} micro-batch {config.micro_batch_size} x "
               f"{config.micro_batches}: one stage's compute")
        compute, memory = me.compute_ms(config)
        report({"kind": "compute", "config": name, "rank": rank, "ms_per_micro_batch": compute,
                "memory": memory, "shape": asdict(config)})
        me.barrier()
        # torch's rows first: the baseline then runs in processes no pipecomm row has touched (a graph pool that
        # outlived its Pipeline once lifted torch 1F1B's peak from 3.40 to 4.22 GB); the table keeps the list's order.
        for schedule in sorted(args.schedule_list, key=lambda row: row not in TORCH_SCHEDULES):
            me.log(f"{name}: {schedule}")
            report({"kind": "schedule", **me.run_schedule(config, schedule)})
    return {"env": env}


# ---------------------------------------------------------------------------------------------
# Parent: spawn, collect, report


class Collector:
    """Reports from the ranks, kept as they arrive so a run that dies still prints what it measured."""

    def __init__(self) -> None:
        self.compute: dict[tuple[str, int], dict[str, Any]] = {}
        self.schedules: dict[tuple[str, str, int], dict[str, Any]] = {}

    def __call__(self, rank: int, payload: dict[str, Any]) -> None:
        if payload["kind"] == "compute":
            self.compute[(payload["config"], rank)] = payload
        else:
            self.schedules[(payload["config"], payload["schedule"], rank)] = payload


def rows_for(args: argparse.Namespace, collected: Collector, config_name: str) -> tuple[list[dict[str, Any]], dict]:
    config = config_named(config_name, args.mode)
    m, p = config.micro_batches, args.ranks
    per_rank_compute = [collected.compute.get((config_name, rank), {}).get("ms_per_micro_batch")
                        for rank in range(args.ranks)]
    known = [value for value in per_rank_compute if value is not None]
    compute_ms = max(known) * m if known else None  # the slower stage bounds the pipeline
    memory = [collected.compute.get((config_name, rank), {}).get("memory") for rank in range(args.ranks)]
    summary = {"config": config_name, "shape": asdict(config), "ranks": p, "ideal_1f1b": m / (m + p - 1),
               "compute_ms_per_micro_batch": per_rank_compute, "stage_compute_ms": compute_ms,
               "stage_memory": memory}
    rows = []
    for schedule in args.schedule_list:
        per_rank = [collected.schedules.get((config_name, schedule, rank)) for rank in range(args.ranks)]
        errors = [f"rank {rank}: {r['error']}" for rank, r in enumerate(per_rank) if r and r.get("error")]
        missing = [rank for rank, r in enumerate(per_rank) if r is None]
        row: dict[str, Any] = {"config": config_name, "schedule": schedule, "ideal": m / (m + p - 1),
                               "theory": theoretical_bubble(schedule, p, m)}
        if missing:
            errors.append(f"no result from rank {missing}")
        errors.sort(key=lambda text: "peer" in text)  # a rank's own failure first, its peer's echo of it after
        if errors:
            # The table gets the first error, short; the JSON keeps every rank's (and tracebacks).
            row["error"] = errors[0] if len(errors[0]) <= 90 else errors[0][:87] + "..."
            row["errors"] = errors
        else:
            medians = [statistics.median(r["step_ms"]) for r in per_rank]
            row["step_ms"] = max(medians)  # the step ends when the slower rank is done
            row["step_ms_per_rank"] = medians
            row["wall_ms"] = max(r["wall_ms"] for r in per_rank)
            row["eff"] = compute_ms / row["step_ms"] if compute_ms else None
            row["bubble"] = 1 - row["eff"] if row["eff"] is not None else None
            for rank, r in enumerate(per_rank):
                row[f"mem{rank}_GB"] = r.get("peak_gb")
                row[f"steady{rank}_GB"] = r.get("steady_gb")
                row[f"steady_reserved{rank}_GB"] = r.get("steady_reserved_gb")
            if any("pools_left_gb" in r for r in per_rank):
                row["pools_left_gb"] = [r.get("pools_left_gb", 0.0) for r in per_rank]
            if "cuda_graph_states" in per_rank[0]:
                row["cuda_graph_states"] = [r["cuda_graph_states"] for r in per_rank]
            if "planned_schedule" in per_rank[0]:
                # Every rank plans from the same all-reduced costs, so rank 0's plan is everyone's.
                row["planned_schedule"] = per_rank[0]["planned_schedule"]
                row["planned_costs_ms"] = per_rank[0]["planned_costs_ms"]
                row["theory"] = per_rank[0]["planned_theory"]
                row["auto_step_times_ms"] = per_rank[0]["auto_step_times_ms"]
            if all("rank_bubble" in r for r in per_rank):
                row["rank_bubble"] = "/".join(f"{r['rank_bubble']:.3f}" for r in per_rank)
            losses = [r.get("loss") for r in per_rank]
            # pipecomm returns the loss on every rank, torch on the last stage's rank (rank 0 in the V) only.
            row["loss"] = next((loss for loss in reversed(losses) if loss is not None), None)
            row["loss_per_rank"] = losses
            row["step_ms_samples"] = [r["step_ms"] for r in per_rank]
        rows.append(row)
    baseline = next((r for r in rows if r["schedule"] == BASELINE and "step_ms" in r), None)
    for row in rows:
        if baseline is not None and "step_ms" in row:
            row["speed_vs_torch_1f1b"] = baseline["step_ms"] / row["step_ms"]
            row["step_vs_torch_1f1b"] = row["step_ms"] / baseline["step_ms"]
            for column, prefix in (("mem/torch_1f1b", "mem"), ("steady/torch_1f1b", "steady")):
                peaks, base_peaks = peak(row, args.ranks, prefix), peak(baseline, args.ranks, prefix)
                row[column] = peaks / base_peaks if peaks is not None and base_peaks else None
    return rows, summary


def check_reference(summary: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str | None:
    """Records every row's first-step loss against the one-process loss; a failure message if one is off."""
    expected = reference_loss(config_named(summary["config"], args.mode), args.layers)
    spreads = {row["schedule"]: abs(row["loss"] - expected) / max(abs(expected), 1e-12)
               for row in rows if row.get("loss") is not None}
    summary["reference_loss"], summary["reference_spread"] = expected, max(spreads.values(), default=None)
    off = [schedule for schedule, spread in spreads.items() if spread > REFERENCE_TOLERANCE]
    return f"{summary['config']}: loss of {off} differs from the one-process loss {expected:.6f}" if off else None


def memory_floor_line(summary: dict[str, Any], rows: list[dict[str, Any]], ranks: int) -> str | None:
    """Each rank's measured 1F1B floor (Rank.stage_memory), and the largest against torch 1F1B's peak."""
    memory = summary["stage_memory"]
    if not all(memory):
        return None
    floors = [m["floor_1f1b_gb"] for m in memory]
    baseline = next((r for r in rows if r["schedule"] == BASELINE and "step_ms" in r), None)
    base_peak = peak(baseline, ranks) if baseline else None
    parts = [f"rank {rank} {m['base_gb']:.2f} + {m['in_flight']} x {m['saved_gb']:.2f} + {m['transient_gb']:.2f} "
             f"= {m['floor_1f1b_gb']:.2f}" for rank, m in enumerate(memory)]
    ratio = f"; largest floor / torch 1F1B peak = {max(floors) / base_peak:.3f}" if base_peak else ""
    return ("# 1F1B memory floor, GB (stage alone: weights + grads + batch, + in-flight micro-batches x saved "
            "activations, + one backward's transient): " + ", ".join(parts) + ratio)


def theoretical_bubble(row_name: str, ranks: int, micro_batches: int) -> float | None:
    """The schedule's bubble fraction simulated with F = 1, B = 2 (I = W = 1) and free transfers."""
    name = base_schedule(SAME_SCHEDULE.get(row_name, row_name))
    if name not in PIPECOMM_SCHEDULES or name == AUTO:  # auto's comes from the plan it made (rows_for)
        return None
    virtual = VIRTUAL if name.startswith("interleaved") else None
    return simulate(make_schedule(name, ranks, micro_batches, virtual)).bubble_fraction


def peak(row: dict[str, Any], ranks: int, prefix: str = "mem") -> float | None:
    """The largest rank's peak: over the whole run ("mem"), or over the timed steps alone ("steady")."""
    values = [row.get(f"{prefix}{rank}_GB") for rank in range(ranks)]
    return max(values) if all(value is not None for value in values) else None


def targets(rows: dict[str, list[dict[str, Any]]], ranks: int) -> list[dict[str, Any]]:
    """The project's targets against torch 1F1B, and each pipecomm schedule against torch's of the same name, in the
    same run; n/a when a number is missing. Entries with the verdict "info" are reported beside them, not targets."""
    def find(config: str, schedule: str) -> dict[str, Any]:
        return next((r for r in rows.get(config, []) if r["schedule"] == schedule), {})

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    found = []
    pc = find("compute", "1f1b")
    speed, memory = pc.get("speed_vs_torch_1f1b"), pc.get("mem/torch_1f1b")
    ok = None if speed is None or memory is None else speed >= TARGET_COMPUTE_SPEED and memory <= TARGET_COMPUTE_MEMORY
    found.append({"target": f"compute: pipecomm 1f1b >= {TARGET_COMPUTE_SPEED:g}x torch 1F1B step speed at <= "
                            f"{TARGET_COMPUTE_MEMORY:g}x its peak memory",
                  "value": f"speed {fmt(speed, 'x')}, memory {fmt(memory, 'x')}", "verdict": verdict(ok)})
    candidates = [r for r in rows.get("compute", [])
                  if r["schedule"] not in TORCH_SCHEDULES and "speed_vs_torch_1f1b" in r]
    best = max(candidates, key=lambda r: r["speed_vs_torch_1f1b"], default=None)
    best_speed = best["speed_vs_torch_1f1b"] if best else None
    found.append({"target": f"compute: best pipecomm schedule >= {TARGET_BEST_SPEED:g}x torch 1F1B step speed",
                  "value": f"{best['schedule']} {fmt(best_speed, 'x')}" if best else "not measured",
                  "verdict": verdict(None if best_speed is None else best_speed >= TARGET_BEST_SPEED)})
    overhead = [r for r in (find("overhead", "1f1b"), find("overhead", "1f1b" + GRAPHS)) if "speed_vs_torch_1f1b" in r]
    best = max(overhead, key=lambda r: r["speed_vs_torch_1f1b"], default=None)
    speed = best["speed_vs_torch_1f1b"] if best else None
    found.append({"target": f"overhead: pipecomm 1f1b (eager or {GRAPHS}) >= {TARGET_OVERHEAD_SPEED:g}x torch 1F1B "
                            "step speed",
                  "value": f"{best['schedule']} {fmt(speed, 'x')}" if best else "not measured",
                  "verdict": verdict(None if speed is None else speed >= TARGET_OVERHEAD_SPEED)})
    found.extend(memory_bound_targets(rows.get("compute", []), ranks))
    for config, config_rows in rows.items():
        names = {r["schedule"] for r in config_rows}
        for ours, theirs in SAME_NAME.items():
            if ours in names and theirs in names:
                ours_ms, theirs_ms = find(config, ours).get("step_ms"), find(config, theirs).get("step_ms")
                speed = theirs_ms / ours_ms if ours_ms and theirs_ms else None
                found.append({"target": f"{config}: same name: pipecomm {ours} faster than {theirs}",
                              "value": f"{theirs.removeprefix('torch ')} / {ours} step time {fmt(speed, 'x')}",
                              "verdict": verdict(None if speed is None else speed > 1.0)})
    return found


def memory_bound_targets(compute_rows: list[dict[str, Any]], ranks: int) -> list[dict[str, Any]]:
    """The best pipecomm schedule whose largest rank's peak memory is at most torch 1F1B's (zb-h2 left out), and
    zb-h2 on its own line ("info"), on the compute-bound config."""
    goal = TARGET_BEST_AT_MEMORY_SPEED[2 if ranks < 4 else 4]
    measured = [r for r in compute_rows if r["schedule"] not in TORCH_SCHEDULES and "speed_vs_torch_1f1b" in r]
    fitting = [r for r in measured if base_schedule(r["schedule"]) != UNBOUNDED_MEMORY
               and r.get("mem/torch_1f1b") is not None and r["mem/torch_1f1b"] <= 1.0]
    best = max(fitting, key=lambda r: r["speed_vs_torch_1f1b"], default=None)
    speed = best["speed_vs_torch_1f1b"] if best else None
    found = [{"target": f"compute: best pipecomm schedule at <= torch 1F1B's peak memory (largest rank's; "
                        f"{UNBOUNDED_MEMORY} apart) >= {goal:g}x torch 1F1B step speed at p = {ranks}",
              "value": (f"{best['schedule']} speed {fmt(speed, 'x')}, memory {fmt(best['mem/torch_1f1b'], 'x')}"
                        if best else "not measured"),
              "verdict": "n/a" if speed is None else ("PASS" if speed >= goal else "FAIL")}]
    for row in measured:
        if base_schedule(row["schedule"]) == UNBOUNDED_MEMORY:
            found.append({"target": f"compute: {row['schedule']} (up to 2x 1F1B's activations) against torch 1F1B",
                          "value": f"speed {fmt(row['speed_vs_torch_1f1b'], 'x')}, "
                                   f"memory {fmt(row.get('mem/torch_1f1b'), 'x')}", "verdict": "info"})
    return found


def loss_spread(rows: dict[str, list[dict[str, Any]]]) -> float | None:
    """The largest relative difference of a schedule's loss from the first schedule's, per config."""
    spreads = []
    for config_rows in rows.values():
        losses = [r["loss"] for r in config_rows if r.get("loss") is not None]
        if len(losses) > 1:
            spreads.append(max(abs(loss - losses[0]) for loss in losses) / max(abs(losses[0]), 1e-12))
    return max(spreads) if spreads else None


def fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.3f}{unit}"


def plot(path: Path, rows: dict[str, list[dict[str, Any]]], summaries: dict[str, dict]) -> str:
    """Efficiency per schedule, one group of bars per config, ideal 1F1B as a tick; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:
        return f"no PNG: matplotlib is not importable ({type(error).__name__}: {error})"
    configs = list(rows)
    schedules = list(dict.fromkeys(r["schedule"] for c in configs for r in rows[c]))
    figure, axes = plt.subplots(figsize=(3.2 + 0.35 * len(configs) * max(len(schedules), 1), 4.2))
    width = 0.8 / max(len(schedules), 1)
    colors = plt.get_cmap("tab10")
    for index, schedule in enumerate(schedules):
        heights = []
        for config in configs:
            row = next((r for r in rows[config] if r["schedule"] == schedule), {})
            heights.append(row.get("eff") or 0.0)
        positions = [c + (index - (len(schedules) - 1) / 2) * width for c in range(len(configs))]
        axes.bar(positions, heights, width, label=schedule, color=colors(index),
                 hatch="//" if schedule in TORCH_SCHEDULES else None, edgecolor="white")
    for c, config in enumerate(configs):
        axes.hlines(summaries[config]["ideal_1f1b"], c - 0.45, c + 0.45, colors="black", linestyles="dashed",
                    label="ideal 1F1B m/(m+p-1)" if c == 0 else None)
    axes.set_xticks(range(len(configs)))
    axes.set_xticklabels([f"{c}\n" + "/".join(str(summaries[c]["shape"][k]) for k in
                                               ("hidden", "seq", "micro_batch_size", "micro_batches"))
                          for c in configs])
    axes.set_ylabel("efficiency = stage compute / step time")
    axes.set_ylim(0, 1.05)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ranks = next(iter(summaries.values()))["ranks"] if summaries else "?"
    axes.set_title(f"{ranks}-rank pipeline: pipecomm (solid) vs torch.distributed.pipelining (hatched)", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot written to {path}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH",
                        help="also write all numbers to this JSON file (and the plot beside it)")
    parser.add_argument("--plot", metavar="PATH", help="PNG of the efficiencies (default: the --json path with .png)")
    parser.add_argument("--configs", default="all", help="all, or a comma list of: " + ", ".join(CONFIGS))
    parser.add_argument("--schedules", default="all",
                        help="all, or a comma list of: " + ", ".join(PIPECOMM_SCHEDULES + list(TORCH_SCHEDULES))
                        + " ('_' for a space: torch_1F1B)")
    parser.add_argument("--micro-batches", metavar="LIST",
                        help="comma list of micro-batch counts: each config runs once per count (e.g. 8,16,32) "
                             "instead of at its own")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks, one GPU each (2, 4 or 8)")
    parser.add_argument("--layers", type=int, default=8,
                        help="GPT or Llama decoder layers; divisible by 2 x ranks (the interleaved and V schedules' "
                             "stage count)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per schedule; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (after one connecting step)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds for init, connect and any one wait")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds before the ranks are killed")
    parser.add_argument("--trace", metavar="DIR",
                        help="pipecomm rows: time compute actions with CUDA events (Pipeline(device_timing=True)), "
                             "write DIR/<config>-<schedule>.json Chrome traces of the last step and report each "
                             "rank's GPU bubble (column rank_bubble)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank on cuda:0 (gloo; pipecomm over IPC), for one GPU; torch's rows are errors "
                             "there: they need send/recv of CUDA tensors, which neither NCCL (one rank per GPU) nor "
                             "gloo gives")
    parser.add_argument("--memory-history", metavar="DIR",
                        help="pipecomm rows on GPUs: record the allocator's history over the timed steps, one pickle "
                             "per rank (scripts/peak_memory.py says what is live at the peak); slows those rows")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run (gloo, shm channels, fp32, d=32, seq=16, micro-batch size 2) "
                             "to check the flow")
    parser.add_argument("--cpu", action="store_true",
                        help="real CPU measurement (gloo, fp32, one thread per rank, d=128, seq=64, micro-batch "
                             "size 2)")
    parser.add_argument("--transport", default="auto", metavar="LIST",
                        help="comma list of pipecomm channel backends, each pipecomm schedule runs once per entry: "
                             + ", ".join(TRANSPORTS) + " (auto: shm or CUDA IPC on one host)")
    args = parser.parse_args(argv)
    if args.smoke and args.cpu:
        parser.error("--smoke and --cpu exclude each other")
    args.mode = "smoke" if args.smoke else "cpu" if args.cpu else "gpu"
    if args.share_gpu and args.mode != "gpu":
        parser.error("--share-gpu puts the ranks on one GPU; --smoke and --cpu run on the CPU")
    if args.smoke:
        # Only options left at their defaults shrink, so a smoke run can still be steered.
        for name, value in (("steps", 2), ("warmup", 1), ("timeout", 30), ("deadline", 420.0)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.config_list = (list(CONFIGS) if args.configs == "all"
                        else [c.strip() for c in args.configs.split(",") if c.strip()])
    known = PIPECOMM_SCHEDULES + list(TORCH_SCHEDULES)
    # CUDA graphs need a GPU: a smoke run leaves those rows out unless named.
    everything = [name for name in known if not (args.mode != "gpu" and name.endswith(GRAPHS))]
    args.schedule_list = (everything if args.schedules == "all"
                          else [s.strip().replace("_", " ") for s in args.schedules.split(",") if s.strip()])
    backends = [b.strip() for b in args.transport.split(",") if b.strip()]
    if not backends or any(b not in TRANSPORTS for b in backends):
        parser.error(f"--transport takes a comma list of {', '.join(TRANSPORTS)}, not {args.transport!r}")
    for name in args.config_list:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    # Any pipecomm schedule may be named with suffixes (+eager, +graphs, +offload, +norms), beyond the rows "all" runs.
    pipecomm_bases = {base_schedule(name) for name in PIPECOMM_SCHEDULES}
    for name in args.schedule_list:
        suffixed = row_suffixes(name) and row_suffixes(name) <= set(SUFFIXES)
        if name not in known and not (suffixed and base_schedule(name) in pipecomm_bases):
            parser.error(f"unknown schedule {name!r}; known: {', '.join(known)}, any of them + {', '.join(SUFFIXES)}")
    args.schedule_list = [name if name in TORCH_SCHEDULES or backend == "auto" else f"{name}{TRANSPORT}{backend}"
                          for name in args.schedule_list
                          for backend in (backends if name not in TORCH_SCHEDULES else ["auto"])]
    if args.micro_batches:
        try:
            counts = [int(count) for count in args.micro_batches.split(",") if count.strip()]
        except ValueError:
            parser.error(f"--micro-batches must be a comma list of integers, not {args.micro_batches!r}")
        if not counts or min(counts) < args.ranks:
            parser.error(f"--micro-batches needs counts >= --ranks ({args.ranks}), got {args.micro_batches!r}")
        args.config_list = [f"{name}-m{count}" for name in args.config_list for count in counts]
    if args.ranks < 2 or args.layers % (VIRTUAL * args.ranks):
        parser.error(f"--ranks must be >= 2 and --layers a multiple of {VIRTUAL} x ranks = {VIRTUAL * args.ranks}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the ranks
    if args.mode == "gpu" and not (torch.cuda.is_available()
                                   and torch.cuda.device_count() >= (1 if args.share_gpu else args.ranks)):
        raise SystemExit(f"needs {args.ranks} CUDA devices (or --cpu, --smoke on CPU)")
    started = time.monotonic()
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    collected = Collector()
    failure = None
    outcomes: dict[int, Any] = {}
    config = {key: value for key, value in vars(args).items()}
    try:
        for name in args.config_list:
            # Each config in processes of its own: its torch rows then start from processes that no earlier config's
            # pipecomm rows touched (a capture stream's cuBLAS workspace, the caching allocator's segments), so its
            # memory columns compare like with like.
            left = args.deadline - (time.monotonic() - started)
            outcomes = spawn_ranks(run_rank, args.ranks, ({**config, "config_list": [name]},),
                                   deadline=max(left, 1.0), timeout=args.timeout, on_report=collected)
    except RankFailure as error:
        failure = str(error)  # print what was measured before the failure, then the failure
    env = outcomes.get(0, {}).get("env") or environment(torch.device("cuda" if args.mode == "gpu" else "cpu"))

    print_environment(env)
    if args.smoke:
        print("# SMOKE RUN on CPU: gloo, shm channels, fp32, toy sizes; numbers mean nothing")
    if args.cpu:
        print(f"# CPU RUN: gloo, fp32, one thread per rank, {os.cpu_count()} cores; pipecomm channels: {args.transport}")
    clock = "CUDA events" if args.mode == "gpu" else "host clock"
    print(f"# {args.layers} layers (GPT blocks, or Llama decoder layers), {args.ranks} ranks; step_ms = median of "
          f"{args.steps} steps after {args.warmup} warm-up ({clock}, slower rank); "
          "wall_ms = host time per step over the timed loop; "
          "eff = one stage's forward+backward of one micro-batch x micro_batches / step_ms; ideal = m/(m+p-1); "
          "bubble = 1 - eff; theory = the schedule's simulated bubble (F=1, B=2, I=W=1, free transfers); "
          "speed_vs_torch_1f1b = torch 1F1B step_ms / step_ms; memN_GB = peak allocated on rank N (+ CUDA-graph pools), warm-up included; steady = the same over the timed steps only")
    all_rows: dict[str, list[dict[str, Any]]] = {}
    summaries: dict[str, dict] = {}
    for name in args.config_list:
        rows, summary = rows_for(args, collected, name)
        if not any("step_ms" in r or "error" in r for r in rows) and summary["stage_compute_ms"] is None:
            continue
        all_rows[name], summaries[name] = rows, summary
        if args.mode != "gpu":
            failure = failure or check_reference(summary, rows, args)
        shape = summary["shape"]
        compute = summary["stage_compute_ms"]
        print(f"\n## {name}: d={shape['hidden']} seq={shape['seq']} micro-batch {shape['micro_batch_size']} x "
              f"{shape['micro_batches']}; one stage's compute {fmt(compute)} ms per step "
              f"({fmt(compute / shape['micro_batches'] if compute else None)} ms per micro-batch)")
        print_table(rows, columns(args.ranks))
        floor = memory_floor_line(summary, rows, args.ranks)
        if floor:
            print(floor)
        reserved = [f"{row['schedule']} {peak(row, args.ranks, 'steady_reserved'):.3f}" for row in rows
                    if peak(row, args.ranks, "steady_reserved") is not None]
        if reserved:
            print("# reserved over the timed steps, GB (the larger rank; graph pools, fragmentation and cache "
                  "included): " + ", ".join(reserved))
        for row in rows:
            if "step_vs_torch_1f1b" in row and row["schedule"] not in TORCH_SCHEDULES:
                print(f"# {name}: pipecomm {row['schedule']} / {BASELINE} step time = "
                      f"{row['step_ms']:.2f} / {row['step_ms'] / row['step_vs_torch_1f1b']:.2f} ms = "
                      f"{row['step_vs_torch_1f1b']:.3f}")
        for row in rows:
            if "planned_schedule" in row:
                costs = "/".join(f"{row['planned_costs_ms'][kind]:.3f}" for kind in ("F", "I", "W"))
                tried = ", ".join(f"{schedule} {ms:.2f}" for schedule, ms in row["auto_step_times_ms"])
                print(f"# {name}: {row['schedule']} planned for the slowest rank's F/I/W = {costs} ms, tried "
                      f"(step ms) {tried}, kept {row['planned_schedule']} (theory = its simulated bubble)")
        for row in rows:
            if "pools_left_gb" in row:
                left = " / ".join(f"{gb:.3f}" for gb in row["pools_left_gb"])
                print(f"# {name}: {row['schedule']} began with {left} GB per rank of an earlier row's CUDA graph "
                      "pools still reserved (their free part kept out of its peak): cuBLAS's workspaces for the "
                      "capture stream, made in the first capture's pool and cached by torch, or a Pipeline that "
                      "outlived its close")
        if "reference_loss" in summary:
            print(f"# {name}: one-process loss {summary['reference_loss']:.6f}; largest relative difference of a "
                  f"row's first-step loss {summary['reference_spread']} (tolerance {REFERENCE_TOLERANCE:g})")
    goals = targets(all_rows, args.ranks)
    print()
    spread = loss_spread(all_rows)
    if spread is not None:
        # No optimizer step: every schedule computes the loss of the same model on the same batch.
        print(f"# same model and data: largest relative loss difference between schedules {spread:.2e} "
              f"({'ok' if spread <= (1e-4 if args.mode != 'gpu' else 2e-2) else 'MISMATCH'})")
    for goal in goals:
        label, verdict = ("info", "") if goal["verdict"] == "info" else ("target", f" {goal['verdict']}")
        print(f"# {label}: {goal['target']}: {goal['value']}{verdict}"
              + (f" ({args.mode} run: meaningless)" if args.mode != "gpu" else ""))
    if failure:
        print(f"# RUN FAILED (results above are partial): {failure}")
    if args.json or args.plot:
        plot_path = Path(args.plot) if args.plot else Path(args.json).with_suffix(".png")
        print(f"# {plot(plot_path, all_rows, summaries)}")
    print(f"# wall time {time.monotonic() - started:.0f} s")
    if args.json:
        tracebacks = {f"{key[0]}/{key[1]}/rank{key[2]}": value["traceback"]
                      for key, value in collected.schedules.items() if value.get("traceback")}
        write_json(args.json, {"env": env, "config": config, "configs": summaries, "rows": all_rows,
                               "targets": goals, "failure": failure, "tracebacks": tracebacks})
    if failure:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
