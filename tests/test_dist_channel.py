"""The torch.distributed channel: every message arrives exact, a sender's memory stays bounded, NCCL never syncs the host."""

from __future__ import annotations

import random
import resource

import pytest
import torch
import torch.distributed as dist

from ranks import needs_two_gpus, rank_device, run_ranks

import pipecomm
import pipecomm.transport as transport
from pipecomm import _C

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


def codec_round_trip(sender, receiver, message: list) -> tuple[tuple, bool]:
    """One message through two codecs, as the channel moves it; returns it and whether metadata went along."""
    header, meta, payload = sender.encode(message)
    kind, follow, payload_bytes = receiver.read_header(header.clone())
    assert kind == "data" and follow == (0 if meta is None else meta.numel())
    received = receiver.allocate(None if meta is None else meta.clone(), payload_bytes)
    assert (payload is None) == (payload_bytes == 0)
    if payload is not None:
        receiver.unpack_payload(payload.clone())
    return received, meta is not None


def test_the_codec_sends_metadata_only_when_the_layout_changes():
    sender = _C.MessageCodec("cpu", "a -> b", "b -> a")
    receiver = _C.MessageCodec("cpu", "b -> a", "a -> b")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    messages = [[base, None], [base + 1, None], [base.t(), None], [base[:, ::2], torch.tensor(True)],
                [base[:, 1::2], torch.tensor(False)], [], [torch.empty(0, 3)], [torch.empty(0, 3)], [None]]
    metadata_sent = []
    for seq, message in enumerate(messages):
        received, with_meta = codec_round_trip(sender, receiver, message)
        assert_bitwise_equal(received, message, f"message {seq}")
        metadata_sent.append(with_meta)
    assert metadata_sent == [True, False, True, True, False, True, True, False, True]


def test_the_codec_carries_every_dtype_and_shape_bit_exact():
    sender = _C.MessageCodec("cpu", "a -> b", "b -> a")
    receiver = _C.MessageCodec("cpu", "b -> a", "a -> b")
    stream = MessageStream(0)
    for seq in range(1000):
        message = stream.next()
        received, _ = codec_round_trip(sender, receiver, message)
        assert_bitwise_equal(received, message, f"message {seq}")


def test_the_codec_refuses_frames_out_of_step_or_corrupt():
    sender = _C.MessageCodec("cpu", "a -> b", "b -> a")
    receiver = _C.MessageCodec("cpu", "b -> a", "a -> b")
    with pytest.raises(transport.ProtocolError, match="arrived before any metadata"):
        receiver.read_header(torch.tensor([1, 0, 0, 16]))
    header, meta, _ = sender.encode([torch.ones(3)])
    skipped, _, _ = sender.encode([torch.ones(3)])
    with pytest.raises(transport.ProtocolError, match="expected message 0 but frame 1 arrived"):
        receiver.read_header(skipped)
    corrupt = meta.clone()
    corrupt[5] = 99  # the first entry's dtype
    receiver.read_header(header)
    with pytest.raises(transport.ProtocolError, match="unknown dtype 99"):
        receiver.allocate(corrupt, 16)
    with pytest.raises(transport.ProtocolError, match="has a 32-byte payload but its metadata needs 16 bytes"):
        receiver.allocate(meta, 32)
    with pytest.raises(transport.ProtocolError, match="truncated metadata"):
        receiver.allocate(meta[:-1], 16)
    with pytest.raises(transport.ProtocolError, match="corrupt header"):
        receiver.read_header(torch.tensor([1, 0, -5, 0]))
    with pytest.raises(TypeError, match="entry 1 is a str, not a tensor"):
        sender.encode([torch.ones(1), "x"])


def two_channels_to_one_peer(rank: int, world_size: int) -> str:
    """Messages of two channels between the same ranks, received in the other order than sent, and both ranks
    sending large messages before receiving: each channel keeps its own, in order."""
    first = transport.connect(1 - rank, backend="dist", timeout=30)
    second = transport.connect(1 - rank, backend="dist", timeout=30)
    if rank == 0:
        first.send([torch.full((5,), 1.0)])
        second.send([torch.full((5,), 2.0)])
        first.send([torch.full((7,), 3.0)])
    else:
        assert second.recv()[0].tolist() == [2.0] * 5
        assert first.recv()[0].tolist() == [1.0] * 5
        assert first.recv()[0].tolist() == [3.0] * 7
    big = [torch.full((1 << 20,), float(rank))]
    for _ in range(3):
        first.send(big)
    for _ in range(3):
        assert torch.equal(first.recv()[0], torch.full((1 << 20,), float(1 - rank)))
    first.close()
    second.close()
    return "ok"


def test_channels_between_one_pair_of_ranks_keep_their_messages_apart(tmp_path):
    assert run_ranks(2, two_channels_to_one_peer, tmp_path, timeout=60) == ["ok", "ok"]


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


NCCL_GROUP = "cpu:gloo,cuda:nccl"


