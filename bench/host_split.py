"""The host cost of a channel's send and of its recv, measured apart: where a small message's latency goes.

Rank 0 sends a round of messages into a channel with room for all of them (``--slots``), so no send
waits for the peer; then rank 1 receives them, all arrived, so no receive waits either. The median
round gives microseconds per call. The layout repeats, so after the first rounds every message goes
straight into a posted buffer (the ``direct`` column counts them). With PIPECOMM_IPC_HOST_TIMING=1 it
also prints the channel's own phases of each call. ``--smoke`` runs the same over shared memory on CPU
processes.

Then the two ranks play ping-pong with the same channel (rank 1 echoes what it receives): the one-way
time, and each rank's host time in its send and in its recv, where the echoing rank's two calls follow
each other on the path of every round trip. Last, rank 1 echoes each message ``--late-ms`` after it
arrived, so rank 0's receive sleeps that long: the round trip beyond the delay shows how soon a receive
that slept notices its message.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from _common import environment, print_environment, print_table, spawn_ranks, start_rank, write_json

# (label, total bytes, tensors): one small tensor, and a message of several tensors
MESSAGES = [("1 x 4 KB", 4096, 1), ("8 x 8 KB", 65536, 8)]


def run_rank(rank: int, world_size: int, store_port: int, report, options: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import pipecomm.transport as transport

    device, store = start_rank(rank, world_size, store_port, options["smoke"], options["timeout"], options["share_gpu"])
    backend = "shm" if options["smoke"] else "ipc"
    results = {}
    for label, total_bytes, count in MESSAGES:
        message = [torch.ones(total_bytes // 4 // count, device=device) for _ in range(count)]
        channel = transport.connect(1 - rank, backend=backend, device=device, timeout=options["timeout"],
                                    num_slots=options["slots"])
        per_call = []
        for round_index in range(options["rounds"]):
            key = f"{label}/{round_index}"
            if rank == 0:
                started = time.perf_counter()
                for _ in range(options["per_round"]):
                    channel.send(message)
                per_call.append((time.perf_counter() - started) / options["per_round"] * 1e6)
                store.set(f"sent/{key}", "1")
                store.wait([f"received/{key}"])
            else:
                store.wait([f"sent/{key}"])
                started = time.perf_counter()
                for _ in range(options["per_round"]):
                    channel.recv()
                per_call.append((time.perf_counter() - started) / options["per_round"] * 1e6)
                store.set(f"received/{key}", "1")
        direct = channel.direct_messages if backend == "ipc" else (0, 0)
        phases = channel.host_phase_times()["send" if rank == 0 else "recv"] if backend == "ipc" else []
        results[label] = {"us": statistics.median(per_call[2:]), "rounds_us": per_call, "direct": direct[rank],
                          "phases_us": {name: total / calls for name, total, calls in phases if calls},
                          "ping_pong": ping_pong(rank, channel, message, store, label, options),
                          "late_echo_us": late_echo(rank, channel, message, options)}
        channel.close()
    dist.barrier()
    return {"env": environment(device) if rank == 0 else None, "results": results}


def late_echo(rank: int, channel: Any, message: list[torch.Tensor], options: dict[str, Any]) -> float | None:
    """On rank 0, the median round trip beyond rank 1's delay before it echoes (None on rank 1)."""
    delay = options["late_ms"] / 1e3
    extra = []
    for _ in range(options["rounds"] * 2):
        if rank == 0:
            started = time.perf_counter()
            channel.send(message)
            channel.recv()
            extra.append((time.perf_counter() - started - delay) * 1e6)
        else:
            received = channel.recv()
            time.sleep(delay)
            channel.send(received)
    return statistics.median(extra[2:]) if rank == 0 else None


