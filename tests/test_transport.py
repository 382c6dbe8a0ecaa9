"""Channels between CPU processes: shared memory and torch.distributed (gloo) carry messages exactly and fail loudly."""

from __future__ import annotations

import copy
import gc
import glob
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from ranks import needs_cuda, rank_device, run_ranks

import pipecomm
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


def overwritten_after_the_read_event(rank: int, world_size: int, backend: str, kind: str) -> list[int]:
    """Rank 0 writes each message's tensor again right after sending it, its stream having waited on the send's read
    event; over CUDA IPC each large message's copy is first held back on the channel's stream (a busy copy engine).
    Returns the messages rank 1 received other than sent."""
    device = rank_device(rank, kind)
    wrong = []
    with transport.connect(1 - rank, backend=backend, device=device, timeout=30) as channel:
        source = torch.empty(1 << 20, device=device)  # 4 MB: over CUDA IPC, copied on the channel's stream
        for seq in range(4):  # the same layout: into slots, then into the receiver's posted buffers
            if rank == 1:
                if not torch.equal(channel.recv()[0].cpu(), torch.full((1 << 20,), float(seq))):
                    wrong.append(seq)
                continue
            source.fill_(float(seq))
            if backend == "ipc":
                stream_id, device_index, device_type = channel._native.channel_stream()
                with torch.cuda.stream(torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                                                         device_type=device_type)):
                    torch.cuda._sleep(20_000_000)  # about 10 ms
            channel.send([source])
            event = channel.send_read_event()
            if event is not None:
                event.wait()
            source.fill_(-1.0)
    with pytest.raises(transport.ProtocolError, match="cannot send_read_event: the channel was closed"):
        channel.send_read_event()
    return wrong


@pytest.mark.parametrize(("backend", "kind"), BACKENDS_AND_DEVICES)
def test_a_tensor_written_after_its_sends_read_event_arrives_as_sent(tmp_path, backend, kind):
    """``Channel.send_read_event``: what a CUDA graph's landing buffer, sent as it is, relies on."""
    assert run_ranks(2, overwritten_after_the_read_event, tmp_path, backend, kind) == [[], []]


def notes_with_messages(rank: int, world_size: int, backend: str, kind: str) -> str:
    device = rank_device(rank, kind)
    store = dist.distributed_c10d._get_default_store()
    # Several notes with one message: empty, small, and far larger than the slots, which grow for it.
    several = [b"", b"header", random.Random(0).randbytes(200_000), b"x" * 5]
    with transport.connect(1 - rank, backend=backend, device=device, timeout=10, num_slots=3,
                           slot_bytes=4096) as channel:
        if rank == 0:
            with pytest.raises(TypeError, match="rank 0 -> rank 1: send_note takes bytes, not a str"):
                channel.send_note("text")
            # Three slots hold the first message's metadata and two messages: were a note to take a slot of its own,
            # the second send would wait for a receiver that waits for it.
            for index in range(2):
                channel.send_note(bytes([index]))
                channel.send([torch.full((3,), index, device=device)])
            store.set("sent", "1")
            for note in several:
                channel.send_note(note)
            channel.send([None, torch.ones(2, device=device), None])
            channel.send([torch.zeros(1, device=device)])
            channel.send_note(bytearray(b"last"))
            channel.send([None])
        else:
            store.wait(["sent"])
            for index in range(2):
                assert torch.equal(channel.recv()[0], torch.full((3,), index, device=device))
                assert channel.recv_note() == bytes([index])
            if backend != "dist":  # which cannot tell: its recv_note waits for the next note
                with pytest.raises(transport.ProtocolError, match="rank 0 -> rank 1: recv_note: no note came with"):
                    channel.recv_note()
            message = channel.recv()
            assert message[0] is None and message[2] is None and torch.equal(message[1], torch.ones(2, device=device))
            assert [channel.recv_note() for _ in several] == several
            assert torch.equal(channel.recv()[0], torch.zeros(1, device=device))
            assert channel.recv() == (None,)
            assert channel.recv_note() == b"last"
    return backend


