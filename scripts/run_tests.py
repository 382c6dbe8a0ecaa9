"""Runs the pytest suite as N shards side by side (one per core by default), summed up in one line.

    python scripts/run_tests.py [--record-durations] [pytest arguments...]   # PYTEST_SHARDS=1: one plain pytest

Each shard is ``pytest --shard i/N`` (tests/conftest.py): the tests dealt so that the shards take about the same
time, by each test's duration in tests/durations.json, which ``--record-durations`` rewrites from this run. Much of a
test's time is its ranks waiting on one another, which another shard's ranks fill. Shard 1 reports as it goes, the
others' reports follow, then one line of totals. Exits with the first failing shard's status, 5 if no shard ran a
test (as pytest does), else 0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
NO_TESTS_RAN = 5


def shard_count() -> int:
    chosen = os.environ.get("PYTEST_SHARDS")
    if chosen is None:
        # One per core: one more measured no faster from a fresh clone (2 cores: pytest 507 s against 489 s).
        return max(1, min(os.cpu_count() or 1, 8))
    if not chosen.isdigit() or int(chosen) < 1:
        raise SystemExit(f"PYTEST_SHARDS must be a positive integer, not {chosen!r}")
    return int(chosen)


def main(arguments: list[str]) -> int:
    record = "--record-durations" in arguments
    arguments = [argument for argument in arguments if argument != "--record-durations"]
    shards = shard_count()
    command = [sys.executable, "-m", "pytest", *arguments]
    if shards == 1 and not record:
        return subprocess.run(command, cwd=ROOT).returncode
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipecomm-shards-") as logs:
        paths = [Path(logs) / f"shard-{index}.log" for index in range(1, shards + 1)]
        timings = [Path(logs) / f"durations-{index}.json" for index in range(1, shards + 1)]
        processes = [subprocess.Popen([*command, "--shard", f"{index}/{shards}", "--record-durations", str(timing)],
                                      cwd=ROOT, stdout=path.open("w"), stderr=subprocess.STDOUT)
                     for index, (path, timing) in enumerate(zip(paths, timings), start=1)]
        _follow(paths[0], processes)
        codes = [process.wait() for process in processes]
        reports = [path.read_text() for path in paths]
        if record:
            _write_durations(timings)
    for index, report in enumerate(reports[1:], start=2):
        print(f"---------- shard {index}/{shards} ----------\n{report}", end="")
    totals: Counter[str] = Counter()
    for report in reports:
        totals.update(_outcomes(report))
    failing = [code for code in codes if code not in (0, NO_TESTS_RAN)]
    status = failing[0] if failing else NO_TESTS_RAN if all(code == NO_TESTS_RAN for code in codes) else 0
    summary = ", ".join(f"{count} {kind}" for kind, count in totals.items() if kind != "deselected") or "no tests ran"
    print(f"pytest, {shards} shards side by side: {summary} in {time.monotonic() - started:.0f} s "
          f"(exit statuses {codes})")
    return status


def _write_durations(timings: list[Path]) -> None:
    """tests/durations.json: each test's seconds in this run, over the entries of tests this run did not run."""
    target = ROOT / "tests" / "durations.json"
    durations = json.loads(target.read_text()) if target.exists() else {}
    for timing in timings:
        if timing.exists():
            durations.update({test: round(seconds, 2) for test, seconds in json.loads(timing.read_text()).items()})
    target.write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")
    print(f"wrote {len(durations)} tests' durations to {target.relative_to(ROOT)}")


def _follow(path: Path, processes: list[subprocess.Popen]) -> None:
    """Copies the first shard's report to standard output as it grows, until every shard has ended."""
    with path.open() as report:
        while True:
            done = all(process.poll() is not None for process in processes)
            sys.stdout.write(report.read())
            sys.stdout.flush()
            if done:
                return
            time.sleep(0.5)


def _outcomes(report: str) -> Counter[str]:
    lines = [line for line in report.splitlines() if OUTCOME.search(line) and " in " in line]
    return Counter({kind.rstrip("s") if kind == "errors" else kind: int(count)
                    for count, kind in OUTCOME.findall(lines[-1])}) if lines else Counter()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
