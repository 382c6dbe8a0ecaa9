"""Host cost: CPU time of the host per action and per step, pipecomm's executor against torch.distributed.pipelining.

Both run the same stage modules (same weights, same data) on 2 ranks, one stage each: torch's PipelineStage with
Schedule1F1B, and pipecomm's Pipeline with 1f1b (as built with no speed flags, and eager: cuda_graphs=False) and
zb-h1. Each row times, on every rank, the CPU time of the thread that runs the step (time.thread_time: the host
work that issues the kernels, which a host-bound step waits for) and of the whole process (time.process_time: gloo's
and NCCL's own threads too), per step, and, per call, of each action, exclusive of the actions and losses it calls:

- pipecomm: F, B, I, W (the executor's compute actions), send and recv (its SEND_F/SEND_B and RECV_F/RECV_B);
- torch: F and B (``forward_one_chunk``, ``backward_one_chunk``), send and recv (``get_*_send_ops`` and
  ``get_*_recv_ops``), and p2p (``_batch_p2p`` and ``_wait_batch_p2p``, which post and wait for both at once);
- both: loss (the loss function), and other: the step's time outside all of these (the schedule's own loop, the
  step's setup, splitting the batch, the loss's reduction, the result's broadcast).

Models (``--models``): ``mha``, pre-norm blocks of ``nn.MultiheadAttention`` and a GELU MLP (many small kernels);
``llama``, a Hugging Face Llama built from a config, its decoder layers in two halves (llama_stage.LlamaStage);
``gpt``, bench/e2e.py's GPT blocks; ``tiny`` (not run by default), a stage of one ``Linear(8, 8)`` on micro-batches
of 2 samples, so that a step is the libraries' fixed cost alone (issue 33's CPU target compares its wall time per
step, ``wall_vs_torch``).
``--micro-batches 8,32`` runs every model once per micro-batch count instead of its shape's. On CPU (``--cpu``: gloo,
pipecomm's shared-memory channels, one thread per rank, fp32) the models are tiny, so a step is mostly overhead;
on GPUs (default: rank r on cuda:r, NCCL, bf16) they have issue 33's shapes, smaller where noted. ``--share-gpu``
puts both ranks on cuda:0 (gloo; pipecomm over IPC). ``--smoke`` is a CPU run of one step, for the tests.

A table per model (microseconds; the slower rank's for each column; per step, the median over the measured steps; per call,
the mean),
the JSON with every rank's numbers (``--json``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import environment, print_environment, print_table, spawn_ranks, start_rank, write_json  # noqa: E402
from llama_stage import LlamaStage, llama_config, token_batch, token_loss  # noqa: E402

# "pipecomm 1f1b" is the Pipeline as built with no speed flags (cuda_graphs="auto": graphed from the third step on
# GPUs, within the warm-up); "eager" rows pass cuda_graphs=False.
TORCH_ROW = "torch 1F1B"
ROWS = (TORCH_ROW, "pipecomm 1f1b", "pipecomm 1f1b eager", "pipecomm zb-h1")
# Not run by default (``--rows``): each rank's stage work alone, a gradient-accumulation loop with no pipeline,
# the floor under any schedule's step on that rank.
EXTRA_ROWS = ("stage alone",)
MODELS = ("mha", "llama", "gpt", "tiny")
DEFAULT_MODELS = ("mha", "llama", "gpt")
ACTIONS = ("F", "B", "I", "W", "loss", "send", "recv", "p2p")
# pipecomm's executor methods, one per action kind, and what they count as.
PIPECOMM_ACTIONS = {"_forward": "F", "_backward": "B", "_backward_input": "I", "_backward_weight": "W",
                    "_send_forward": "send", "_send_backward": "send", "_recv_forward": "recv", "_recv_backward": "recv"}
TORCH_STAGE_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W",
                       "get_fwd_send_ops": "send", "get_bwd_send_ops": "send", "get_fwd_recv_ops": "recv",
                       "get_bwd_recv_ops": "recv"}
TORCH_SCHEDULE_FUNCTIONS = {"_batch_p2p": "p2p", "_wait_batch_p2p": "p2p"}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int  # in all, half on each stage
    seq: int
    micro_batch_size: int
    micro_batches: int
    vocab: int = 0  # llama only


SHAPES = {  # (mode, model) -> shape; GPU shapes are issue 33's (the Llama narrower: its host cost is per kernel)
    ("gpu", "mha"): Shape(1024, 8, 512, 2, 16),
    ("gpu", "llama"): Shape(1024, 8, 512, 2, 8, vocab=8192),
    ("gpu", "gpt"): Shape(1024, 8, 512, 2, 16),
    ("cpu", "mha"): Shape(32, 4, 16, 2, 8),
    ("cpu", "llama"): Shape(32, 4, 16, 2, 8, vocab=128),
    ("cpu", "gpt"): Shape(32, 4, 16, 2, 8),
    ("gpu", "tiny"): Shape(8, 2, 1, 2, 8),  # one Linear(8, 8) per stage, inputs [micro-batch size, 8]
    ("cpu", "tiny"): Shape(8, 2, 1, 2, 8),
}


# ---------------------------------------------------------------------------------------------
# Host meter


class HostMeter:
    """Exclusive thread CPU time and calls per action kind of the wrapped functions, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.label = False  # each call a torch.profiler range named by its kind (--trace)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._nested: list[float] = []  # per open call: the time its metered callees took
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, self.timed(original, kind))
        self._undo.append((owner, name, original))

    def timed(self, original: Callable, kind: str) -> Callable:
        @functools.wraps(original)
        def metered(*args, **kwargs):
            if self.label:
                with torch.profiler.record_function(kind):
                    return original(*args, **kwargs)
            if not self.active:
                return original(*args, **kwargs)
            self._nested.append(0.0)
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.thread_time() - start
                inner = self._nested.pop()
                self.seconds[kind] += took - inner
                self.calls[kind] += 1
                if self._nested:
                    self._nested[-1] += took

        return metered

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


