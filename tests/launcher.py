"""Runs a script on ranks as torchrun does, many times over, forking each world from one process that imported torch.

Each rank runs the script as ``__main__`` with torchrun's environment and then exits the way any Python program
does (atexit handlers, thread shutdown, interpreter finalization), which is what an exit test must watch; only the
imports, a few seconds per process, are paid once instead of once per rank and run.

What the launcher imported is frozen out of the garbage collector's reach before the forks (``gc.freeze``, as a fork
server does): interpreter finalization runs 3 to 4 full collections, each walking torch's 300,000 objects and, in a
forked rank, writing to every page it shares with the launcher (copy-on-write). That cost 1 to 2 CPU seconds per
rank per run, nearly all of a run's time; the script's own objects (tensors, process groups, Pipelines) are still
collected at its exit as in any program.

    python tests/launcher.py --nproc 2 --runs 10 script.py

Exits 0 when every rank of every run exited 0; otherwise prints each failed rank's run and status and exits 1.
Without a script it serves several, its imports paid once: each line ``RUNS SCRIPT`` read from standard input is
answered on standard output with a line, ``ok`` or the failed ranks' runs and statuses (the ranks' own standard
output goes to standard error); it exits 0 at the end of its input.
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import signal
import sys

# Imported before the fork, once for every rank and run; torch._dynamo is what an optimizer's first step imports.
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401

import pipecomm  # noqa: F401

from ports import free_port


def run_rank(script: str, rank: int, world_size: int, port: int, serving: bool) -> None:
    """In the forked child: become rank ``rank`` and run the script; never returns to the launcher's loop."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if serving:  # standard output carries the launcher's answers
        os.dup2(2, 1)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    # Unwinds to the top level, as the script's own exception would: the interpreter finalizes as after any script.
    sys.exit(0)


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def run_script(script: str, nproc: int, runs: int, serving: bool) -> list[str]:
    """Runs the script ``runs`` times on ``nproc`` ranks forked from this process; each failed rank's run and status."""
    failures = []
    for run in range(runs):
        port = free_port()
        children = {}
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                run_rank(script, rank, nproc, port, serving)
            children[pid] = rank
        for pid, rank in children.items():
            _, status = os.waitpid(pid, 0)
            if status != 0:
                failures.append(f"run {run}, rank {rank}: {describe(status)}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("script", nargs="?", help="without it: serve 'RUNS SCRIPT' lines from standard input")
    args = parser.parse_args()
    gc.freeze()
    if args.script is None:
        for line in iter(sys.stdin.readline, ""):
            runs, script = line.split(maxsplit=1)
            failures = run_script(script.rstrip("\n"), args.nproc, int(runs), serving=True)
            print("; ".join(failures) or "ok", flush=True)
        return 0
    failures = run_script(args.script, args.nproc, args.runs, serving=False)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