@pytest.mark.parametrize(("backend", "kind"), BACKENDS_AND_DEVICES)
def test_notes_go_with_the_next_message_in_order_taking_no_slot(tmp_path, backend, kind):
    assert run_ranks(2, notes_with_messages, tmp_path, backend, kind) == [backend, backend]


def test_a_loopback_note_comes_out_once_its_message_is_received():
    channel = transport.LoopbackChannel(0, torch.device("cpu"), timeout=1)
    channel.send_note(b"header")
    channel.send([None])
    with pytest.raises(transport.ProtocolError, match="rank 0 -> rank 0: recv_note: no note came with"):
        channel.recv_note()
    assert channel.recv() == (None,)
    assert channel.recv_note() == b"header"


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


PRETENDED_HOSTS = ["a", "a", "b", "b"]  # by rank: one machine acting as two hosts of two ranks each
# What each rank's channels to its neighbours then are, by peer.
PRETENDED_HOSTS_BACKENDS = [{1: "shm"}, {0: "shm", 2: "dist"}, {1: "dist", 3: "shm"}, {2: "shm"}]


def neighbours_backends(rank: int, world_size: int) -> dict:
    os.environ["PIPECOMM_HOST_ID"] = PRETENDED_HOSTS[rank]
    backends = {}
    for peer in (rank - 1, rank + 1):  # in rank order, so that no two ranks wait on each other's connect
        if 0 <= peer < world_size:
            with transport.connect(peer, timeout=30) as channel:
                assert channel.send_recv([torch.tensor([rank])])[0].item() == peer
                backends[peer] = channel.backend
    return backends


def test_pipecomm_host_id_makes_one_machine_several_hosts(tmp_path):
    assert run_ranks(4, neighbours_backends, tmp_path) == PRETENDED_HOSTS_BACKENDS


