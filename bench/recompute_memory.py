"""One GPU: peak memory and time of 1F1B's first stage with and without recomputation (Pipeline(recompute=...)).

The stage is stage 0 of e2e.py's 8-layer GPT stack split into p stages (8 / p layers, bf16), on the compute config
by default. At its peak, 1F1B's first stage holds p micro-batches between forward and backward, so each round runs
p forwards, then the p backwards (random output gradients), as that stage does in its warm-up and first steady
steps. Each forward sends nothing but has its output freed as the executor frees a sent output (when nothing
autograd saved shares its storage), so the memory is what the pipeline keeps. Modes: none; stage
(``recompute=True``: each stage forward recomputed during its backward); layers (the callable picking each GPT
block). Per mode: peak = torch.cuda.max_memory_allocated over the timed rounds; above_base = peak minus what is
allocated before a round (weights, gradients, the batch); kept = the bytes of the storages autograd keeps per
micro-batch, parameters aside (counted on any device); ms per micro-batch forward + backward (CUDA events).
--smoke runs toy sizes on the CPU (no memory counter there but kept) to check the control flow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecomm.runtime import stage_runner  # noqa: E402
from pipecomm.runtime.recompute import checkpoint_stages  # noqa: E402
from _common import environment, print_environment, print_table, write_json  # noqa: E402
from e2e import Block, build_chunk, config_named, make_batch  # noqa: E402

LAYERS = 8  # e2e.py's stack
MODES = {"none": False, "stage": True, "layers": lambda module: isinstance(module, Block)}
COLUMNS = ["p", "mode", "layers", "peak_GiB", "above_base_GiB", "kept_MiB", "ms_per_micro_batch", "peak/none",
           "time/none"]


class _Kept:
    """Adds up the bytes of each new storage autograd saves during a forward, parameters aside."""

    def __init__(self, parameters: set[int]):
        self.parameters = parameters
        self.pointers: set[int] = set()
        self.nbytes = 0

    def observe(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self.pointers and pointer not in self.parameters:
            self.pointers.add(pointer)
            self.nbytes += tensor.untyped_storage().nbytes()
        return tensor.detach()  # as autograd would hold it: a new tensor on the same storage


def measure(config_name: str, p: int, mode: str, device: torch.device, dtype: torch.dtype, warmup: int,
            rounds: int) -> dict:
    config = config_named(config_name, "gpu" if device.type == "cuda" else "smoke")
    layers = range(LAYERS // p)
    module = build_chunk(layers, config, device, dtype)
    undo = checkpoint_stages([module], MODES[mode])
    inputs, _ = make_batch(config, device, dtype)
    micro_batches = inputs[: p * config.micro_batch_size].chunk(p)  # the first stage's inputs need no gradient
    output_grads = [torch.randn_like(x) for x in micro_batches]
    parameters = {param.untyped_storage().data_ptr() for param in module.parameters()}
    kept: list[int] = []

    def one_round() -> None:
        outputs = []
        kept.clear()
        for x in micro_batches:
            saved = _Kept(parameters)
            with saved.observe():
                output = module(x)
            stage_runner.free_data(stage_runner._held_only_by_themselves([output]))  # as after its send
            outputs.append(output)
            kept.append(saved.nbytes)
        for output, grad in zip(outputs, output_grads):
            stage_runner.run_backward([output], [grad], list(module.parameters()), keep_graph=False)

    cuda = device.type == "cuda"
    for _ in range(warmup):
        one_round()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    samples = []
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_round()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / p)
        else:
            started = time.perf_counter()
            one_round()
            samples.append((time.perf_counter() - started) * 1e3 / p)
    row = {"p": p, "mode": mode, "layers": len(layers), "kept_MiB": statistics.mean(kept) / 2**20,
           "ms_per_micro_batch": statistics.median(samples)}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        row.update(peak_GiB=peak / 2**30, above_base_GiB=(peak - base) / 2**30)
    undo()
    del module, micro_batches, output_grads
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="compute")
    parser.add_argument("--stages", default="2,4", help="pipeline sizes p: stage 0 holds 8 / p layers and p "
                                                        "micro-batches in flight")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: the control flow only")
    parser.add_argument("--json", help="write the environment and rows here")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    env = environment(device)
    print_environment(env)
    rows = []
    for p in (int(value) for value in args.stages.split(",")):
        measured = [measure(args.config, p, mode, device, dtype, args.warmup, args.rounds) for mode in modes]
        baseline = next((row for row in measured if row["mode"] == "none"), None)
        for row in measured:
            if baseline and row.get("peak_GiB") is not None:
                row["peak/none"] = row["peak_GiB"] / baseline["peak_GiB"]
            if baseline:
                row["time/none"] = row["ms_per_micro_batch"] / baseline["ms_per_micro_batch"]
        rows += measured
    print(f"# {args.config}: 1F1B stage 0 of p stages, p micro-batches in flight, on {device}")
    print_table(rows, COLUMNS)
    if args.json:
        write_json(args.json, {"env": env, "config": args.config, "rows": rows})


if __name__ == "__main__":
    main()
