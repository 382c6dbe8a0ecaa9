"""What is live on a GPU at its peak, from an allocator snapshot (bench/e2e.py --memory-history), by who allocated it.

    python scripts/peak_memory.py SNAPSHOT.pickle [--top 15] [--depth 2]

Replays the snapshot's allocation events to find the moment the most bytes were allocated, then sums the blocks live
at that moment by the innermost Python frames of their allocation that lie in pipecomm, bench or the model (torch's
own frames skipped), so that "W-pass stash" and "received activations" show as separate lines. Blocks allocated
before the recording began have no events and show as one line, "before the recording".
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys

# Frames from these files say nothing about which part of the pipeline asked for the memory.
_UNINFORMATIVE = ("torch/", "contextlib.py", "functools.py", "<frozen", "threading.py")


def _where(frames: list[dict], depth: int) -> str:
    useful = [f for f in frames if not any(part in f.get("filename", "") for part in _UNINFORMATIVE)]
    chosen = (useful or frames)[:depth]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in chosen) or "?"


def peak_breakdown(snapshot: dict, device: int, depth: int) -> tuple[int, int, dict[str, int]]:
    """(peak bytes, bytes at the peak allocated before the recording began, bytes live at the peak by allocation
    site). A block from before the recording shows only by its free, whose size the event gives: counting those frees
    too makes the total exact at every moment, not just the recorded blocks."""
    events = snapshot["device_traces"][device]
    at_end = sum(block["size"] for segment in snapshot["segments"] if segment["device"] == device
                 for block in segment["blocks"] if block["state"] == "active_allocated")
    change = sum(event["size"] if event["action"] == "alloc" else -event["size"]
                 for event in events if event["action"] in ("alloc", "free_completed"))
    total = peak = at_end - change  # what was allocated when the recording began
    live: dict[int, tuple[int, str]] = {}
    peak_live: dict[int, tuple[int, str]] = {}
    for event in events:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, _where(event.get("frames", []), depth))
            total += size
        elif action == "free_completed":
            live.pop(address, None)
            total -= size
        if total > peak:
            peak, peak_live = total, dict(live)
    by_site: dict[str, int] = collections.Counter()
    for size, site in peak_live.values():
        by_site[site] += size
    return peak, peak - sum(by_site.values()), by_site


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=2, help="frames per allocation site")
    args = parser.parse_args()
    for path in args.snapshots:
        with open(path, "rb") as file:
            snapshot = pickle.load(file)
        for device, events in enumerate(snapshot["device_traces"]):
            if not events:
                continue
            peak, before, by_site = peak_breakdown(snapshot, device, args.depth)
            print(f"{path} cuda:{device}: peak {peak / 1e9:.3f} GB, of which {before / 1e9:.3f} GB allocated "
                  "before the recording")
            for site, size in sorted(by_site.items(), key=lambda item: -item[1])[: args.top]:
                print(f"  {size / 1e9:8.3f} GB  {site}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
