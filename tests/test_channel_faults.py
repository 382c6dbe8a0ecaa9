"""Channel faults: aborts, dead peers, overlapping threads and crashed ranks' shared memory end in a named error within seconds."""

from __future__ import annotations

import glob
import os
import re
import signal
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from ranks import needs_cuda, rank_device, run_ranks

import pipecomm.transport as transport

# Generous bounds on how long a fault takes to surface: they catch a wait for the channel's timeout
# (30 s below), not a slow machine.
DETECTION_SECONDS = 5.0
ABORT_SECONDS = 3.0


def test_every_channel_error_is_a_channel_error():
    assert issubclass(transport.ChannelError, RuntimeError)
    for error_type in (transport.ChannelTimeoutError, transport.PeerDiedError, transport.ProtocolError):
        assert issubclass(error_type, transport.ChannelError)
    assert issubclass(transport.ChannelTimeoutError, TimeoutError)


def abort_wakes_the_peer(rank: int, world_size: int, backend: str, kind: str) -> float:
    """Rank 0 aborts while rank 1 waits in recv; returns how long the abort took (rank 0) or how long
    after it began rank 1's recv raised (rank 1)."""
    device = rank_device(rank, kind)
    store = dist.distributed_c10d._get_default_store()
    channel = transport.connect(1 - rank, backend=backend, device=device, timeout=30)
    if rank == 0:
        channel.send([torch.arange(3, device=device)])
        store.wait(["receiving"])
        time.sleep(0.3)  # rank 1 is inside its next recv by now
        started = time.monotonic()
        channel.abort("stage 0 failed: boom")
        took = time.monotonic() - started
        store.set("aborted_at", repr(started))
        closed = r"pipecomm \w+ channel rank 0 <-> rank 1: cannot (send|recv): the channel was closed \(aborted: stage 0"
        with pytest.raises(transport.ProtocolError, match=closed):
            channel.send([torch.ones(1, device=device)])
        with pytest.raises(transport.ProtocolError, match=closed):
            channel.recv()
        channel.abort("again")  # no-op on a closed channel, as close() is
        channel.close()
        return took
    # What was sent before the abort still arrives; the receive after it raises.
    assert channel.recv()[0].tolist() == [0, 1, 2]
    store.set("receiving", "1")
    with pytest.raises(transport.ProtocolError) as error:
        channel.recv()
    woke = time.monotonic()
    message = str(error.value)
    assert "rank 0 -> rank 1" in message and "aborted" in message and "stage 0 failed: boom" in message, message
    with pytest.raises(transport.ChannelError, match="rank 1 -> rank 0"):
        channel.send([torch.ones(1, device=device)])
    channel.close()
    return woke - float(store.get("aborted_at"))


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("shm", "cpu"), ("dist", "cpu"), pytest.param("ipc", "cuda", marks=needs_cuda)],
    ids=["shm", "dist", "ipc"],
)
def test_abort_wakes_the_peer_with_the_reason(tmp_path, backend, kind):
    aborting, woken_after = run_ranks(2, abort_wakes_the_peer, tmp_path, backend, kind)
    assert aborting < ABORT_SECONDS, f"abort took {aborting:.2f} s"
    assert woken_after < DETECTION_SECONDS, f"the peer's recv raised {woken_after:.2f} s after the abort"


def send_after_abort_races(rank: int, world_size: int, backend: str, kind: str, rounds: int) -> int:
    """Over many fresh channels, rank 0 aborts while rank 1 waits in recv; once that recv raises, rank 1
    sends at once. Returns how many of those sends went through silently (rank 1)."""
    device = rank_device(rank, kind)
    store = dist.distributed_c10d._get_default_store()
    silent = 0
    for round_index in range(rounds):
        channel = transport.connect(1 - rank, backend=backend, device=device, timeout=30)
        if rank == 0:
            store.wait([f"receiving/{round_index}"])
            time.sleep(0.002)  # rank 1 is inside its recv by now
            channel.abort("stage 0 failed")
        else:
            store.set(f"receiving/{round_index}", "1")
            with pytest.raises(transport.ProtocolError, match="aborted"):
                channel.recv()
            try:
                channel.send([torch.ones(1, device=device)])
                silent += 1
            except transport.ChannelError:
                pass
        channel.close()
        dist.barrier()
    return silent


@pytest.mark.parametrize(
    ("backend", "kind"), [("shm", "cpu"), pytest.param("ipc", "cuda", marks=needs_cuda)], ids=["shm", "ipc"]
)
def test_a_send_after_the_peers_abort_is_refused_every_time(tmp_path, backend, kind):
    # The abort closes the ring the peer sends on before the one it receives on; in the other order a
    # recv woken by the abort could send into a ring nobody reads (2 % of rounds on a 2-core machine).
    _, silent_sends = run_ranks(2, send_after_abort_races, tmp_path, backend, kind, 200, timeout=180)
    assert silent_sends == 0, f"{silent_sends} of 200 sends after the peer's abort went through"