def train_across_pretended_hosts(rank: int, world_size: int) -> dict:
    """Two training steps against the unsplit model on this process; returns the pipeline's backends by peer."""
    os.environ["PIPECOMM_HOST_ID"] = PRETENDED_HOSTS[rank]
    backends = {}
    connect = transport.connect

    def recording_connect(peer_rank, *args, **kwargs):
        channel = connect(peer_rank, *args, **kwargs)
        backends[peer_rank] = channel.backend
        return channel

    transport.connect = recording_connect  # this spawned rank's own module: no other test sees it
    hidden = 8
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
                                  for _ in range(world_size)])
    reference = copy.deepcopy(model)
    stage = pipecomm.split(model, world_size, rank)
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=torch.nn.functional.mse_loss,
                             micro_batches=4, timeout=60)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        x, target = torch.randn(8, hidden, generator=generator), torch.randn(8, hidden, generator=generator)
        loss = pipe.step(x, target=target)
        ref_loss = torch.nn.functional.mse_loss(reference(x), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for param, ref_param in zip(stage.parameters(), reference[rank].parameters()):
            torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    pipe.close()
    return backends


def test_pipeline_across_pretended_hosts_matches_one_process(tmp_path):
    assert run_ranks(4, train_across_pretended_hosts, tmp_path, timeout=120) == PRETENDED_HOSTS_BACKENDS


def stress(rank: int, world_size: int, backend: str, kind: str, count: int, max_bytes: int,
           shrink_probability: float = 0.0) -> int:
    """Random sizes (0 B to max_bytes) and random delays on both sides, in both directions at once;
    each end shrinks its incoming slots now and then when shrink_probability is set."""
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
            if delays.random() < shrink_probability:
                channel.shrink()
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


def stress_on_sms(rank: int, world_size: int, *args) -> int:
    """``stress`` with messages up to 64 KB copied by a thread block (set in the rank: its environment is the rank
    server's, older than the test)."""
    os.environ["PIPECOMM_IPC_SM_MAX_BYTES"] = str(64 << 10)
    return stress(rank, world_size, *args)


@needs_cuda
def test_ipc_stress_with_small_messages_on_sms(tmp_path):
    # Messages up to 64 KB go as one thread block, the rest by the copy engine, mixed in one stream.
    assert run_ranks(2, stress_on_sms, tmp_path, "ipc", "cuda", 3000, 3 << 20, timeout=120) == [0, 0]


@needs_cuda
def test_ipc_stress_with_shrinks(tmp_path):
    # Shrinks land while the peer may be sending into the old slots, and grows for earlier messages
    # arrive while a shrink for a later one is pending: every message must still come out exact.
    assert run_ranks(2, stress, tmp_path, "ipc", "cuda", 2000, 3 << 20, 0.03, timeout=120) == [0, 0]


def shrink_after_large_messages(rank: int, world_size: int, backend: str, kind: str) -> list:
    device = rank_device(rank, kind)
    big = torch.arange(1 << 18, dtype=torch.float32, device=device)  # 1 MB: grows rank 1's 4 KB slots
    small = torch.ones(8, device=device)
    store = dist.distributed_c10d._get_default_store()
    results = []
    with transport.connect(1 - rank, backend=backend, device=device, timeout=30, slot_bytes=4096) as channel:
        if rank == 0:
            channel.send([big])
            channel.recv()  # rank 1 has shrunk its slots
            channel.send([small])
            store.set("sent", "1")
            channel.recv()
            channel.send([big * 2])  # the slots grow again, inside rank 1's recv
            channel.recv()
            return results
        assert torch.equal(channel.recv()[0], big)
        results.append(channel.shrink())  # nothing in flight
        results.append(channel.shrink())  # already at the size connect() was given
        channel.send([small])
        store.wait(["sent"])
        results.append(channel.shrink())  # a message is waiting in the ring
        assert torch.equal(channel.recv()[0], small)
        channel.send([small])
        assert torch.equal(channel.recv()[0], big * 2)
        results.append(channel.shrink(8192))
        with pytest.raises(ValueError, match="slot_bytes must be positive"):
            channel.shrink(0)
        channel.send([small])
        return results


@pytest.mark.parametrize(
    ("backend", "kind", "expected"),
    [
        ("shm", "cpu", [True, False, False, True]),
        ("dist", "cpu", [False, False, False, False]),  # no slots to give back
        # The smaller slots take over num_slots + 1 messages later, so big * 2 still fits the grown ones
        # and the last shrink finds them small already.
        pytest.param("ipc", "cuda", [True, False, False, False], marks=needs_cuda),
    ],
)
def test_shrink_gives_back_grown_slots_only_when_nothing_is_in_flight(tmp_path, backend, kind, expected):
    assert run_ranks(2, shrink_after_large_messages, tmp_path, backend, kind, timeout=60) == [[], expected]


def ipc_shrink_gives_memory_back(rank: int, world_size: int) -> list:
    device = rank_device(rank, "cuda")
    slot_bytes, num_slots = 4096, 4
    # 4 MB messages of a new shape each time, so none goes to a posted buffer: only the slots hold them.
    bigs = [torch.full(((1 << 20) - index,), float(index), device=device) for index in range(3)]
    smalls = [torch.full((8,), float(index), device=device) for index in range(num_slots + 6)]
    with transport.connect(1 - rank, backend="ipc", device=device, timeout=30, slot_bytes=slot_bytes) as channel:
        if rank == 0:
            for big in bigs:
                channel.send([big])
            channel.recv()  # rank 1 has shrunk its slots
            for small in smalls:
                channel.send([small])
            channel.recv()
            channel.send([bigs[0] * 2])  # the slots grow again
            return []
        for big in bigs:
            assert torch.equal(channel.recv()[0], big)
        torch.cuda.synchronize(device)
        grown = torch.cuda.memory_allocated(device)
        shrank = channel.shrink()
        channel.send([smalls[0]])
        for small in smalls:
            assert torch.equal(channel.recv()[0], small)
        torch.cuda.synchronize(device)
        given_back = grown - torch.cuda.memory_allocated(device)
        channel.send([smalls[0]])
        assert torch.equal(channel.recv()[0], bigs[0] * 2)
        # The four 4 MB slots, less the new small ones and the small messages' buffers.
        return [shrank, given_back >= num_slots * bigs[0].nbytes - (1 << 20)]


@needs_cuda
def test_ipc_shrink_gives_the_grown_slots_back_to_the_caching_allocator(tmp_path):
    assert run_ranks(2, ipc_shrink_gives_memory_back, tmp_path, timeout=60) == [[], [True, True]]


def ipc_idle_slots_given_back(rank: int, world_size: int) -> list:
    """Rank 1 receives 4 MB messages of one layout, one at a time, and after every 8 a small one of its own layout
    (as a pipeline's gradients and its loss broadcast): the first two large ones in its slots, grown for them, the
    rest in the buffers it posts. Whether all came exact, whether the grown slots went back to torch's allocator by
    themselves after a run of messages that did not need them, and whether a message of a new layout after that (in
    the slots, grown again) came exact."""
    device = rank_device(rank, "cuda")
    slot_bytes, num_slots, count, numel = 4096, 4, 40, 1 << 20
    with transport.connect(1 - rank, backend="ipc", device=device, timeout=30, slot_bytes=slot_bytes) as channel:
        if rank == 0:
            for index in range(count):
                channel.send([torch.full((numel,), float(index), device=device)])
                if index % 8 == 7:
                    channel.send([torch.full((3,), float(index), device=device)])
                channel.recv()  # one in flight at a time, so that every one after the second finds its post
            channel.send([torch.full((numel + 1,), -1.0, device=device)])
            return []
        exact, allocated = [], {}
        for index in range(count):
            exact.append(bool((channel.recv()[0] == index).all()))
            if index % 8 == 7:
                exact.append(bool((channel.recv()[0] == index).all()))
            torch.cuda.synchronize(device)
            allocated[index] = torch.cuda.memory_allocated(device)
            channel.send([torch.zeros(1, device=device)])
        given_back = allocated[4] - allocated[count - 1]
        regrown = channel.recv()[0]
        return [all(exact), channel.direct_messages[1] >= count - 2,
                given_back >= num_slots * numel * 4 - (1 << 20), bool((regrown == -1).all())]


@needs_cuda
def test_ipc_slots_grown_for_large_messages_go_back_once_the_posts_carry_every_message(tmp_path):
    # Measured on one H200 shared by two ranks: at rank 0's eager 1f1b peak (e2e's compute config), the four slots grown
    # to the 16.8 MB gradients, 67 MB, held nothing, every gradient coming into the buffers posted for it, and the loss
    # broadcast between steps into the slots.
    assert run_ranks(2, ipc_idle_slots_given_back, tmp_path, timeout=60) == [[], [True, True, True, True]]


def ipc_close_handshake(rank: int, world_size: int, early_closer: int | None) -> bool:
    """Whether this rank still holds device memory of the channel once it is closed and gone."""
    device = rank_device(rank, "cuda")
    store = dist.distributed_c10d._get_default_store()
    baseline = torch.cuda.memory_allocated(device)
    channel = transport.connect(1 - rank, backend="ipc", device=device, timeout=30, slot_bytes=1 << 16)
    for seq in range(6):  # a repeated layout: posted buffers as well as slots
        message = torch.full((1 << 14,), float(seq), device=device)
        assert torch.equal(channel.send_recv([message])[0], message)
    del message
    torch.cuda.synchronize(device)
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{1 - rank}"])
    if early_closer is not None and rank != early_closer:
        time.sleep(1.0)  # far beyond the early closer's wait for this end's note
    channel.close()
    del channel
    gc.collect()
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) > baseline
    store.set(f"closed/{rank}", "1")
    store.wait([f"closed/{1 - rank}"])  # the peer's process, and its mappings, live until both have looked
    return kept


