"""GPU benchmark: train_gpt.py's GPT at pp x FSDP dp or pp x tp, pipecomm against torch.distributed.pipelining."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from _common import (
    REPO_ROOT,
    RankFailure,
    environment,
    print_environment,
    print_table,
    spawn_ranks,
    start_rank,
    write_json,
)

sys.path.insert(0, str(REPO_ROOT / "examples"))
import train_gpt  # noqa: E402  (the example is a script, not a package)

import pipecomm  # noqa: E402

ENGINES = ("pipecomm", "torch")
CPU_LOSS_TOLERANCE = 1e-4  # relative, fp32 on CPU: the engines' first-step losses (GPU: TF32, reduction order)
# Both engines skip gradient clipping: torch has no clip across pipeline stages whose gradients are DTensors of
# different meshes (FSDP's dp shards, tp's shards) and plain tensors, so clipping both would not compare like with like.
MAX_GRAD_NORM = None

Step = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]
Finish = Callable[[], dict[str, Any]]  # closes the engine; returns what it measured beyond step times


# ---------------------------------------------------------------------------------------------
# One rank, one engine


def pipecomm_trainer(context: pipecomm.ParallelContext, modules: list[nn.Module],
                     args: argparse.Namespace) -> tuple[Step, Finish]:
    """examples/train_gpt.py's Pipeline, optimizer and step; with --trace, the last step's device-timed trace of each
    pipeline (one per data-parallel replica and tensor-parallel shard) and each rank's GPU bubble."""
    timed = bool(args.trace) and context.device.type == "cuda"
    pipe = train_gpt.build_pipeline(context, modules, [context.stage], args.micro_batches, "1f1b",
                                    timeout=float(args.timeout), device_timing=timed)
    optimizer = train_gpt.make_optimizer(pipe.parameters(), args.lr)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return train_gpt.train_step(pipe, optimizer, inputs, targets, max_grad_norm=MAX_GRAD_NORM)

    def finish() -> dict[str, Any]:
        measured = {}
        if args.trace:
            pipe.trace(os.path.join(args.trace, f"{args.composition}-dp{context.dp_rank}-tp{context.tp_rank}.json"))
        if timed:
            measured["bubble"] = pipe.bubble_fraction()
        pipe.close()
        return measured

    return step, finish


def tied_group(context: pipecomm.ParallelContext) -> dist.ProcessGroup:
    """The first and last stage of this rank's pipeline, which hold the tied embedding and LM head; every rank makes
    every such group, in one order, as new_group requires."""
    layout = context.mesh.mesh  # global ranks by ("dp", "pp", "tp")
    mine = None
    for dp_index in range(layout.shape[0]):
        for tp_index in range(layout.shape[2]):
            holders = sorted({int(layout[dp_index, 0, tp_index]), int(layout[dp_index, -1, tp_index])})
            group = dist.new_group(holders)
            if context.rank in holders:
                mine = group
    return mine


