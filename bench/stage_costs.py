"""One GPU: F, I and W of one stage (layers / 2 of e2e.py's 8-layer GPT stack) per micro-batch, for each e2e config.

Runs a one-rank Pipeline with schedule zb-h1 and device_timing=True (CUDA events around every pass), so the passes
are exactly what the executor runs in a pipeline, deferred Linear weight gradients included. Reports the median
over the timed steps' micro-batches, then the simulated efficiency of every schedule and plan at p = 2, 4, 8 for
those costs (bench/schedules.py's table). --cpu runs toy sizes on the CPU (host clock) to check the control flow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pipecomm  # noqa: E402
from pipecomm.runtime import step_trace  # noqa: E402
from _common import environment, print_environment, write_json  # noqa: E402
from e2e import build_chunk, config_named, make_batch, mse_loss  # noqa: E402
from schedules import table  # noqa: E402

STAGE_LAYERS = 4  # one of two stages of e2e.py's 8 layers


def stage_costs(config_name: str, device: torch.device, dtype: torch.dtype, steps: int) -> dict[str, float]:
    config = config_named(config_name, "gpu" if device.type == "cuda" else "smoke")
    module = build_chunk(range(STAGE_LAYERS), config, device, dtype)
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, loss_fn=mse_loss, micro_batches=config.micro_batches,
                             schedule="zb-h1", device=device, device_timing=device.type == "cuda")
    inputs, target = make_batch(config, device, dtype)
    durations: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for step in range(steps + 2):  # the first two warm up
        pipe.step(inputs, target=target)
        module.zero_grad(set_to_none=True)
        if step < 2:
            continue
        for start, end, action in step_trace.compute_spans(pipe._executor):
            durations[action.kind].append((end - start) * 1e3)
    pipe.close()
    return {kind: statistics.median(times) for kind, times in durations.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="compute,medium,overhead")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="toy sizes on the CPU: the control flow only")
    parser.add_argument("--json", help="write the costs and tables here")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    env = environment(device)
    print_environment(env)
    results = {}
    for name in args.configs.split(","):
        costs = stage_costs(name, device, dtype, args.steps)
        rows = table(costs)
        results[name] = {"costs_ms": costs, "simulated": rows}
        print(f"# {name}: one stage ({STAGE_LAYERS} layers) per micro-batch: F {costs['F']:.3f} ms, "
              f"I {costs['I']:.3f} ms, W {costs['W']:.3f} ms")
        columns = [key for key in rows[0] if key not in ("p", "m") and not key.endswith(" mem")]
        print("| p, m | " + " | ".join(columns) + " |")
        for row in rows:
            print(f"| {row['p']}, {row['m']} | " + " | ".join(f"{row[key]:.3f}" for key in columns) + " |")
    if args.json:
        write_json(args.json, {"env": env, "configs": results})


if __name__ == "__main__":
    main()