def peer_killed(rank: int, world_size: int, backend: str) -> tuple:
    """Rank 0 is SIGKILLed while rank 1 waits in recv from it and rank 2 waits in send to it; they return
    how long after the kill they raised, and how long abort() then took."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        channels = [transport.connect(peer, backend=backend, timeout=30, num_slots=2) for peer in (1, 2)]
        store.wait(["waiting/1", "waiting/2"])
        time.sleep(0.3)  # both are blocked by now: rank 0 neither sends nor receives
        store.set("killed_at", repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
        return channels  # not reached
    channel = transport.connect(0, backend=backend, timeout=30, num_slots=2)
    store.set(f"waiting/{rank}", "1")
    with pytest.raises(transport.PeerDiedError) as error:
        if rank == 1:
            channel.recv()
        else:
            while True:  # two messages in flight fill the channel; the next send waits
                channel.send([torch.ones(1000)])
    detected = time.monotonic() - float(store.get("killed_at"))
    message = str(error.value)
    direction = "rank 0 -> rank 1" if rank == 1 else "rank 2 -> rank 0"
    assert direction in message and "peer rank 0" in message and "died" in message, message
    started = time.monotonic()
    channel.abort("the peer died")  # must neither raise nor wait for the dead peer
    aborting = time.monotonic() - started
    with pytest.raises(transport.ProtocolError, match="cannot send: the channel was closed"):
        channel.send([torch.ones(1)])
    return detected, aborting


@pytest.mark.parametrize("backend", ["shm", "dist"])
def test_a_killed_peer_is_reported_in_seconds(tmp_path, backend):
    _, *survivors = run_ranks(3, peer_killed, tmp_path, backend, may_exit=frozenset({0}))
    for rank, (detected, aborting) in enumerate(survivors, start=1):
        assert detected < DETECTION_SECONDS, f"rank {rank} raised {detected:.2f} s after the kill"
        assert aborting < ABORT_SECONDS, f"rank {rank}'s abort took {aborting:.2f} s"


def closed_by_the_peer(rank: int, world_size: int, backend: str) -> float:
    """Rank 0 sends two messages and closes; rank 1 receives them, then its next receive raises. Returns how long
    after the close that took (rank 1)."""
    store = dist.distributed_c10d._get_default_store()
    channel = transport.connect(1 - rank, backend=backend, timeout=30)
    if rank == 0:
        channel.send([torch.arange(3)])
        channel.send([torch.arange(4)])
        store.wait(["receiving"])
        store.set("closed_at", repr(time.monotonic()))
        channel.close()
        return 0.0
    assert channel.recv()[0].tolist() == [0, 1, 2]
    assert channel.recv()[0].tolist() == [0, 1, 2, 3]
    store.set("receiving", "1")
    with pytest.raises(transport.ProtocolError, match="rank 0 -> rank 1: peer rank 0 closed the channel"):
        channel.recv()
    woke = time.monotonic()
    channel.close()
    return woke - float(store.get("closed_at"))


@pytest.mark.parametrize("backend", ["shm", "dist"])
def test_a_receive_after_the_peer_closed_raises_at_once(tmp_path, backend):
    _, woke = run_ranks(2, closed_by_the_peer, tmp_path, backend)
    assert woke < DETECTION_SECONDS, f"rank 1 raised {woke:.2f} s after the close"


def overlapping_threads(rank: int, world_size: int, backend: str, kind: str, rounds: int) -> list:
    """Per round: one thread of rank 0 sends growing messages while another receives on the same
    channel, rank 1 echoing; once they overlap, rank 0's main thread aborts (even rounds) or closes
    (odd rounds) the channel under the blocked thread. Returns rank 0's errors, as (thread, type, text)."""
    device = rank_device(rank, kind)
    outcomes = []
    for round_index in range(rounds):
        ending = "abort" if round_index % 2 == 0 else "close"
        channel = transport.connect(1 - rank, backend=backend, device=device, timeout=30, slot_bytes=4096)
        if rank == 1:
            with pytest.raises(transport.ProtocolError) as error:
                while True:
                    channel.send(channel.recv())
            message = str(error.value)
            assert "peer rank 0 " in message, message
            assert (f"aborted: round {round_index}" in message) == (ending == "abort"), message
            channel.close()
            continue

        def message_of(step: int) -> list:
            return [torch.full((1024 << (step % 9),), float(step), device=device)]  # 4 KB to 1 MB: the slots grow

        sent, received, errors = [], [], []
        overlapped = threading.Event()

        def run(name: str, body) -> None:
            try:
                body()
            except transport.ChannelError as error:
                errors.append((name, type(error).__name__, str(error)))
                overlapped.set()

        def sending() -> None:
            for step in range(200):
                channel.send(message_of(step))
                sent.append(step)

        def receiving() -> None:
            while True:
                received.append(channel.recv()[0])

        threads = [threading.Thread(target=run, args=(name, body)) for name, body in (("send", sending), ("recv", receiving))]
        for thread in threads:
            thread.start()
        assert overlapped.wait(timeout=20), "the two threads never overlapped"
        time.sleep(0.05)  # the other thread is blocked by now, or soon
        started = time.monotonic()
        if ending == "abort":
            channel.abort(f"round {round_index}")
        else:
            channel.close()
        took = time.monotonic() - started
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive(), f"a thread is still inside the channel after {ending}"
        assert took < ABORT_SECONDS, f"{ending} took {took:.2f} s with another thread inside"
        # Whatever went through came back intact and in order.
        assert len(received) <= len(sent)
        for step, echo in enumerate(received):
            assert torch.equal(echo, message_of(step)[0]), f"round {round_index}: echo {step} differs"
        outcomes.append(errors)
    return outcomes