def nccl_message(seq: int, sender: int, changing: bool, device: torch.device) -> list:
    rows = 3 + seq % 5 if changing else 4
    dtype = (torch.bfloat16, torch.float32, torch.int64)[seq % 3] if changing else torch.bfloat16
    values = torch.arange(rows * 1000, device=device).reshape(rows, 1000) + 7 * seq + 1000 * sender
    return [values.to(dtype), None, torch.full((2,), seq, device=device), torch.empty(0, 5, device=device)]


def nccl_exchange_without_host_syncs(rank: int, world_size: int, changing: bool, count: int) -> int:
    device = rank_device(rank, "cuda")
    with transport.connect(1 - rank, backend="dist", device=device, timeout=60) as channel:
        received = []
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait in send or recv raises
        try:
            for seq in range(count):
                received.append(channel.send_recv(nccl_message(seq, rank, changing, device)))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        corrupted = 0
        for seq, got in enumerate(received):
            try:
                assert_bitwise_equal([t if t is None else t.cpu() for t in got],
                                     [t if t is None else t.cpu() for t in nccl_message(seq, 1 - rank, changing, device)],
                                     f"message {seq}")
            except AssertionError:
                corrupted += 1
    return corrupted


@needs_two_gpus
@pytest.mark.parametrize("changing", [False, True], ids=["static-shapes", "changing-shapes"])
def test_nccl_messages_never_wait_for_the_gpu(tmp_path, changing):
    assert run_ranks(2, nccl_exchange_without_host_syncs, tmp_path, changing, 50, process_group=NCCL_GROUP) == [0, 0]


def dist_pipeline_trains_exactly(rank: int, world_size: int, changing: bool, kind: str) -> tuple[list, list]:
    """3 steps of a 2-stage pipeline forced to dist (over NCCL under sync debug mode "error" on GPUs), then the losses
    and gradients against the unsplit model on this process, and the channels in the order close() reached them."""
    device = rank_device(rank, kind)
    cuda = device.type == "cuda"
    hidden = 64
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
                                  for _ in range(world_size)]).to(device)
    reference = [param.detach().clone() for param in model.parameters()]
    stage = pipecomm.split(model, world_size, rank)
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=torch.nn.functional.mse_loss,
                             micro_batches=4, transport="dist", timeout=60)
    batches = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        rows = 8 * (step + 1) if changing else 16  # a new batch size: a new structure header on the host
        batches.append((torch.randn(rows, hidden, generator=generator).to(device),
                        torch.randn(rows, hidden, generator=generator).to(device)))
    losses, grads = [], []
    try:
        for step, (x, target) in enumerate(batches):
            if cuda and step == 1:
                # From the second step on: at the first, the ranks before the last read the loss's dtype off the
                # broadcast, once (collectives.broadcast_loss).
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            losses.append(pipe.step(x, target=target))
            grads.append([param.grad.clone() for param in stage.parameters()])
            stage.zero_grad()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    closed = []
    for (peer, channel_kind), channel in pipe._links.channels.items():
        pair = (min(rank, peer), max(rank, peer), channel_kind)
        channel.close = lambda close=channel.close, pair=pair: (closed.append(pair), close())[1]
    pipe.close()
    whole = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
                                  for _ in range(world_size)]).to(device)
    with torch.no_grad():
        for param, value in zip(whole.parameters(), reference):
            param.copy_(value)
    mismatches = []
    for step, (x, target) in enumerate(batches):
        whole.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(whole(x), target)
        ref_loss.backward()
        if not torch.allclose(losses[step], ref_loss.detach(), rtol=1e-4, atol=1e-5):
            mismatches.append(f"step {step} loss")
        for index, (grad, ref_param) in enumerate(zip(grads[step], whole[rank].parameters())):
            if not torch.allclose(grad, ref_param.grad, rtol=1e-4, atol=1e-5):
                mismatches.append(f"step {step} grad {index}")
    return mismatches, closed


def test_a_pipeline_over_gloo_trains_exactly_and_closes_in_one_order(tmp_path):
    """Changing batch sizes send the structure header as a note on the host; both ranks close their channels in
    one order, as shutting NCCL communicators down needs."""
    (mismatches0, closed0), (mismatches1, closed1) = run_ranks(2, dist_pipeline_trains_exactly, tmp_path, True, "cpu")
    assert mismatches0 == mismatches1 == []
    assert closed0 == closed1 == [(0, 1, "act"), (0, 1, "grad")]


@needs_two_gpus
@pytest.mark.parametrize("changing", [False, True], ids=["static-shapes", "changing-shapes"])
def test_a_pipeline_over_nccl_trains_exactly_without_host_syncs(tmp_path, changing):
    outcomes = run_ranks(2, dist_pipeline_trains_exactly, tmp_path, changing, "cuda", process_group=NCCL_GROUP,
                         timeout=120)
    assert [mismatches for mismatches, _ in outcomes] == [[], []]
    assert outcomes[0][1] == outcomes[1][1]
