"""Channels between CPU processes: shared memory and torch.distributed (gloo) carry messages exactly and fail loudly."""

from __future__ import annotations

import glob
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from ranks import needs_cuda, rank_device, run_ranks

import pipecomm.transport as transport

# Every backend with the tensors it carries: CPU tensors over shared memory or gloo, CUDA tensors
# over CUDA IPC or gloo (which stages them through the host).
BACKENDS_AND_DEVICES = [
    pytest.param("shm", "cpu", id="shm-cpu"),
    pytest.param("dist", "cpu", id="dist-cpu"),
    pytest.param("ipc", "cuda", id="ipc-cuda", marks=needs_cuda),
    pytest.param("dist", "cuda", id="dist-cuda", marks=needs_cuda),
]


def mixed_message(seed: int, device: torch.device = torch.device("cpu")) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [None if tensor is None else tensor.to(device) for tensor in [
        torch.randn(3, 5, 7, generator=generator),
        (torch.rand(4, 9, generator=generator) > 0.5),
        torch.randint(-(2**40), 2**40, (11,), generator=generator),
        None,
        torch.randn(2, 3, generator=generator).to(torch.bfloat16),
        torch.empty(0, 4),
        torch.tensor(3.5, dtype=torch.float64),
        torch.randint(0, 255, (17,), dtype=torch.uint8, generator=generator),
    ]]


def assert_same_message(got: tuple, want: list) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, f"entry {index} should be None"
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, f"entry {index}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
            assert torch.equal(a, b), f"entry {index} differs"


def round_trips(rank: int, world_size: int, backend: str, kind: str) -> str:
    peer = 1 - rank
    device = rank_device(rank, kind)
    with transport.connect(peer, backend=backend, device=device, timeout=30, slot_bytes=4096) as channel:
        assert channel.backend == backend
        # Ordering and metadata caching: the same shapes many times, then new shapes, then back.
        for seq in range(20):
            if rank == 0:
                channel.send(mixed_message(seq, device))
            else:
                assert_same_message(channel.recv(), mixed_message(seq, device))
        changing = [[torch.arange(n, dtype=torch.int32, device=device).reshape(1, n)] for n in (1, 5, 5, 2, 9, 100_000)]
        for message in changing:
            if rank == 0:
                channel.send(message)
            else:
                assert_same_message(channel.recv(), message)
        # The fused exchange of the 1F1B steady state.
        mine = [torch.full((4, 3), float(rank), device=device), torch.tensor([rank], device=device)]
        theirs = [torch.full((4, 3), float(peer), device=device), torch.tensor([peer], device=device)]
        assert_same_message(channel.send_recv(mine), theirs)
        # Async receives are matched to messages in posting order, whatever order they are waited in.
        if rank == 0:
            for value in range(3):
                channel.send_async([torch.tensor([value], device=device)]).wait()
        else:
            handles = [channel.recv_async() for _ in range(3)]
            assert handles[2].wait()[0].item() == 2
            assert handles[0].wait()[0].item() == 0
            assert handles[1].wait()[0].item() == 1
        # Receiving into preallocated tensors, and a clear error (nothing lost) on a mismatch.
        if rank == 0:
            channel.send([torch.ones(2, 2, device=device)])
        else:
            with pytest.raises(ValueError, match=r"rank 0 -> rank 1: entry 0 is torch.float32 \(2, 2\) but out\[0\]"):
                channel.recv(out=[torch.empty(4, device=device)])
        if rank == 0:
            channel.send([torch.ones(2, 2, device=device)])
        else:
            target = torch.zeros(2, 2, device=device)
            channel.recv(out=[target])
            assert torch.equal(target, torch.ones(2, 2, device=device))
        # A message with no tensors at all.
        if rank == 0:
            channel.send([None, None])
        else:
            assert channel.recv() == (None, None)
    return backend


@pytest.mark.parametrize(("backend", "kind"), BACKENDS_AND_DEVICES)
def test_round_trips_and_ordering(tmp_path, backend, kind):
    assert run_ranks(2, round_trips, tmp_path, backend, kind) == [backend, backend]


def auto_backend(rank: int, world_size: int, kind: str) -> str:
    device = rank_device(rank, kind)
    with transport.connect(1 - rank, device=device) as channel:
        if rank == 0:
            channel.send([torch.ones(3, device=device)])
        else:
            assert torch.equal(channel.recv()[0], torch.ones(3, device=device))
        return channel.backend


@pytest.mark.parametrize(
    ("kind", "expected"), [("cpu", "shm"), pytest.param("cuda", "ipc", marks=needs_cuda)], ids=["cpu", "cuda"]
)
def test_auto_picks_the_same_host_transport(tmp_path, kind, expected):
    assert run_ranks(2, auto_backend, tmp_path, kind) == [expected, expected]


