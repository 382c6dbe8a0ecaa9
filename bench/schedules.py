"""Simulated efficiency and activation memory of every schedule for given per-stage costs, at p = 2, 4, 8.

Costs are one rank's share of the model per micro-batch (what a 1f1b stage computes): F, I, W, and B = I + W.
The default costs are issue 18's measurements of one stage of the compute-bound GPT config on 2x H200 (ms).
zb-h2 and zb-v are built by list scheduling for these costs; "plan 1x" and "plan 2x" are plan_schedule's choice at
1x and 2x 1f1b's activation memory; "bound 1x" and "bound 2x" the most efficiency any schedule with one or two stages
per rank can reach there. Efficiency = useful compute / (ranks x step time);
memory = the fullest rank's peak activations in units of one 1f1b stage's micro-batch (1f1b: p).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecomm.schedules.planner import plan_schedule  # noqa: E402
from pipecomm.schedules.schedule import make_schedule  # noqa: E402
from pipecomm.schedules.simulation import simulate  # noqa: E402

CASES = ((2, 8), (4, 8), (8, 16), (4, 16), (8, 32))
SCHEDULE_ARGUMENTS = {  # name -> (stages per rank, builds for the costs)
    "gpipe": (1, False), "1f1b": (1, False), "interleaved-1f1b": (2, False), "zb-h1": (1, False),
    "zb-h2": (1, True), "zb-v": (2, True),
}
PLAN_MEMORY_LIMITS = (1.0, 2.0)  # plan_schedule's memory_limit, in units of 1f1b's peak


def table(costs: dict[str, float]) -> list[dict]:
    costs = {**costs, "B": costs["I"] + costs["W"]}
    rows = []
    for num_ranks, micro_batches in CASES:
        row: dict = {"p": num_ranks, "m": micro_batches}
        schedules = {name: make_schedule(name, num_ranks, micro_batches, chunks, costs=costs if for_costs else None)
                     for name, (chunks, for_costs) in SCHEDULE_ARGUMENTS.items()}
        for limit in PLAN_MEMORY_LIMITS:
            schedules[f"plan {limit:g}x"] = plan_schedule(num_ranks, micro_batches, costs, memory_limit=limit)
        for name, schedule in schedules.items():
            result = simulate(schedule, costs)
            row[name] = round(1.0 - result.bubble_fraction, 3)
            row[f"{name} mem"] = round(max(result.peak_memory), 2)
        for limit in PLAN_MEMORY_LIMITS:
            row[f"bound {limit:g}x"] = round(efficiency_bound(num_ranks, micro_batches, costs, limit), 4)
        rows.append(row)
    return rows


def efficiency_bound(num_ranks: int, micro_batches: int, costs: dict[str, float], memory_limit: float) -> float:
    """An upper bound on the efficiency of any schedule with one or two stages per rank under ``memory_limit``.

    In halves of the model per rank (the V's or two looped chunks; one stage per rank only waits longer), the rank
    whose deepest stage lies r stages before the last gets its first output gradient no sooner than 2p forwards and
    r input-gradient passes after the start; until then only forwards can run, at most as many as its memory holds,
    and none before its first input, r forwards in. Every rank runs the same m (F + I + W) of work.
    """
    forward, input_grad = costs["F"] / 2, costs["I"] / 2
    held = int(2 * num_ranks * memory_limit + 1e-9)  # activations of half the rank's share
    idle = max(max(rank * input_grad + (2 * num_ranks - held) * forward, rank * forward) for rank in range(num_ranks))
    work = micro_batches * (costs["F"] + costs["I"] + costs["W"])
    return work / (work + idle)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--costs", default="2.95,4.85,2.25", help="F,I,W of one rank's share per micro-batch")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    forward, input_grad, weight_grad = (float(value) for value in args.costs.split(","))
    rows = table({"F": forward, "I": input_grad, "W": weight_grad})
    names = [*SCHEDULE_ARGUMENTS, *(f"plan {limit:g}x" for limit in PLAN_MEMORY_LIMITS)]
    bounds = [f"bound {limit:g}x" for limit in PLAN_MEMORY_LIMITS]
    print(f"# efficiency (peak activation memory, 1f1b = p) at F={forward}, I={input_grad}, W={weight_grad}")
    print("| p, m | " + " | ".join(names + bounds) + " |")
    print("|---" * (len(names) + len(bounds) + 1) + "|")
    for row in rows:
        cells = [f"{row[name]:.3f} ({row[f'{name} mem']:g})" for name in names]
        cells += [f"{row[name]:.3f}" for name in bounds]
        print(f"| {row['p']}, {row['m']} | " + " | ".join(cells) + " |")
    if args.json:
        from _common import write_json

        write_json(args.json, {"costs": {"F": forward, "I": input_grad, "W": weight_grad}, "rows": rows})


if __name__ == "__main__":
    main()