@needs_cuda
@pytest.mark.parametrize(("early_closer", "expected"), [(None, [False, False]), (1, [False, True])])
def test_ipc_close_frees_exported_memory_only_once_the_peer_unmapped_it(tmp_path, early_closer, expected):
    # Closing together, each end's note says it unmapped the other's memory, which is then freed. Rank 1
    # closing alone keeps its slots and posted buffers: rank 0 still has them mapped.
    assert run_ranks(2, ipc_close_handshake, tmp_path, early_closer, timeout=60) == expected


def ipc_posted_memory_across_empty_cache(rank: int, world_size: int) -> list:
    """Bytes cached but unallocated after empty_cache(): with the channel open, then closed."""
    device = rank_device(rank, "cuda")
    store = dist.distributed_c10d._get_default_store()
    channel = transport.connect(1 - rank, backend="ipc", device=device, timeout=30)
    for seq in range(8):  # a repeated layout: from the third message on, into posted buffers
        message = torch.full((4 << 20,), float(seq), device=device)  # 16 MB: a segment of its own
        received = channel.send_recv([message])[0]
        assert torch.equal(received, message)
    direct = channel.direct_messages
    del message, received  # the last received buffer goes back to the cache, its segment still mapped by the peer
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    cached_open = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    store.set(f"measured/{rank}", "1")
    store.wait([f"measured/{1 - rank}"])
    channel.close()  # both ends close together: each hears that the other unmapped its memory
    del channel
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    cached_closed = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    store.set(f"closed/{rank}", "1")
    store.wait([f"closed/{1 - rank}"])
    return [direct[1] > 0, cached_open >= 16 << 20, cached_closed < 16 << 20]