def stress(rank: int, world_size: int, backend: str, kind: str, count: int, max_bytes: int) -> int:
    """Random sizes (0 B to max_bytes) and random delays on both sides, in both directions at once."""
    peer = 1 - rank
    device = rank_device(rank, kind)
    rng = random.Random(1234)
    sizes = [rng.choice([0, 1, 15, 16, 17, 1000, 65536, rng.randint(0, max_bytes)]) for _ in range(count)]
    # Each message is a slice of a random pool at an offset that depends on its sender and seq.
    pool = torch.randint(0, 256, (2 * max_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)).to(device)

    def payload(seq: int, sender: int) -> torch.Tensor:
        offset = (seq * 7919 + sender * 104729) % max_bytes
        return pool[offset : offset + sizes[seq]]

    corrupted = 0
    with transport.connect(peer, backend=backend, device=device, timeout=60, slot_bytes=4096) as channel:
        delays = random.Random(rank)
        for seq in range(count):
            stamp = torch.tensor([seq, rank], dtype=torch.int64, device=device)
            if delays.random() < 0.05:
                time.sleep(delays.random() * 0.002)
            got = channel.send_recv([payload(seq, rank), stamp])
            if not (torch.equal(got[0], payload(seq, peer)) and got[1].tolist() == [seq, peer]):
                corrupted += 1
    return corrupted


@pytest.mark.parametrize(
    ("backend", "kind", "count"),
    [
        ("shm", "cpu", 3000),
        ("dist", "cpu", 300),
        pytest.param("ipc", "cuda", 3000, marks=needs_cuda),
        pytest.param("dist", "cuda", 300, marks=needs_cuda),
    ],
)
def test_stress_random_sizes_and_delays(tmp_path, backend, kind, count):
    assert run_ranks(2, stress, tmp_path, backend, kind, count, 3 << 20, timeout=120) == [0, 0]


def timeout_then_close(rank: int, world_size: int, backend: str, kind: str) -> str:
    with transport.connect(1 - rank, backend=backend, device=rank_device(rank, kind), timeout=0.5) as channel:
        if rank == 1:
            started = time.monotonic()
            with pytest.raises(TimeoutError) as error:
                channel.recv()
            assert time.monotonic() - started < 10
            message = str(error.value)
            assert "rank 0 -> rank 1" in message, message
        # Keep rank 0's end open until rank 1 has timed out; through the store, since a timed-out
        # gloo receive leaves the process group unusable.
        store = dist.distributed_c10d._get_default_store()
        if rank == 1:
            store.set("timed-out", "1")
        else:
            store.wait(["timed-out"])
        return "ok"


@pytest.mark.parametrize(("backend", "kind"), BACKENDS_AND_DEVICES)
def test_receive_times_out_with_ranks_in_the_message(tmp_path, backend, kind):
    run_ranks(2, timeout_then_close, tmp_path, backend, kind)


def peer_dies(rank: int, world_size: int) -> str:
    channel = transport.connect(1 - rank, backend="shm", timeout=30)
    if rank == 0:
        channel.send([torch.arange(4)])
        channel.send([torch.arange(5)])
        os._exit(0)  # dies without closing the channel, as a crash would
    assert channel.recv()[0].tolist() == [0, 1, 2, 3]
    assert channel.recv()[0].tolist() == [0, 1, 2, 3, 4]
    started = time.monotonic()
    with pytest.raises(transport.PeerDiedError, match="peer rank 0 .* died while rank 1 was waiting to receive message"):
        channel.recv()
    assert time.monotonic() - started < 10
    channel.close()
    return "reported"


def test_peer_death_is_reported_not_waited_on(tmp_path):
    assert run_ranks(2, peer_dies, tmp_path, timeout=30, may_exit=frozenset({0})) == [0, "reported"]


def leave_segments_behind(rank: int, world_size: int) -> list:
    channel = transport.connect(1 - rank, backend="shm", timeout=30)
    channel.send([torch.ones(1000)])
    channel.recv()
    if rank == 0:
        os._exit(0)
    time.sleep(0.5)
    # Names are unlinked once both ends have mapped them, so a crash leaves nothing in /dev/shm.
    return sorted(glob.glob("/dev/shm/pipecomm.*"))


def test_no_shared_memory_left_after_a_crash(tmp_path):
    before = set(glob.glob("/dev/shm/pipecomm.*"))
    _, left_while_survivor_open = run_ranks(2, leave_segments_behind, tmp_path, timeout=30, may_exit=frozenset({0}))
    assert set(left_while_survivor_open) <= before
    assert set(glob.glob("/dev/shm/pipecomm.*")) <= before


def bad_input(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match="backend must be one of"):
        transport.connect(1 - rank, backend="tcp")
    with pytest.raises(ValueError, match="peer_rank must be another rank"):
        transport.connect(rank)
    with pytest.raises(ValueError, match="backend 'ipc' needs CUDA tensors"):
        transport.connect(1 - rank, backend="ipc", device="cpu")
    with transport.connect(1 - rank, backend="shm", timeout=30) as channel:
        with pytest.raises(TypeError, match="entry 1 is a list"):
            channel.send([torch.ones(1), [1, 2]])
        with pytest.raises(ValueError, match=r"tensors\[0\] is on meta"):
            channel.send([torch.empty(2, device="meta")])
        # Nothing was sent by the failed calls: the next message arrives intact.
        if rank == 0:
            channel.send([torch.tensor([7])])
        else:
            assert channel.recv()[0].item() == 7
    return "ok"


def test_bad_input_is_a_clear_error(tmp_path):
    run_ranks(2, bad_input, tmp_path)
