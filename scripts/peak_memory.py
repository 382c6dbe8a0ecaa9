"""What is live on a GPU at its peak, from an allocator snapshot (bench/e2e.py --memory-history), by who allocated it.

    python scripts/peak_memory.py SNAPSHOT.pickle [--top 15] [--depth 2] [--pools] [--steady]

Replays the snapshot's allocation events to find the moment the most bytes were allocated, then sums the blocks live
at that moment by the innermost Python frames of their allocation that lie in pipecomm, bench or the model (torch's
own frames skipped), so that "W-pass stash" and "received activations" show as separate lines. Blocks allocated
before the recording began have no events and show as one line, "before the recording".
"""

from __future__ import annotations

import argparse
import bisect
import collections
import pickle
import sys

# Frames from these files say nothing about which part of the pipeline asked for the memory.
_UNINFORMATIVE = ("torch/", "contextlib.py", "functools.py", "<frozen", "threading.py")


def _where(frames: list[dict], depth: int) -> str:
    useful = [f for f in frames if not any(part in f.get("filename", "") for part in _UNINFORMATIVE)]
    chosen = (useful or frames)[:depth]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in chosen) or "?"


def peak_breakdown(snapshot: dict, device: int, depth: int, steady: bool = False) -> tuple[int, int, dict[str, int]]:
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
    start = _after_last_capture(snapshot, device) if steady else 0
    if steady:
        peak = 0
    for index, event in enumerate(events):
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, _where(event.get("frames", []), depth))
            total += size
        elif action == "free_completed":
            live.pop(address, None)
            total -= size
        if total > peak and index >= start:
            peak, peak_live = total, dict(live)
    by_site: dict[str, int] = collections.Counter()
    for size, site in peak_live.values():
        by_site[site] += size
    return peak, peak - sum(by_site.values()), by_site


def _after_last_capture(snapshot: dict, device: int) -> int:
    """The index of the event after the last one in a CUDA graphs' pool (a capture's last allocation or free): from
    there on the graphs replay, and their pool's blocks no longer show as events."""
    segments = [(segment["address"], segment["address"] + segment["total_size"]) for segment in snapshot["segments"]
                if segment["device"] == device and tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)]
    last = -1
    for index, event in enumerate(snapshot["device_traces"][device]):
        if any(begin <= event["addr"] < end for begin, end in segments):
            last = index
    return last + 1


def pool_breakdown(snapshot: dict, device: int) -> list[tuple[tuple, int, int, int, int]]:
    """Per memory pool at the end of the recording (the default one is (0, 0); a CUDA graphs' pool has its own id):
    (pool id, segments, reserved bytes, the most bytes allocated in them at once over the recording, their largest
    free block at the end). Reserved well above the most allocated is the pool's fragmentation."""
    segments = [segment for segment in snapshot["segments"] if segment["device"] == device]
    owner = {}  # segment start -> pool id
    for segment in segments:
        owner[segment["address"]] = tuple(segment.get("segment_pool_id", (0, 0)))
    starts = sorted(owner)
    ends = {segment["address"]: segment["address"] + segment["total_size"] for segment in segments}

    def pool_of(address: int) -> tuple | None:
        index = bisect.bisect_right(starts, address) - 1
        return owner[starts[index]] if index >= 0 and address < ends[starts[index]] else None

    allocated: dict[tuple, int] = collections.Counter()
    most: dict[tuple, int] = collections.Counter()
    for event in snapshot["device_traces"][device]:
        pool = pool_of(event["addr"])
        if pool is None or event["action"] not in ("alloc", "free_completed"):
            continue
        allocated[pool] += event["size"] if event["action"] == "alloc" else -event["size"]
        most[pool] = max(most[pool], allocated[pool])
    rows = []
    for pool in sorted(set(owner.values())):
        mine = [segment for segment in segments if tuple(segment.get("segment_pool_id", (0, 0))) == pool]
        free = [block["size"] for segment in mine for block in segment["blocks"] if block["state"] == "inactive"]
        rows.append((pool, len(mine), sum(segment["total_size"] for segment in mine), most[pool], max(free, default=0)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=2, help="frames per allocation site")
    parser.add_argument("--pools", action="store_true", help="reserved and allocated bytes per memory pool")
    parser.add_argument("--steady", action="store_true",
                        help="the peak after the last CUDA graph capture (the pools' blocks are not counted then)")
    args = parser.parse_args()
    for path in args.snapshots:
        with open(path, "rb") as file:
            snapshot = pickle.load(file)
        for device, events in enumerate(snapshot["device_traces"]):
            if not events:
                continue
            peak, before, by_site = peak_breakdown(snapshot, device, args.depth, args.steady)
            print(f"{path} cuda:{device}: peak {peak / 1e9:.3f} GB{' after the last capture' if args.steady else ''}"
                  f", of which {before / 1e9:.3f} GB allocated before the recording")
            for site, size in sorted(by_site.items(), key=lambda item: -item[1])[: args.top]:
                print(f"  {size / 1e9:8.3f} GB  {site}")
            if args.pools:
                for pool, count, reserved, most, largest_free in pool_breakdown(snapshot, device):
                    print(f"  pool {pool}: {count} segments, {reserved / 1e9:.3f} GB reserved, at most "
                          f"{most / 1e9:.3f} GB allocated in them at once (recorded), largest free block "
                          f"{largest_free / 1e9:.3f} GB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