@needs_cuda
def test_ipc_empty_cache_keeps_posted_segments_until_the_peer_unmapped_them(tmp_path):
    # A received tensor's buffer sits in a segment the sender keeps mapped: empty_cache() must not free
    # it while the channel is open (undefined behaviour), and may once both ends closed.
    assert run_ranks(2, ipc_posted_memory_across_empty_cache, tmp_path, timeout=60) == [[True, True, True]] * 2


def receive_ahead(rank: int, world_size: int, change_layout_at: int | None) -> tuple:
    """Rank 1 receives 20 messages of one layout under one layout key, rank 0 sending each once rank 1's receive of
    the one before returned, and from the twelfth on only once rank 1's receive of that very message returned (a
    receive that waited for the peer's note would wait forever). With ``change_layout_at``, that message comes
    with another layout."""
    os.environ["PIPECOMM_RUN_AHEAD"] = "1"  # read by the channel as it opens (the rank server's environment is older)
    device = rank_device(rank, "cuda")
    store = dist.distributed_c10d._get_default_store()
    channel = transport.connect(1 - rank, backend="ipc", device=device, timeout=30)
    try:
        if rank == 0:
            try:
                for seq in range(20):
                    if seq > 0:
                        store.wait([f"returned/{seq if seq >= 12 else seq - 1}"])
                    shape = (3, 1000) if seq == change_layout_at else (1000, 3)
                    channel.send([torch.full(shape, float(seq), device=device), None])
            except transport.ChannelError:  # the receiver closed on refusing the changed layout
                return ("stopped",)
            return ("sent",)
        received = []
        try:
            for seq in range(20):
                received.append(channel.recv(layout_key=7))
                store.set(f"returned/{seq}", "1")
            channel.settle()
        except transport.ProtocolError as error:  # at the first call after the changed layout's note came
            for seq in range(20):  # the sender goes on, to find the channel closed
                store.set(f"returned/{seq}", "1")
            return ("refused", str(error))
        exact = all(message[1] is None and torch.equal(message[0], torch.full((1000, 3), float(seq), device=device))
                    for seq, message in enumerate(received))
        return exact, channel.received_ahead
    finally:
        channel.close()


@needs_cuda
def test_ipc_receives_a_known_layout_ahead_of_the_peer(tmp_path):
    # The host goes on (launching what needs the data) while the GPU waits for it.
    exact, ahead = run_ranks(2, receive_ahead, tmp_path, None, timeout=60)[1]
    assert exact and ahead >= 8


@needs_cuda
def test_ipc_a_layout_received_ahead_that_the_peer_changed_is_refused(tmp_path):
    outcome = run_ranks(2, receive_ahead, tmp_path, 15, timeout=60)[1]
    assert outcome[0] == "refused" and "message 15 was received ahead of its note" in outcome[1], outcome


def timeout_then_close(rank: int, world_size: int, backend: str, kind: str) -> str:
    with transport.connect(1 - rank, backend=backend, device=rank_device(rank, kind), timeout=0.5) as channel:
        if rank == 1:
            started = time.monotonic()
            # A builtin TimeoutError and a ChannelError alike.
            with pytest.raises(transport.ChannelTimeoutError) as error:
                channel.recv()
            assert time.monotonic() - started < 10
            assert isinstance(error.value, TimeoutError) and isinstance(error.value, transport.ChannelError)
            message = str(error.value)
            assert "rank 0 -> rank 1" in message and "timed out" in message, message
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


