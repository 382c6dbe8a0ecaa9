"""The torch.distributed channel over gloo: every message arrives exact, and a sender's memory stays bounded."""

from __future__ import annotations

import random
import resource

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks

import pipecomm.transport as transport

# Every dtype a message may carry; bool gets 0s and 1s, the others random bytes (NaN patterns included).
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (3, 0), (0, 2, 5), (1,), (7,), (4, 5), (2, 3, 4), (16, 9)]


def assert_bitwise_equal(got: tuple, want: list, label: str) -> None:
    assert len(got) == len(want), f"{label}: {len(got)} entries, want {len(want)}"
    for index, (received, sent) in enumerate(zip(got, want)):
        where = f"{label} entry {index}"
        if sent is None:
            assert received is None, f"{where}: want None"
            continue
        assert (received.dtype, received.shape) == (sent.dtype, sent.shape), f"{where}: {received.dtype} {received.shape}"
        assert torch.equal(as_bytes(received), as_bytes(sent)), f"{where}: the bytes differ"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # torch.equal holds NaN unequal to itself; bytes compare the bit patterns. A fresh buffer, since a
    # contiguous tensor's size-1 dims may have any stride, which view() refuses.
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype)
    return flat.copy_(tensor.resolve_conj().reshape(-1)).view(torch.uint8)


def empty_messages_in_between(rank: int, world_size: int) -> str:
    messages = [[torch.empty(0, 4)], [torch.arange(5)], [torch.empty(0), None, torch.empty(2, 0, dtype=torch.bool)],
                [torch.empty(0, 4)], [], [torch.tensor(2.5, dtype=torch.float64)], [torch.arange(3)]]
    with transport.connect(1 - rank, backend="dist", timeout=30) as channel:
        for seq, message in enumerate(messages):
            if rank == 0:
                channel.send(message)
            else:
                assert_bitwise_equal(channel.recv(), message, f"message {seq}")
    return "ok"


def test_all_empty_messages_keep_the_channel_in_step(tmp_path):
    assert run_ranks(2, empty_messages_in_between, tmp_path) == ["ok", "ok"]


class MessageStream:
    """The messages one rank sends, in order: both ends generate them alike from the sender's seed.

    A layout (the entries' dtypes, shapes and views) repeats most of the time, comes back from a small
    pool sometimes and is new otherwise, so the metadata is sent, cached and replaced in every order.
    """

    def __init__(self, sender: int):
        self.rng = random.Random(sender)
        self.generator = torch.Generator().manual_seed(sender)
        self.pool = [self.new_layout() for _ in range(6)]
        self.layout = self.pool[0]

    def new_layout(self) -> list:
        layout = []
        for _ in range(self.rng.choice([0, 1, 1, 2, 3, 4, 6])):
            if self.rng.random() < 0.15:
                layout.append(None)
            else:
                view = self.rng.choice(["plain", "plain", "transposed", "strided", "expanded", "conjugated"])
                layout.append((self.rng.choice(DTYPES), self.rng.choice(SHAPES), view))
        return layout

    def next(self) -> list:
        draw = self.rng.random()
        if draw > 0.8:
            self.layout = self.rng.choice(self.pool)
        elif draw > 0.7:
            self.layout = self.new_layout()
        return [None if entry is None else self.tensor(*entry) for entry in self.layout]

    def tensor(self, dtype: torch.dtype, shape: tuple, view: str) -> torch.Tensor:
        if view == "transposed" and len(shape) >= 2:
            return self.values(dtype, shape[::-1]).transpose(0, -1)
        if view == "strided" and shape:
            return self.values(dtype, (shape[0] * 2, *shape[1:]))[::2]
        if view == "expanded" and shape:
            return self.values(dtype, (1, *shape[1:])).expand(shape)
        if view == "conjugated" and dtype.is_complex:
            return self.values(dtype, shape).conj()
        return self.values(dtype, shape)

    def values(self, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=self.generator).bool()
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=self.generator)
        return raw.view(dtype).reshape(shape)


def exchange_random_messages(rank: int, world_size: int, count: int) -> int:
    mine, theirs = MessageStream(rank), MessageStream(1 - rank)
    corrupted = 0
    with transport.connect(1 - rank, backend="dist", timeout=60) as channel:
        for seq in range(count):
            got = channel.send_recv(mine.next())
            try:
                assert_bitwise_equal(got, theirs.next(), f"message {seq}")
            except AssertionError:
                corrupted += 1
    return corrupted


def test_random_messages_of_every_kind_arrive_bit_exact(tmp_path):
    assert run_ranks(2, exchange_random_messages, tmp_path, 10_000, timeout=120) == [0, 0]


PAGE_BYTES = resource.getpagesize()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def stream_64kb_messages(rank: int, world_size: int, warm_up: int, count: int) -> int:
    message = [torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))]
    with transport.connect(1 - rank, backend="dist", timeout=60) as channel:
        if rank == 1:
            for _ in range(warm_up + count):
                assert torch.equal(channel.recv()[0], message[0])
            return 0
        for _ in range(warm_up):
            channel.send(message)
        before = resident_bytes()
        for _ in range(count):
            channel.send(message)
        return resident_bytes() - before


def test_a_sender_of_received_messages_stays_in_bounded_memory(tmp_path):
    # Unwaited gloo sends would hold each message's 64 KB buffer: 190 MB over these 3000.
    growth, _ = run_ranks(2, stream_64kb_messages, tmp_path, 300, 3000, timeout=60)
    assert growth < 20 << 20, f"the sender grew by {growth / 2**20:.1f} MB"


def stall(rank: int, world_size: int, num_slots: int) -> int:
    """Rank 1 never receives; rank 0 sends until its send waits past the timeout. Returns the sends made."""
    store = dist.distributed_c10d._get_default_store()
    channel = transport.connect(1 - rank, backend="dist", timeout=2, num_slots=num_slots)
    if rank == 1:
        store.wait(["stalled"])
        return 0
    message = [torch.zeros(64 << 10, dtype=torch.uint8)]
    sent = 0  # bounded, so that a channel that never waits fails the test instead of filling memory
    with pytest.raises(transport.ChannelTimeoutError, match="rank 0 -> rank 1: timed out .* waiting to send message 0"):
        while sent < 10_000:
            channel.send(message)
            sent += 1
    store.set("stalled", "1")
    return sent


def test_a_stalled_peer_makes_the_sender_wait_and_time_out(tmp_path):
    # The first num_slots sends go; the next waits for the oldest to be received until the timeout.
    assert run_ranks(2, stall, tmp_path, 4, timeout=60) == [4, 0]