def ping_pong(rank: int, channel: Any, message: list[torch.Tensor], store: Any, label: str,
              options: dict[str, Any]) -> dict[str, float]:
    """Rank 0 sends and then receives, rank 1 receives and echoes; medians over the rounds after the
    first two: the one-way time (half of rank 0's round trip) and each call's host time on this rank."""
    send_us, recv_us, round_trip_us = [], [], []
    for round_index in range(options["rounds"]):
        key = f"{label}/ping/{round_index}"
        store.set(f"{key}/{rank}", "1")
        store.wait([f"{key}/{1 - rank}"])
        started = time.perf_counter()
        for _ in range(options["per_round"]):
            if rank == 0:
                before = time.perf_counter()
                channel.send(message)
                between = time.perf_counter()
                channel.recv()
                after = time.perf_counter()
                send_us.append(between - before)
                recv_us.append(after - between)
            else:
                before = time.perf_counter()
                received = channel.recv()
                between = time.perf_counter()
                channel.send(received)
                after = time.perf_counter()
                recv_us.append(between - before)
                send_us.append(after - between)
        round_trip_us.append((time.perf_counter() - started) / options["per_round"] * 1e6)
    skip = 2 * options["per_round"]
    return {"one_way_us": statistics.median(round_trip_us[2:]) / 2,
            "send_us": statistics.median(send_us[skip:]) * 1e6, "recv_us": statistics.median(recv_us[skip:]) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=64, help="channel slots: room for a whole round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds; the first two are not counted")
    parser.add_argument("--per-round", type=int, default=48, help="messages per round (less than --slots)")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--smoke", action="store_true", help="shared memory between CPU processes")
    parser.add_argument("--late-ms", type=float, default=3.0, help="rank 1's delay before each echo of the last phase")
    parser.add_argument("--share-gpu", action="store_true", help="both ranks on cuda:0 (one GPU), over CUDA IPC")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args()
    if args.per_round >= args.slots or args.rounds < 3:
        parser.error("--per-round must be below --slots, and --rounds at least 3")
    outcome = spawn_ranks(run_rank, 2, (vars(args),), timeout=args.timeout)
    env = outcome[0]["env"]
    print_environment(env)
    print(f"# host microseconds per call, median of rounds 3-{args.rounds} of {args.per_round} messages; "
          f"send on rank 0 with nothing waiting, recv on rank 1 with everything arrived")
    rows = []
    for label, _, _ in MESSAGES:
        send, receive = outcome[0]["results"][label], outcome[1]["results"][label]
        rows.append({"message": label, "send_us": send["us"], "recv_us": receive["us"],
                     "direct_sent": send["direct"], "direct_received": receive["direct"]})
    print_table(rows, ["message", "send_us", "recv_us", "direct_sent", "direct_received"])
    print("# ping-pong, rank 1 echoing: one-way = half of rank 0's round trip; median host µs of each call "
          "(the receive includes the wait for the peer's message)")
    ping_rows = []
    for label, _, _ in MESSAGES:
        first, echo = outcome[0]["results"][label]["ping_pong"], outcome[1]["results"][label]["ping_pong"]
        ping_rows.append({"message": label, "one_way_us": first["one_way_us"], "rank0_send_us": first["send_us"],
                          "rank0_recv_us": first["recv_us"], "rank1_recv_us": echo["recv_us"],
                          "rank1_send_us": echo["send_us"]})
    print_table(ping_rows, ["message", "one_way_us", "rank0_send_us", "rank0_recv_us", "rank1_recv_us",
                            "rank1_send_us"])
    print(f"# rank 1 echoing {args.late_ms:g} ms after each arrival: rank 0's round trip beyond that, median µs: " +
          ", ".join(f"{label} {outcome[0]['results'][label]['late_echo_us']:.1f}" for label, _, _ in MESSAGES))
    for rank, call in ((0, "send"), (1, "recv")):
        for label, _, _ in MESSAGES:
            phases = outcome[rank]["results"][label]["phases_us"]
            if phases:  # PIPECOMM_IPC_HOST_TIMING=1, over all rounds
                print(f"# {call} {label}, µs per call by phase: " +
                      ", ".join(f"{name} {us:.2f}" for name, us in phases.items()))
    if args.json:
        write_json(args.json, {"env": env, "config": vars(args), "rows": rows, "ping_pong": ping_rows,
                               "ranks": {rank: outcome[rank]["results"] for rank in (0, 1)}})


if __name__ == "__main__":
    main()
