"""Fault injection on CPU ranks: how long after a fault each rank raises, and what its error says (tests/test_failures.py's cases)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import environment, print_environment, print_table, write_json  # noqa: E402
from test_failures import CASES, TIMEOUT, run_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = environment(torch.device("cpu"))
    print_environment(env)
    print(f"# every Pipeline's timeout: {TIMEOUT:g} s; times count from the fault's injection")
    rows = []
    for name in args.cases.split(","):
        with tempfile.TemporaryDirectory() as directory:
            outcomes = run_case(name, Path(directory))
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                rows.append({"fault": name, "rank": rank, "error": "(killed)"})
                continue
            seconds, error_type, text, refused = outcome
            rows.append({"fault": name, "rank": rank, "raised after (s)": seconds, "error": error_type,
                         "refuses next call": refused, "message": text})
    print_table([{**row, "message": row.get("message", "")[:120]} for row in rows],
                ["fault", "rank", "raised after (s)", "error", "refuses next call", "message"])
    if args.json:
        write_json(args.json, {"environment": env, "results": rows})


if __name__ == "__main__":
    main()