def leave_segments_behind(rank: int, world_size: int) -> tuple:
    channel = transport.connect(1 - rank, backend="shm", timeout=30)
    channel.send([torch.ones(1000), torch.tensor([os.getpid()])])
    pids = {os.getpid(), int(channel.recv()[1].item())}
    if rank == 0:
        os._exit(0)
    time.sleep(0.5)
    # Names are unlinked once both ends have mapped them, so a crash leaves nothing in /dev/shm.
    return pids, this_worlds_segments(pids)


def this_worlds_segments(pids: set) -> set:
    # Only this world's names: the other pytest shard makes segments of its own meanwhile.
    return {path for path in glob.glob("/dev/shm/pipecomm.*") if any(f".pid{pid}." in path for pid in pids)}


def test_no_shared_memory_left_after_a_crash(tmp_path):
    _, (pids, left_while_survivor_open) = run_ranks(2, leave_segments_behind, tmp_path, timeout=30,
                                                    may_exit=frozenset({0}))
    assert left_while_survivor_open == set()
    assert this_worlds_segments(pids) == set()


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
        # A bare tensor is not a message of its rows.
        with pytest.raises(TypeError, match=r"rank \d -> rank \d: send takes a tuple or list of tensors .* not a Tensor \(wrap"):
            channel.send(torch.ones(2, 3))
        with pytest.raises(TypeError, match="send takes a tuple or list of tensors .* not a generator"):
            channel.send(tensor for tensor in [torch.ones(1)])
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


# CUDA IPC's direct path: once a receiver has seen a layout twice in a row, the sender copies
# straight into buffers the receiver posted. In a strict ping-pong the posts always arrive before the
# send that uses them, so the counts below are exact.


def ipc_ping_pong(rank: int, world_size: int, count: int, big: bool) -> tuple:
    peer = 1 - rank
    device = rank_device(rank, "cuda")
    side_stream = torch.cuda.Stream(device)

    def message(seq: int, sender: int) -> list:
        entries = mixed_message(seq * 2 + sender, device)
        if big:  # over 1 MB: copied on the channel's stream, and never fits the initial slots
            entries.append(torch.full((1024, 1025), float(seq * 2 + sender), device=device))
        return entries

    kept = []
    with transport.connect(peer, backend="ipc", device=device, timeout=60, slot_bytes=4096) as channel:
        for seq in range(count):
            # Some receives on another stream: posts then come from two streams.
            stream = side_stream if seq % 3 == 2 else torch.cuda.current_stream(device)
            with torch.cuda.stream(stream):
                if rank == 0:
                    channel.send(message(seq, rank))
                    kept.append((seq, channel.recv()))
                else:
                    kept.append((seq, channel.recv()))
                    channel.send(message(seq, rank))
        torch.cuda.synchronize(device)
        # Every received message is still intact: no posted buffer was reused or written twice.
        for seq, got in kept:
            assert_same_message(got, message(seq, peer))
        return channel.direct_messages


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@needs_cuda
def test_ipc_constant_layout_goes_direct(tmp_path, big):
    count = 60
    # Messages 0 and 1 teach the receiver the layout; every later one lands in a posted buffer.
    assert run_ranks(2, ipc_ping_pong, tmp_path, count, big, timeout=120) == [(count - 2, count - 2)] * 2


def ipc_layout_changes(rank: int, world_size: int) -> tuple:
    peer = 1 - rank
    device = rank_device(rank, "cuda")

    def message(seq: int, sender: int) -> list:
        value = float(seq * 2 + sender)
        if 5 <= seq < 10:  # layout B between two runs of layout A
            return [None, torch.full((3, 7), value, dtype=torch.float64, device=device)]
        return [torch.full((5,), value, device=device), None, torch.tensor([seq, sender], device=device)]

    with transport.connect(peer, backend="ipc", device=device, timeout=60) as channel:
        for seq in range(15):
            if rank == 0:
                channel.send(message(seq, rank))
                assert_same_message(channel.recv(), message(seq, peer))
            else:
                assert_same_message(channel.recv(), message(seq, peer))
                channel.send(message(seq, rank))
        return channel.direct_messages