@pytest.mark.parametrize(
    ("backend", "kind"), [("shm", "cpu"), pytest.param("ipc", "cuda", marks=needs_cuda)], ids=["shm", "ipc"]
)
def test_overlapping_threads_get_a_protocol_error_not_a_crash(tmp_path, backend, kind):
    rounds = 4
    outcomes, _ = run_ranks(2, overlapping_threads, tmp_path, backend, kind, rounds, timeout=120)
    for round_index, errors in enumerate(outcomes):
        # Both threads ended with a ProtocolError naming the channel: one found the other inside, the
        # other was woken (or refused) by the abort or close.
        assert len(errors) == 2 and all(kind == "ProtocolError" for _, kind, _ in errors), (round_index, errors)
        assert all(re.match(rf"pipecomm {backend} channel rank [01] (<->|->) rank [01]: ", text) for _, _, text in errors), errors
        assert any("another thread is inside" in text for _, _, text in errors), errors


def grow_until_killed(rank: int, world_size: int, pid_dir: str, victims: frozenset) -> str:
    """Rank 0 sends messages of growing sizes, rank 1 receives and shrinks its slots after each, so the
    slots keep growing; the victims SIGKILL themselves at a random message."""
    with open(os.path.join(pid_dir, str(os.getpid())), "w"):
        pass
    channel = transport.connect(1 - rank, backend="shm", timeout=30, slot_bytes=4096)
    last_step = int.from_bytes(os.urandom(2), "little") % 30 + 2
    try:
        for step in range(40):
            if rank in victims and step == last_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0:
                channel.send([torch.zeros(4096 << (step % 10), dtype=torch.uint8)])
            else:
                channel.recv()
                channel.shrink()
    except transport.ChannelError:
        pass  # the peer died first
    if rank in victims:
        os.kill(os.getpid(), signal.SIGKILL)
    channel.close()
    return "closed"


def reconnect(rank: int, world_size: int) -> str:
    with transport.connect(1 - rank, backend="shm", timeout=30) as channel:
        channel.send([torch.ones(1)])
        channel.recv()
    return "ok"


def test_connect_sweeps_what_killed_ranks_left_in_dev_shm(tmp_path):
    pid_dir = tmp_path / "pids"
    for run in ("both-killed", "one-killed", "reconnect"):
        (tmp_path / run).mkdir(parents=True)  # each run its own store
    pid_dir.mkdir()
    run_ranks(2, grow_until_killed, tmp_path / "both-killed", str(pid_dir), frozenset({0, 1}), may_exit=frozenset({0, 1}))
    run_ranks(2, grow_until_killed, tmp_path / "one-killed", str(pid_dir), frozenset({1}), may_exit=frozenset({1}))
    dead_pids = {int(path.name) for path in pid_dir.iterdir()}
    # However the kills fell, one segment of a dead owner is surely there: what a receiver killed while
    # creating a grown generation leaves.
    planted = f"/dev/shm/pipecomm.{uuid.uuid4().hex}.0to1.pid{min(dead_pids)}.gen2"
    with open(planted, "wb") as segment:
        segment.write(bytes(4096))
    run_ranks(2, reconnect, tmp_path / "reconnect")
    left = [path for path in glob.glob("/dev/shm/pipecomm.*") if any(f".pid{pid}." in path for pid in dead_pids)]
    assert not left, f"segments of dead processes survived a connect: {left}"