def torch_trainer(context: pipecomm.ParallelContext, modules: list[nn.Module],
                  args: argparse.Namespace) -> tuple[Step, Finish]:
    """The same stage under torch's PipelineStage and Schedule1F1B, with the gradient reductions pipecomm.Pipeline
    does for it done by hand: the data-parallel mean of what FSDP does not reduce, then the tied weight's sum."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    [module] = modules
    by_name = dict(module.named_parameters(remove_duplicate=False))
    tied = [by_name[name] for name in module.shared_parameters]  # what pipecomm.split found shared between stages
    sharded = {id(param) for block in module.modules() if isinstance(block, FSDPModule) for param in block.parameters()}
    replicated = [param for param in module.parameters() if id(param) not in sharded]
    if sharded:
        # As torchtitan does: the stage is FSDP's root (its own parameters left out, replicated as in pipecomm), so
        # that PipelineStage sees an FSDPModule, accumulates unsharded gradients over the micro-batches and
        # reduce-scatters once per step; blocks stay gathered between micro-batches, as pipecomm keeps them.
        fully_shard(module, mesh=context.mesh["dp"], ignored_params=set(replicated))
        module.set_reshard_after_forward(False)
    holders = tied_group(context) if tied else None
    stage = PipelineStage(module, context.stage, context.num_stages, context.device, group=context.pipeline_group)
    # scale_grads (the default) divides by the micro-batch count: the mean micro-batch loss, as pipecomm's.
    schedule = Schedule1F1B(stage, args.micro_batches, loss_fn=train_gpt.loss_fn)
    optimizer = train_gpt.make_optimizer(module.parameters(), args.lr)
    first, last = context.stage == 0, context.stage == context.num_stages - 1

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        # torch's schedule moves nothing to the stage's device (pipecomm's does), and PipelineStage checks input
        # strides against its first micro-batch's: the token windows are slices.
        if first:
            schedule.step(inputs.to(context.device).contiguous())
        elif last:
            schedule.step(target=targets.to(context.device).contiguous(), losses=losses)
        else:
            schedule.step()
        if context.data_size > 1:
            grads = [param.grad for param in replicated]
            for grad in grads:
                dist.all_reduce(grad, group=context.data_group)
            torch._foreach_div_(grads, context.data_size)
        for param in tied:
            dist.all_reduce(param.grad, group=holders)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack([loss.detach() for loss in losses]).mean() if losses else None

    return step, dict


def run_rank(rank: int, world_size: int, store_port: int, report: Callable[[Any], None], engine: str,
             config: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**config)
    os.environ["LOCAL_RANK"] = str(rank)  # pipecomm.init's device: cuda:LOCAL_RANK
    device, _ = start_rank(rank, world_size, store_port, args.smoke, args.timeout)
    context = pipecomm.init(pipeline_size=args.pp, data_size=args.dp, tensor_size=args.tp)
    _, modules = train_gpt.build_stages(context, args.hidden, args.heads, args.layers, args.seq, [context.stage],
                                        args.composition == "fsdp")
    step, finish = (pipecomm_trainer if engine == "pipecomm" else torch_trainer)(context, modules, args)
    data = train_gpt.Data(None, args.seq, train_gpt.VOCAB)
    batch_size = args.micro_batches * args.micro_batch_size
    losses, step_ms = [], []
    for step_index in range(1, args.warmup + args.steps + 1):
        inputs, targets = train_gpt.replica_batch(data, step_index, context, batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss = step(inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step_index > args.warmup:
            step_ms.append((time.perf_counter() - started) * 1e3)
        losses.append(None if loss is None else float(loss))
    result = {"rank": rank, "stage": context.stage, "dp_rank": context.dp_rank, "tp_rank": context.tp_rank,
              "step_ms": step_ms, "losses": losses,
              "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              **finish()}
    if rank == 0:
        env = environment(device)
        env["ranks"] = f"{world_size} processes, rank r on {'cuda:r' if device.type == 'cuda' else 'cpu'}"
        env["process_group"] = dist.get_backend()
        if device.type == "cuda":
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        result["env"] = env
    return result


# ---------------------------------------------------------------------------------------------
# Parent: one spawn per engine, so that a failure or hang of one leaves the other its run and its memory


def engine_row(engine: str, outcomes: dict[int, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    # A step lasts as long as its slowest rank.
    step_ms = statistics.median(max(samples) for samples in zip(*(o["step_ms"] for o in outcomes.values())))
    tokens = args.micro_batches * args.micro_batch_size * args.seq * args.dp
    # The global batch's loss: the mean over the data-parallel replicas' last stages.
    reporters = [o for o in outcomes.values() if o["stage"] == args.pp - 1 and o["tp_rank"] == 0]
    row: dict[str, Any] = {"engine": engine, "tokens_per_s": tokens / (step_ms / 1e3), "step_ms": step_ms}
    peaks = [outcomes[rank]["peak_gb"] for rank in sorted(outcomes)]
    if None not in peaks:
        row["peak_GB"] = max(peaks)
        row.update({f"mem{rank}_GB": peak for rank, peak in enumerate(peaks)})
    if all("bubble" in o for o in outcomes.values()):
        row["bubble_max"] = max(o["bubble"] for o in outcomes.values())
    row["loss_step1"] = statistics.mean(o["losses"][0] for o in reporters)
    row["loss_last"] = statistics.mean(o["losses"][-1] for o in reporters)
    row["reporter_losses"] = {o["rank"]: o["losses"] for o in reporters}
    return row


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """pipecomm over torch: speed and peak memory, and the largest relative difference of a replica's first loss."""
    ours, theirs = rows.get("pipecomm", {}), rows.get("torch", {})
    if "error" in ours or "error" in theirs or not ours or not theirs:
        return {}
    loss_diff = max(abs(ours["reporter_losses"][rank][0] - losses[0]) / abs(losses[0])
                    for rank, losses in theirs["reporter_losses"].items())
    return {"tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "peak_memory": ours["peak_GB"] / theirs["peak_GB"] if "peak_GB" in ours else None,
            "loss_step1_rel_diff": loss_diff}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--composition", choices=("fsdp", "tp"), required=True,
                        help="fsdp: pp x data-parallel with each block fully_shard-ed over dp; "
                             "tp: pp x tensor-parallel blocks (Block.parallelize)")
    parser.add_argument("--ranks", type=int, default=4, help="processes, one GPU each")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages; dp (fsdp) or tp is --ranks / --pp")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma list of: " + ", ".join(ENGINES))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per engine; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one connects)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds for init and any one wait")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds per engine before its ranks are killed")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    parser.add_argument("--trace", metavar="DIR",
                        help="write DIR/<composition>-dp<i>-tp<j>.json Chrome traces of pipecomm's last step; on GPUs its "
                             "compute actions at the GPU's times (device_timing) and the largest rank's GPU bubble "
                             "(column bubble_max)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, gloo, fp32, tiny sizes: checks the flow and that the engines' losses agree; any "
                             "error fails the run")
    args = parser.parse_args(argv)
    if args.smoke:
        # Only options left at their defaults shrink, so a smoke run can still be steered.
        for name, value in (("hidden", 64), ("heads", 4), ("layers", 4), ("seq", 16), ("micro_batches", 4),
                            ("steps", 2), ("warmup", 1), ("timeout", 60), ("deadline", 120.0)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.engine_list = [engine.strip() for engine in args.engines.split(",") if engine.strip()]
    if not args.engine_list or any(engine not in ENGINES for engine in args.engine_list):
        parser.error(f"--engines takes a comma list of {', '.join(ENGINES)}, not {args.engines!r}")
    if args.pp < 2 or args.ranks % args.pp:
        parser.error(f"--pp must be at least 2 and divide --ranks {args.ranks}, got {args.pp}")
    args.dp, args.tp = (args.ranks // args.pp, 1) if args.composition == "fsdp" else (1, args.ranks // args.pp)
    if args.hidden % args.heads or args.heads % args.tp:
        parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}, and that by tp {args.tp}")
    if args.layers < args.pp or args.micro_batches < args.pp:
        parser.error(f"--layers and --micro-batches must be at least --pp {args.pp}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    config = {key: value for key, value in vars(args).items() if key != "json"}
    rows: dict[str, dict[str, Any]] = {}
    env: dict[str, Any] | None = None
    for engine in args.engine_list:
        print(f"[parallel_3d] {args.composition}: {engine} on {args.ranks} ranks", file=sys.stderr, flush=True)
        try:
            outcomes = spawn_ranks(run_rank, args.ranks, (engine, config), deadline=args.deadline,
                                   timeout=args.timeout)
        except RankFailure as error:
            print(f"[parallel_3d] {engine} failed: {error}", file=sys.stderr, flush=True)
            rows[engine] = {"engine": engine, "error": str(error).strip().splitlines()[-1][:200],
                            "traceback": str(error)}
            continue
        env = env or outcomes[0].get("env")
        rows[engine] = engine_row(engine, outcomes, args)
    ratios = compare(rows)
    if env is not None:
        print_environment(env)
    print(f"# {args.composition}: pp={args.pp} dp={args.dp}{' (FSDP)' if args.composition == 'fsdp' else ''} "
          f"tp={args.tp}; GPT d={args.hidden} heads={args.heads} layers={args.layers} seq={args.seq}, "
          f"micro-batches {args.micro_batches} x {args.micro_batch_size}, fp32, AdamW lr={args.lr}, no clipping; "
          f"median of {args.steps} steps after {args.warmup}")
    measured_memory = any("peak_GB" in row for row in rows.values())  # on GPUs
    memory_columns = ["peak_GB", *(f"mem{rank}_GB" for rank in range(args.ranks))] if measured_memory else []
    bubble_column = ["bubble_max"] if any("bubble_max" in row for row in rows.values()) else []
    print_table(list(rows.values()), ["engine", "tokens_per_s", "step_ms", *bubble_column, *memory_columns,
                                      "loss_step1", "loss_last", "error"])
    if ratios:
        print(f"pipecomm / torch: tokens/s {ratios['tokens_per_s']:.3f}x"
              + (f", peak memory (max over ranks) {ratios['peak_memory']:.3f}x" if ratios["peak_memory"] else ""))
        print(f"first-step loss, largest relative difference over the replicas: {ratios['loss_step1_rel_diff']:.2e}"
              + (f" (limit {CPU_LOSS_TOLERANCE:g} on CPU)" if args.smoke else ""))
    if args.json:
        write_json(args.json, {"environment": env, "config": config, "rows": list(rows.values()), "ratios": ratios})
        print(f"wrote {args.json}")
    if args.smoke:
        failed = [engine for engine, row in rows.items() if "error" in row]
        if failed:
            raise SystemExit(f"smoke run failed: {', '.join(failed)}")
        if ratios and ratios["loss_step1_rel_diff"] > CPU_LOSS_TOLERANCE:
            raise SystemExit(f"the engines' first-step losses differ by {ratios['loss_step1_rel_diff']:.2e} "
                             f"> {CPU_LOSS_TOLERANCE:g}")


if __name__ == "__main__":
    main()