@needs_cuda
def test_ipc_layout_change_mid_stream(tmp_path):
    # Per run of 5: two messages by slot while the receiver learns the layout (posts of the old
    # layout are passed over), then three direct; except that message 10, back to layout A, lands
    # in a buffer posted for layout A just before message 5 changed it.
    assert run_ranks(2, ipc_layout_changes, tmp_path, timeout=120) == [(10, 10)] * 2


def ipc_both_send_first(rank: int, world_size: int, rounds: int, burst: int) -> tuple:
    peer = 1 - rank
    device = rank_device(rank, "cuda")

    def message(seq: int, sender: int) -> list:
        generator = torch.Generator().manual_seed(seq * 2 + sender)
        return [torch.randn(17, 33, generator=generator).to(device), None,
                torch.randint(0, 2**31, (3,), generator=generator).to(device)]

    # A burst (plus its metadata message) fits the host ring, and a slot-path send waits on the device
    # for its slot's previous message: bursts longer than num_slots would stall both ranks. Posts
    # made while receiving one burst serve the next one's sends, or go stale.
    with transport.connect(peer, backend="ipc", device=device, timeout=60, num_slots=burst + 4) as channel:
        seq = 0
        for _ in range(rounds):
            for offset in range(burst):
                channel.send(message(seq + offset, rank))
            for offset in range(burst):
                assert_same_message(channel.recv(), message(seq + offset, peer))
            seq += burst
        # Then a ping-pong of one layout: the posts made during the bursts were stale, these are not.
        def fixed(sender: int) -> list:
            return [torch.full((64,), float(sender), device=device)]

        for _ in range(10):
            if rank == 0:
                channel.send(fixed(rank))
                assert_same_message(channel.recv(), fixed(peer))
            else:
                assert_same_message(channel.recv(), fixed(peer))
                channel.send(fixed(rank))
        return channel.direct_messages


@needs_cuda
def test_ipc_both_ranks_send_bursts_before_receiving(tmp_path):
    results = run_ranks(2, ipc_both_send_first, tmp_path, 5, 12, timeout=120)
    for sent, received in results:
        assert sent >= 8 and received >= 8, results


def ipc_grows_across_two_channels(rank: int, world_size: int) -> list:
    """Two channels between the ranks, as a pipeline's activations and gradients: every first message
    in a direction needs the peer to grow its 4 KB slots while the peer waits on the other channel."""
    peer = 1 - rank
    device = rank_device(rank, "cuda")

    def big(value: float) -> torch.Tensor:
        return torch.full((1 << 18,), value, device=device)  # 1 MB

    activations = transport.connect(peer, backend="ipc", device=device, timeout=20, slot_bytes=4096)
    gradients = transport.connect(peer, backend="ipc", device=device, timeout=20, slot_bytes=4096)
    with activations, gradients:
        # Crossed grows: rank 0 waits for one on activations while rank 1 waits for one on gradients.
        outgoing, incoming = (activations, gradients) if rank == 0 else (gradients, activations)
        outgoing.send([big(rank)])
        crossed = torch.equal(incoming.recv()[0], big(peer))
        if rank == 0:
            # A grow against a receive on the other channel: rank 1 waits on activations for what rank 0
            # sends only once its gradients send has grown rank 1's slots.
            gradients.send([big(2)])
            activations.send([big(3)])
            return [crossed, torch.equal(gradients.recv()[0], big(4))]
        after_grow = torch.equal(activations.recv()[0], big(3))
        grown = torch.equal(gradients.recv()[0], big(2))
        gradients.send([big(4)])
        return [crossed, after_grow, grown]


@needs_cuda
def test_ipc_grows_are_answered_across_a_pairs_two_channels(tmp_path):
    # A grow waits for an answer the peer gives while it waits on its other channel: a wait that served
    # only its own channel would time out here.
    assert run_ranks(2, ipc_grows_across_two_channels, tmp_path, timeout=90) == [[True, True], [True, True, True]]
