"""What is live on a GPU at its peak, from an allocator snapshot (bench/e2e.py --memory-history), grouped by who allocated it.

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
    """(peak bytes, bytes before the recording, bytes live at the peak by allocation site)."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str]] = {}
    allocated = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for event in events:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, _where(event.get("frames", []), depth))
            allocated += size
        elif action == "free_completed" and address in live:
            allocated -= live.pop(address)[0]
        if allocated > peak:
            peak, peak_live = allocated, dict(live)
    at_end = sum(block["size"] for segment in snapshot["segments"] if segment["device"] == device
                 for block in segment["blocks"] if block["state"] == "active_allocated")
    before = at_end - allocated  # what was already allocated when the recording began and is still
    by_site: dict[str, int] = collections.Counter()
    for size, site in peak_live.values():
        by_site[site] += size
    return peak + before, before, by_site


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
            print(f"{path} cuda:{device}: peak {peak / 1e9:.3f} GB, of which {before / 1e9:.3f} GB before the recording")
            for site, size in sorted(by_site.items(), key=lambda item: -item[1])[: args.top]:
                print(f"  {size / 1e9:8.3f} GB  {site}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