# ---------------------------------------------------------------------------------------------
# Models: each rank's stage module, the same for both libraries


class MHABlock(nn.Module):
    """Pre-norm block: nn.MultiheadAttention (causal), then a 4x GELU MLP."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm_attention = nn.LayerNorm(hidden)
        self.attention = nn.MultiheadAttention(hidden, max(1, hidden // 64), batch_first=True)
        self.norm_mlp = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_attention(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm_mlp(x))


def build_stage(model: str, shape: Shape, rank: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Rank ``rank``'s half of the model: layer i seeded by i, so both ranks hold one model whatever the split."""
    half = range(rank * shape.layers // 2, (rank + 1) * shape.layers // 2)
    if model == "tiny":
        torch.manual_seed(1000 + rank)
        return nn.Linear(shape.hidden, shape.hidden).to(device, dtype)
    if model == "gpt":
        from e2e import Config, build_chunk

        config = Config("host_cost", shape.hidden, shape.seq, shape.micro_batch_size, shape.micro_batches)
        return build_chunk(half, config, device, dtype)
    if model == "mha":
        blocks = []
        for layer in half:
            torch.manual_seed(1000 + layer)  # as e2e.build_chunk seeds its blocks
            blocks.append(MHABlock(shape.hidden))
        return nn.Sequential(*blocks).to(device, dtype)
    config = llama_config(shape.hidden, shape.layers, shape.seq, shape.vocab)
    with torch.device(device):
        return LlamaStage(config, half, first=rank == 0, last=rank == 1).to(dtype)


def make_batch(model: str, shape: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batch = shape.micro_batch_size * shape.micro_batches
    if model == "llama":
        return token_batch(batch, shape.seq, shape.vocab, device)
    generator = torch.Generator().manual_seed(7)
    dims = (batch, shape.hidden) if model == "tiny" else (batch, shape.seq, shape.hidden)
    inputs, target = torch.randn(dims, generator=generator), torch.randn(dims, generator=generator)
    return inputs.to(device, dtype), target.to(device, dtype)


def loss_for(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if model == "llama":
        return token_loss
    from e2e import mse_loss

    return mse_loss


# ---------------------------------------------------------------------------------------------
# Runners: one training step each, the meter around its actions


def pipecomm_runner(row: str, module: nn.Module, rank: int, shape: Shape, loss_fn: Callable, device: torch.device,
                    args: argparse.Namespace, meter: HostMeter) -> tuple[Callable[[], None], Callable[[], None]]:
    import pipecomm
    from pipecomm.runtime.executor import StageExecutor

    for name, kind in PIPECOMM_ACTIONS.items():
        meter.wrap(StageExecutor, name, kind)
    words = row.split()
    pipe = pipecomm.Pipeline(module, stage=rank, num_stages=2, loss_fn=loss_fn, micro_batches=shape.micro_batches,
                             schedule=words[1], device=device, transport="ipc" if args.share_gpu else "auto",
                             timeout=float(args.timeout), cuda_graphs=False if words[2:] == ["eager"] else "auto")
    return pipe.step, pipe.close


def torch_runner(row: str, module: nn.Module, rank: int, shape: Shape, loss_fn: Callable, device: torch.device,
                 args: argparse.Namespace, meter: HostMeter) -> tuple[Callable[..., None], Callable[[], None]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for name, kind in TORCH_STAGE_ACTIONS.items():
        meter.wrap(_PipelineStageBase, name, kind)
    for name, kind in TORCH_SCHEDULE_FUNCTIONS.items():
        meter.wrap(schedules, name, kind)
    schedule = Schedule1F1B(PipelineStage(module, rank, 2, device), shape.micro_batches, loss_fn=loss_fn)

    def step(inputs: torch.Tensor, target: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=[])

    return step, lambda: None


def alone_runner(row: str, module: nn.Module, rank: int, shape: Shape, loss_fn: Callable, device: torch.device,
                 args: argparse.Namespace, meter: HostMeter) -> tuple[Callable[..., None], Callable[[], None]]:
    """Each micro-batch's forward and backward of this rank's stage, without a pipeline: the first stage's from the
    data with an output gradient of ones, the last stage's through the (1/m-scaled) loss from an input that needs
    its gradient, as a received activation does."""
    forward = meter.timed(module.__call__, "F")
    backward = meter.timed(torch.autograd.backward, "B")
    dtype = next(module.parameters()).dtype

    def step(inputs: torch.Tensor, target: torch.Tensor) -> None:
        for micro_input, micro_target in zip(inputs.chunk(shape.micro_batches), target.chunk(shape.micro_batches)):
            if rank == 0:
                output = forward(micro_input)
                backward([output], [torch.ones_like(output)])
            else:
                # The last stage of a token model reads the first stage's hidden states, not the tokens.
                received = (micro_input if micro_input.is_floating_point()
                            else torch.randn(*micro_input.shape, shape.hidden, device=micro_input.device, dtype=dtype))
                loss = loss_fn(forward(received.detach().requires_grad_()), micro_target) / shape.micro_batches
                backward([loss])

    return step, lambda: None


RUNNERS = {"torch": torch_runner, "pipecomm": pipecomm_runner, "stage": alone_runner}


def measure(row: str, model: str, shape: Shape, module: nn.Module, rank: int, device: torch.device,
            args: argparse.Namespace) -> dict[str, Any]:
    """One row on this rank: per step, the thread's and the process's CPU time and the wall time; per action kind,
    the thread's CPU time per call."""
    meter = HostMeter()
    metered_loss = meter.timed(loss_for(model), "loss")
    inputs, target = make_batch(model, shape, device, next(module.parameters()).dtype)
    step, close = RUNNERS[row.split()[0]](row, module, rank, shape, metered_loss, device, args, meter)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    thread, process, wall, other = [], [], [], []
    try:
        for index in range(args.warmup + args.steps):
            measured = index >= args.warmup
            meter.active = measured
            metered_before = sum(meter.seconds.values())
            dist.barrier()
            synchronize()
            started = (time.thread_time(), time.process_time(), time.perf_counter())
            step(inputs, target=target)
            ended = (time.thread_time(), time.process_time())
            meter.active = False
            synchronize()  # the wall time is the step's, the device's work included (graphs return before it ends)
            finished = time.perf_counter()
            module.zero_grad(set_to_none=True)
            if measured:
                thread.append(ended[0] - started[0])
                process.append(ended[1] - started[1])
                wall.append(finished - started[2])
                other.append(thread[-1] - (sum(meter.seconds.values()) - metered_before))
        per_call = {kind: meter.seconds[kind] / meter.calls[kind] for kind in ACTIONS if meter.calls.get(kind)}
        calls = {kind: meter.calls[kind] // args.steps for kind in ACTIONS if meter.calls.get(kind)}
        device_time = trace_step(row, model, rank, step, inputs, target, module, meter, args) if args.trace else None
    finally:
        meter.restore()
        close()
    return {"row": row, "model": model, "table": table_name(model, shape, args), "rank": rank,
            "thread_us": _median_us(thread), "process_us": _median_us(process),
            "wall_ms": statistics.median(wall) * 1e3, "other_us": _median_us(other),
            "per_call_us": {kind: seconds * 1e6 for kind, seconds in per_call.items()}, "calls_per_step": calls,
            "device_time": device_time}


def trace_step(row: str, model: str, rank: int, step: Callable, inputs: torch.Tensor, target: torch.Tensor,
               module: nn.Module, meter: HostMeter, args: argparse.Namespace) -> dict[str, float]:
    """One more step under torch.profiler, each action a named range: its chrome trace in ``args.trace`` and what
    the device did meanwhile (``device_summary``)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if inputs.is_cuda else [])]
    dist.barrier()
    synchronize()
    meter.label = True
    with profile(activities=activities) as profiler:
        step(inputs, target=target)
        synchronize()
    meter.label = False
    module.zero_grad(set_to_none=True)
    path = Path(args.trace) / f"{model}-{row.replace(' ', '_')}-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return device_summary(json.loads(path.read_text()))


def device_summary(trace: dict) -> dict[str, float]:
    """From a chrome trace, in milliseconds: the span from the first device event to the last, the time any kernel or
    copy ran (their union over streams), kernels' and copies' summed time, and the idle time in gaps of over 50 us,
    split by what the device waited for: the host, when the next kernel or copy was launched after the gap began
    (host-bound), or something else (a wait on another stream or rank) when it was already queued."""
    launched = {event["args"]["correlation"]: event["ts"] for event in trace["traceEvents"]
                if event.get("cat") == "cuda_runtime" and "correlation" in event.get("args", {})}
    events = sorted((event["ts"], event["ts"] + event["dur"], event["cat"],
                     launched.get(event.get("args", {}).get("correlation"), float("-inf")))
                    for event in trace["traceEvents"]
                    if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not events:
        return {}
    busy = waiting_for_host = waiting_queued = 0.0
    end = events[0][0]
    for start, finish, _, launch in events:
        if start - end > 50:
            host_part = min(max(0.0, launch - end), start - end)
            waiting_for_host += host_part
            waiting_queued += start - end - host_part
        busy += max(0.0, finish - max(start, end))
        end = max(end, finish)
    return {"span_ms": (end - events[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "kernel_ms": sum(f - s for s, f, cat, _ in events if cat == "kernel") / 1e3,
            "copy_ms": sum(f - s for s, f, cat, _ in events if cat != "kernel") / 1e3,
            "kernels": sum(cat == "kernel" for _, _, cat, _ in events),
            "idle_for_host_ms": waiting_for_host / 1e3, "idle_queued_ms": waiting_queued / 1e3}


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def model_shape(model: str, mode: str, micro_batches: int | None, size: str = "") -> Shape:
    """The model's shape for the mode, with ``--micro-batches``'s count and ``--size``'s hidden, seq, micro-batch size
    and count where given."""
    shape = SHAPES[("cpu" if mode != "gpu" else "gpu", model)]
    if size:
        hidden, seq, micro_batch_size, count = (int(value) for value in size.split(","))
        shape = replace(shape, hidden=hidden, seq=seq, micro_batch_size=micro_batch_size, micro_batches=count)
    return shape if micro_batches is None else replace(shape, micro_batches=micro_batches)


def table_name(model: str, shape: Shape, args: argparse.Namespace) -> str:
    """A table per model, and per micro-batch count where ``--micro-batches`` gives them."""
    return model if not args.micro_batch_list else f"{model} m={shape.micro_batches}"


# ---------------------------------------------------------------------------------------------
# Ranks and parent


def run_rank(rank: int, world_size: int, store_port: int, report: Callable[[Any], None],
             config: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**config)
    on_cpu = args.mode != "gpu"
    device, _ = start_rank(rank, world_size, store_port, on_cpu, args.timeout, share_gpu=args.share_gpu)
    dtype = torch.float32 if on_cpu else torch.bfloat16
    env = environment(device) if rank == 0 else None
    if env is not None:
        env["ranks"] = f"2 processes, {'both on cuda:0' if args.share_gpu else 'rank r on cuda:r' if not on_cpu else 'cpu'}"
        env["process_group"] = dist.get_backend()
        env["threads_per_rank"] = torch.get_num_threads()
    for model in args.model_list:
        for micro_batches in args.micro_batch_list or [None]:
            shape = model_shape(model, args.mode, micro_batches, args.size)
            module = build_stage(model, shape, rank, device, dtype)
            for row in args.row_list:
                report(measure(row, model, shape, module, rank, device, args))
                dist.barrier()
    return {"env": env}


def table(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """One row per runner: the slower rank's value of each column; the ratios of the step's thread time and wall
    time to torch's."""
    rows = []
    by_row: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        if result["table"] == name:
            by_row[result["row"]].append(result)
    torch_step = max((r["thread_us"] for r in by_row.get(TORCH_ROW, [])), default=None)
    torch_wall = max((r["wall_ms"] for r in by_row.get(TORCH_ROW, [])), default=None)
    for name in (*ROWS, *EXTRA_ROWS):
        ranks = by_row.get(name)
        if not ranks:
            continue
        row: dict[str, Any] = {"runner": name}
        for column in ("thread_us", "process_us", "wall_ms", "other_us"):
            row[column] = max(r[column] for r in ranks)
        row["vs_torch"] = row["thread_us"] / torch_step if torch_step else None
        row["wall_vs_torch"] = row["wall_ms"] / torch_wall if torch_wall else None
        for kind in ACTIONS:
            values = [r["per_call_us"][kind] for r in ranks if kind in r["per_call_us"]]
            row[kind] = max(values) if values else None
        rows.append(row)
    return rows


def device_rows(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [{"runner": result["row"], "rank": result["rank"], **(result["device_time"] or {})}
            for result in sorted(results, key=lambda result: (result["row"], result["rank"])) if result["table"] == name]


DEVICE_COLUMNS = ["runner", "rank", "span_ms", "busy_ms", "kernel_ms", "copy_ms", "kernels", "idle_for_host_ms", "idle_queued_ms"]
COLUMNS = ["runner", "thread_us", "vs_torch", "process_us", "wall_ms", "wall_vs_torch", *ACTIONS, "other_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_const", dest="mode", const="cpu", help="2 CPU ranks (gloo, shm)")
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="a CPU run of one step")
    parser.set_defaults(mode="gpu")
    parser.add_argument("--share-gpu", action="store_true", help="both ranks on cuda:0 (gloo, pipecomm over IPC)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--micro-batches", default="",
                        help="e.g. 8,32: each model once per micro-batch count (default: its shape's)")
    parser.add_argument("--size", default="", metavar="HIDDEN,SEQ,MB,M",
                        help="every model at this hidden size, sequence length, micro-batch size and count")
    parser.add_argument("--rows", default=None,
                        help=f"of {', '.join((*ROWS, *EXTRA_ROWS))} ('_' for a space: torch_1F1B; default: "
                             f"{', '.join(ROWS)}, without torch's with --share-gpu)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="one more step per row under torch.profiler: chrome traces here, device time in the JSON")
    args = parser.parse_args()
    args.model_list = [model for model in args.models.split(",") if model]
    unknown = set(args.model_list) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    args.micro_batch_list = [int(count) for count in args.micro_batches.split(",") if count]
    # "torch_1F1B" for "torch 1F1B": names without spaces pass through scripts/gpu_check.sh's word splitting.
    if args.rows is None:
        args.rows = ",".join(row for row in ROWS if not (args.share_gpu and row == TORCH_ROW))
    args.row_list = [row.strip().replace("_", " ") for row in args.rows.split(",") if row.strip()]
    unknown_rows = set(args.row_list) - {*ROWS, *EXTRA_ROWS}
    if unknown_rows:
        parser.error(f"unknown rows {sorted(unknown_rows)}; known: {', '.join((*ROWS, *EXTRA_ROWS))}")
    if args.share_gpu and TORCH_ROW in args.row_list:
        parser.error("torch's pipelining cannot run two ranks on one GPU (NCCL refuses them, gloo sends no CUDA "
                     "tensors): leave torch_1F1B out of --rows with --share-gpu")
    if args.mode == "smoke":
        args.steps, args.warmup = 1, 1
    if args.mode == "gpu" and not args.share_gpu and torch.cuda.device_count() < 2:
        parser.error("2 GPUs needed (or --share-gpu, or --cpu)")
    results: list[dict[str, Any]] = []
    runs = len(args.model_list) * max(1, len(args.micro_batch_list))
    outcome = spawn_ranks(run_rank, 2, (vars(args),), deadline=60 + 120 * runs,
                          timeout=args.timeout, on_report=lambda rank, payload: results.append(payload))
    env = outcome[0]["env"]
    print_environment(env)
    tables = {}
    for model in args.model_list:
        for micro_batches in args.micro_batch_list or [None]:
            shape = model_shape(model, args.mode, micro_batches, args.size)
            name = table_name(model, shape, args)
            print(f"\n{name}: {asdict(shape)} "
                  f"(host CPU time in microseconds; per call for the actions, per step for the rest)")
            tables[name] = table(results, name)
            print_table(tables[name], COLUMNS)
            if args.trace:
                print("device time of one traced step (ms; per rank):")
                print_table(device_rows(results, name), DEVICE_COLUMNS)
    if args.json:
        write_json(args.json, {"env": env, "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
                               "tables": tables, "ranks": results})


if __name__ == "__main__":
    main()
