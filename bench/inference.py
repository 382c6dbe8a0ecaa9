"""Inference through the pipeline: pipecomm's Pipeline.forward against torch.distributed.pipelining's schedule.eval.

Spawns --ranks p ranks (GPUs: rank r on cuda:r over NCCL; --cpu: CPU processes over gloo, one thread each). Each
stage is --layers-per-stage blocks of Linear(d, 4d), GELU, Linear(4d, d) with a residual, identical on both sides
(seeded per stage). For each placement, both run forward only over --micro-batches micro-batches of --micro-batch
rows and return the last stage's full-batch output:
  looped:      one stage per rank;        torch ScheduleGPipe.eval
  interleaved: two stages per rank, looped; torch ScheduleInterleaved1F1B.eval
  v:           two stages per rank in a V (zb-v's placement); no torch row: ScheduleZBVZeroBubble.eval raises
               "can't steal_bwd_input if this stage doesn't have backward" (torch 2.13), so torch has no V inference
The table gives the median call time (the slower rank), torch / pipecomm, and whether pipecomm's output agrees
with the stages run in turn on one process and with torch's (where torch has the placement). torch's eval also computes the loss
on its last stage (its eval needs a target); that costs one mean-squared error per micro-batch. --smoke: a tiny CPU
run checking the control flow; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from _common import environment, print_environment, print_table, spawn_ranks, start_rank, write_json

PLACEMENTS = {  # name -> (pipecomm schedule giving the placement, torch schedule class, stages per rank)
    "looped": ("1f1b", "ScheduleGPipe", 1),
    "interleaved": ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
    "v": ("zb-v", None, 2),
}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def build_stage(stage: int, options: dict[str, Any], device: torch.device) -> nn.Module:
    torch.manual_seed(1000 + stage)
    return nn.Sequential(*(Block(options["width"]) for _ in range(options["layers_per_stage"]))).to(device)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def median_call_ms(call, warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iters):
        torch.distributed.barrier()
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def run_rank(rank: int, world_size: int, store_port: int, report, options: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.pipelining as pipelining

    import pipecomm

    device, _ = start_rank(rank, world_size, store_port, options["cpu"], options["timeout"])
    micro_batches, rows = options["micro_batches"], options["micro_batch"]
    torch.manual_seed(0)
    batch = torch.randn(micro_batches * rows, options["width"], device=device)
    target = torch.zeros_like(batch)
    results: dict[str, Any] = {}
    for name in options["placements"]:
        schedule_name, torch_class, chunks = PLACEMENTS[name]
        num_stages = world_size * chunks
        mine = list(pipecomm.make_schedule(schedule_name, world_size, max(micro_batches, world_size) * world_size,
                                           chunks).stages_of(rank))
        modules = [build_stage(stage, options, device) for stage in mine]
        first, last = 0 in mine, num_stages - 1 in mine
        pipe = pipecomm.Pipeline(modules, stage=mine, num_stages=num_stages, loss_fn=mse,
                                 micro_batches=micro_batches, schedule=schedule_name, device=device,
                                 timeout=float(options["timeout"]))
        ours = median_call_ms(lambda: pipe.forward(batch), options["warmup"], options["iters"], device)
        ours_output = pipe.forward(batch)
        pipe.close()
        # The last stage's rank checks the output against the stages run in turn on this one process.
        agrees = None
        if last:
            with torch.no_grad():
                expected = batch
                for stage in range(num_stages):
                    expected = build_stage(stage, options, device)(expected)
            agrees = bool(torch.allclose(ours_output, expected, rtol=1e-4, atol=1e-5))
        results[name] = {"pipecomm_ms": ours, "torch_ms": None, "outputs_agree": agrees}
        if torch_class is None:
            continue

        stages = [pipelining.PipelineStage(module, stage, num_stages, device) for module, stage in zip(modules, mine)]
        schedule = getattr(pipelining, torch_class)(stages if chunks > 1 else stages[0], micro_batches, loss_fn=mse)

        def torch_eval():
            with torch.no_grad():
                return schedule.eval(*((batch,) if first else ()), **({"target": target} if last else {}))

        theirs = median_call_ms(torch_eval, options["warmup"], options["iters"], device)
        theirs_output = torch_eval()  # on every rank: each takes part in the pipeline
        if last:
            agrees = agrees and bool(torch.allclose(ours_output, theirs_output, rtol=1e-4, atol=1e-5))
        results[name].update(torch_ms=theirs, outputs_agree=agrees)
    torch.distributed.barrier()
    return {"env": environment(device) if rank == 0 else None, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--placements", default="looped,interleaved,v", help="comma list of " + ", ".join(PLACEMENTS))
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers-per-stage", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo, one thread each")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: the control flow only")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args()
    if args.smoke:
        args.cpu, args.width, args.micro_batch, args.micro_batches, args.warmup, args.iters = True, 16, 2, 4, 1, 2
    args.placements = [name.strip() for name in args.placements.split(",")]
    unknown = sorted(set(args.placements) - set(PLACEMENTS))
    if unknown:
        parser.error(f"unknown placements {unknown}; known: {', '.join(PLACEMENTS)}")
    if not args.cpu and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} CUDA devices (or --cpu)")
    if args.cpu:
        torch.set_num_threads(1)
    outcome = spawn_ranks(run_rank, args.ranks, (vars(args),), timeout=args.timeout)
    print_environment(outcome[0]["env"])
    print(f"# {args.ranks} ranks, {args.micro_batches} micro-batches of {args.micro_batch} x {args.width}, "
          f"{args.layers_per_stage} block(s) per stage; median ms per call, the slower rank")
    rows = []
    for name in args.placements:
        ours = max(outcome[rank]["results"][name]["pipecomm_ms"] for rank in outcome)
        theirs = None if PLACEMENTS[name][1] is None else max(outcome[rank]["results"][name]["torch_ms"] for rank in outcome)
        # Only the last stage's rank checks (the others report None).
        agree = [outcome[rank]["results"][name]["outputs_agree"] for rank in outcome]
        rows.append({"placement": name, "pipecomm_ms": ours, "torch_ms": theirs, "torch/pipecomm": theirs / ours if theirs else None,
                     "outputs_agree": True in agree and False not in agree})
    print_table(rows, ["placement", "pipecomm_ms", "torch_ms", "torch/pipecomm", "outputs_agree"])
    if args.json:
        write_json(args.json, {"env": outcome[0]["env"], "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
