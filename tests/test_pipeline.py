"""Pipeline training on CPU processes equals single-process training with gradient accumulation, for every schedule."""

from __future__ import annotations

import copy
import json
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import MaskedBlock
from ranks import held_stages, needs_cuda, rank_device, run_ranks
from stand_in_graphs import stand_in_graphs

import pipecomm
from pipecomm.schedules.schedule import forward_schedule

HIDDEN = 16
BATCH = 8
SEQ = 5


class Head(nn.Module):
    def forward(self, x, mask):
        return x.masked_fill(~mask.unsqueeze(-1), 0.0).mean(dim=1)


class Stage(nn.Module):
    def __init__(self, last: bool):
        super().__init__()
        self.block = MaskedBlock(HIDDEN)
        self.head = Head() if last else None

    def forward(self, x, mask):
        x, mask = self.block(x, mask)
        return self.head(x, mask) if self.head is not None else (x, mask)


def build_stages(num_stages: int) -> list[nn.Module]:
    """Every rank builds the same model (same seed) and keeps its own stages; the last one ends in a head."""
    torch.manual_seed(0)
    return [Stage(last=index == num_stages - 1) for index in range(num_stages)]


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    mask = torch.rand(BATCH, SEQ, generator=generator) > 0.3
    mask[:, 0] = True
    target = torch.randn(BATCH, HIDDEN, generator=generator)
    return x, mask, target


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def reference_grads(stages: list[nn.Module], seed: int):
    """Single process, the whole batch at once, plain PyTorch."""
    x, mask, target = batch(seed)
    out = (x, mask)
    for stage in stages:
        out = stage(*out)
    loss = loss_fn(out, target)
    loss.backward()
    return loss.detach()


def equivalence(rank: int, world_size: int, schedule: str, virtual: int, micro_batches: int, kind: str,
                transport: str = "auto") -> str:
    """The pipeline (on CPU, or on GPUs through CUDA IPC, eager or replaying CUDA graphs, or on CPU replaying
    stand-in graphs from the first step: tests/stand_in_graphs.py) against the unsplit model on this process's CPU."""
    with pytest.MonkeyPatch.context() as patches:
        if kind == "cpu-graphs":
            stand_in_graphs(patches)
            patches.setattr(pipecomm.pipeline, "graph_mode", lambda *args, **kwargs: True)
        return _equivalence(rank, world_size, schedule, virtual, micro_batches, kind, transport)


def _equivalence(rank: int, world_size: int, schedule: str, virtual: int, micro_batches: int, kind: str,
                 transport: str) -> str:
    num_stages = world_size * virtual
    device = rank_device(rank, kind.split("-")[0])
    stages = build_stages(num_stages)
    reference = copy.deepcopy(stages)
    for module in stages:
        module.to(device)
    tolerance = dict(rtol=1e-5, atol=1e-6) if kind.startswith("cpu") else dict(rtol=1e-4, atol=1e-5)
    mine = held_stages(schedule, world_size, micro_batches, virtual, rank)
    modules = [stages[s] for s in mine]
    pipe = pipecomm.Pipeline(
        modules if virtual > 1 else modules[0],
        stage=mine if virtual > 1 else mine[0],
        num_stages=num_stages,
        loss_fn=loss_fn,
        micro_batches=micro_batches,
        schedule=schedule,
        transport=transport,
        timeout=60,
        cuda_graphs=kind == "cuda-graphs",
    )
    params = [p for s in mine for p in stages[s].parameters()]
    ref_params = [p for s in mine for p in reference[s].parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD([p for s in reference for p in s.parameters()], lr=0.05, momentum=0.9)
    for step in range(10):
        x, mask, target = batch(step)
        loss = pipe.step(x, mask, target=target)
        ref_loss = reference_grads(reference, step)
        torch.testing.assert_close(loss.cpu(), ref_loss, **tolerance)
        if step == 0:
            for param, ref_param in zip(params, ref_params):
                torch.testing.assert_close(param.grad.cpu(), ref_param.grad, **tolerance)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    for param, ref_param in zip(params, ref_params):
        torch.testing.assert_close(param.detach().cpu(), ref_param.detach(), **tolerance)
    if kind == "cpu-graphs":
        assert set(pipe.cuda_graph_states.values()) == {"replaying"}, pipe.cuda_graph_states
    pipe.close()
    return schedule


@pytest.mark.parametrize(
    ("schedule", "world_size", "virtual", "micro_batches", "kind"),
    [
        ("gpipe", 2, 1, 4, "cpu"),
        ("1f1b", 2, 1, 4, "cpu"),
        ("zb-h1", 2, 1, 4, "cpu"),
        ("interleaved-1f1b", 2, 2, 4, "cpu"),
        ("gpipe", 4, 1, 4, "cpu"),
        ("1f1b", 4, 1, 8, "cpu"),
        ("zb-h1", 4, 1, 8, "cpu"),
        ("interleaved-1f1b", 4, 2, 8, "cpu"),
        ("zb-h2", 2, 1, 4, "cpu"),
        ("zb-v", 2, 2, 4, "cpu"),
        ("zb-h2", 4, 1, 8, "cpu"),
        ("zb-v", 4, 2, 8, "cpu"),
        ("auto", 4, 2, 8, "cpu"),
        pytest.param("zb-h2", 2, 1, 4, "cuda", marks=needs_cuda),
        pytest.param("zb-v", 2, 2, 4, "cuda", marks=needs_cuda),
        pytest.param("auto", 2, 2, 4, "cuda", marks=needs_cuda),
        pytest.param("1f1b", 2, 1, 4, "cuda", marks=needs_cuda),
        pytest.param("zb-h1", 2, 1, 4, "cuda", marks=needs_cuda),
        pytest.param("interleaved-1f1b", 2, 2, 4, "cuda", marks=needs_cuda),
        ("gpipe", 2, 1, 4, "cpu-graphs"),
        ("1f1b", 2, 1, 4, "cpu-graphs"),
        ("interleaved-1f1b", 2, 2, 4, "cpu-graphs"),
        ("zb-h1", 2, 1, 4, "cpu-graphs"),
        ("zb-h2", 2, 1, 4, "cpu-graphs"),
        ("zb-v", 2, 2, 4, "cpu-graphs"),
        pytest.param("gpipe", 2, 1, 4, "cuda-graphs", marks=needs_cuda),
        pytest.param("1f1b", 2, 1, 4, "cuda-graphs", marks=needs_cuda),
        pytest.param("interleaved-1f1b", 2, 2, 4, "cuda-graphs", marks=needs_cuda),
        pytest.param("zb-h1", 2, 1, 4, "cuda-graphs", marks=needs_cuda),
        pytest.param("zb-h2", 2, 1, 4, "cuda-graphs", marks=needs_cuda),
        pytest.param("zb-v", 2, 2, 4, "cuda-graphs", marks=needs_cuda),
    ],
)
def test_training_matches_single_process(tmp_path, schedule, world_size, virtual, micro_batches, kind):
    assert run_ranks(world_size, equivalence, tmp_path, schedule, virtual, micro_batches, kind, timeout=120) == [
        schedule
    ] * world_size


def inference(rank: int, world_size: int, trace_path: str) -> str:
    stages = build_stages(world_size)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=4, timeout=60)
    x, mask, target = batch(123)
    expected = (x, mask)
    with torch.no_grad():
        for stage in stages:
            expected = stage(*expected)
    output = pipe.forward(x, mask)
    if rank == world_size - 1:
        torch.testing.assert_close(output, expected)
    else:
        assert output is None
    torch.testing.assert_close(pipe.forward(x, mask, broadcast_result=True), expected)
    pipe.step(x, mask, target=target)
    pipe.trace(trace_path)
    pipe.close()
    return "ok"


def test_inference_with_and_without_broadcast_and_a_trace(tmp_path):
    trace_path = str(tmp_path / "trace.json")
    run_ranks(2, inference, tmp_path, trace_path)
    events = json.load(open(trace_path))["traceEvents"]
    assert {event["pid"] for event in events} == {0, 1}
    assert any(event["name"].startswith("F") for event in events)


class _DictHead(nn.Module):
    """A last stage whose output is a structure: tensors of two dtypes, an empty one, None and plain values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, hidden):
        logits = self.proj(hidden)
        return {"logits": logits, "argmax": logits.argmax(-1), "empty": logits[:0], "aux": None,
                "meta": ("tokens", 2)}


def structured_inference(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), _DictHead()]
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2,
                             timeout=60)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = stages[1](stages[0](x))
    for _ in range(2):  # the second with the same layout
        output = pipe.forward(x, broadcast_result=True)
        assert output.keys() == expected.keys() and output["aux"] is None and output["meta"] == ("tokens", 2)
        for key in ("logits", "argmax", "empty"):
            assert output[key].dtype == expected[key].dtype, key
            torch.testing.assert_close(output[key], expected[key], rtol=0, atol=0)
    pipe.close()
    return "ok"


def test_a_structured_inference_output_is_broadcast_exactly(tmp_path):
    assert run_ranks(2, structured_inference, tmp_path) == ["ok", "ok"]


def clipping(rank: int, world_size: int) -> float:
    stages = build_stages(world_size)
    reference = copy.deepcopy(stages)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    x, mask, target = batch(7)
    pipe.step(x, mask, target=target)
    norm = pipe.clip_grad_norm_(0.01)
    reference_grads(reference, 7)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for s in reference for p in s.parameters()], 0.01)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for param, ref_param in zip(stages[rank].parameters(), reference[rank].parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-7)
    pipe.close()
    return float(norm)


def test_clip_grad_norm_is_global_across_stages(tmp_path):
    norms = run_ranks(2, clipping, tmp_path)
    assert norms[0] == pytest.approx(norms[1])


def bad_configuration(rank: int, world_size: int) -> str:
    stage = build_stages(2)[rank]
    common = dict(loss_fn=loss_fn, timeout=10)
    with pytest.raises(ValueError, match="micro_batches"):
        pipecomm.Pipeline(stage, stage=rank, num_stages=2, micro_batches=1, schedule="1f1b", **common)
    with pytest.raises(ValueError, match="num_stages=3 must equal the pipeline group size"):
        pipecomm.Pipeline(stage, stage=rank, num_stages=3, micro_batches=4, **common)
    with pytest.raises(ValueError, match="stage 5 is out of range"):
        pipecomm.Pipeline(stage, stage=5, num_stages=2, micro_batches=4, **common)
    with pytest.raises(ValueError, match=f"rank {rank} of 2 holds stages \\[{rank}\\]"):
        pipecomm.Pipeline(stage, stage=1 - rank, num_stages=2, micro_batches=4, **common)
    with pytest.raises(ValueError, match="cuda_graphs=True needs stages on a CUDA device"):
        pipecomm.Pipeline(stage, stage=rank, num_stages=2, micro_batches=4, cuda_graphs=True, **common)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        pipecomm.Pipeline(stage, stage=rank, num_stages=2, micro_batches=4, schedule="pipedream", **common)
    with pytest.raises(ValueError, match="stage 0 of 3 as pipecomm.split made it"):
        pipecomm.Pipeline(pipecomm.split(nn.Sequential(*build_stages(3)), 3, 0), stage=0, num_stages=2,
                          micro_batches=4, **common)
    return "ok"


def test_misconfiguration_fails_before_any_communication(tmp_path):
    run_ranks(2, bad_configuration, tmp_path)


def built_differently(rank: int, world_size: int) -> list[str]:
    """Ranks that pass different schedules or micro-batch counts: each raises at once, saying what differs."""
    stage = build_stages(2)[rank]
    raised = []
    for mine in ({"schedule": ("1f1b", "gpipe")[rank]}, {"micro_batches": (4, 8)[rank]}, {}):
        options = {"schedule": "1f1b", "micro_batches": 4, **mine}
        if not mine:  # built alike, after two that were not: it trains
            pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=2, loss_fn=loss_fn, timeout=60, **options)
            x, mask, target = batch(0)
            assert torch.isfinite(pipe.step(x, mask, target=target) if rank == 0 else pipe.step(target=target))
            pipe.close()
            continue
        started = time.monotonic()
        with pytest.raises(ValueError, match="every rank must pass the same schedule, num_stages and micro_batches"
                           ) as error:
            pipecomm.Pipeline(stage, stage=rank, num_stages=2, loss_fn=loss_fn, timeout=60, **options)
        assert time.monotonic() - started < 30, "it waited for the timeout"
        raised.append(str(error.value))
    return raised


def test_ranks_built_for_different_schedules_fail_at_once_saying_what_differs(tmp_path):
    first, last = run_ranks(2, built_differently, tmp_path, timeout=120)
    assert "'1f1b'" in first[0] and "but the last stage's rank (pipeline rank 1) for schedule 'gpipe'" in first[0]
    assert "4 micro-batches" in first[1] and "8 micro-batches" in first[1] and first[1].count("'1f1b'") == 2
    assert all("another rank for something else" in message for message in last)


def variants(rank: int, world_size: int) -> str:
    """autocast(bfloat16), torch.compile'd stage modules, main_grad buffers, and shapes that change between steps."""
    stages = build_stages(world_size)
    reference = copy.deepcopy(stages)

    # Shapes change between steps (sequence length 5, then 7): renegotiated, not a hang.
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    for seq in (5, 7, 5):
        generator = torch.Generator().manual_seed(seq)
        x = torch.randn(4, seq, HIDDEN, generator=generator)
        mask = torch.ones(4, seq, dtype=torch.bool)
        target = torch.randn(4, HIDDEN, generator=generator)
        loss = pipe.step(x, mask, target=target)
        out = (x, mask)
        for stage in reference:
            out = stage(*out)
        torch.testing.assert_close(loss, loss_fn(out, target).detach(), rtol=1e-5, atol=1e-6)
    pipe.close()

    # Under autocast the pipeline computes what the single process computes under autocast.
    for module in stages + reference:
        module.zero_grad(set_to_none=True)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    x, mask, target = batch(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, mask, target=target)
        out = (x, mask)
        for stage in reference:
            out = stage(*out)
        ref_loss = loss_fn(out, target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach().float(), rtol=2e-2, atol=2e-2)
    for param, ref_param in zip(stages[rank].parameters(), reference[rank].parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=5e-2, atol=5e-3)
    pipe.close()

    # A torch.compile'd stage module gives the eager gradients.
    for module in stages + reference:
        module.zero_grad(set_to_none=True)
    compiled = torch.compile(stages[rank], backend="aot_eager")
    pipe = pipecomm.Pipeline(compiled, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    x, mask, target = batch(4)
    pipe.step(x, mask, target=target)
    reference_grads(reference, 4)
    for param, ref_param in zip(stages[rank].parameters(), reference[rank].parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6)
    pipe.close()

    # bf16 parameters accumulate into flat fp32 main_grad buffers.
    low = copy.deepcopy(stages[rank]).to(torch.bfloat16)
    pipe = pipecomm.Pipeline(low, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60,
                             main_grad=True)
    x, mask, target = batch(5)
    pipe.step(x.to(torch.bfloat16), mask, target=target.to(torch.bfloat16))
    for param in low.parameters():
        assert param.grad is None and param.main_grad.dtype == torch.float32
        assert param.main_grad.abs().sum() > 0
    pipe.close()
    return "ok"


def test_autocast_compile_main_grad_and_changing_shapes(tmp_path):
    run_ranks(2, variants, tmp_path, timeout=180)


def test_training_over_torch_distributed_channels_matches_too(tmp_path):
    assert run_ranks(2, equivalence, tmp_path, "1f1b", 1, 4, "cpu", "dist", timeout=120) == ["1f1b"] * 2


def stalled_peer(rank: int, world_size: int) -> str:
    stages = build_stages(world_size)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=4,
                             timeout=0.5)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        x, mask, target = batch(0)
        with pytest.raises(TimeoutError) as error:
            pipe.step(x, mask, target=target)
        message = str(error.value)
        assert "pipeline rank 0, stage 0, micro-batch 0, recv of the gradient from stage 1" in message, message
        store.set("timed-out", "1")
    else:
        store.wait(["timed-out"])  # rank 1 never steps, but keeps its channels open
    pipe.close()
    return "ok"


def test_a_stalled_peer_times_out_naming_stage_micro_batch_and_action(tmp_path):
    run_ranks(2, stalled_peer, tmp_path)


def stalled_before_the_loss_broadcast(rank: int, world_size: int) -> str:
    stages = build_stages(world_size)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=4,
                             timeout=2.0)
    store = dist.distributed_c10d._get_default_store()
    x, mask, target = batch(0)
    if rank == 0:
        with pytest.raises(TimeoutError) as error:
            pipe.step(x, mask, target=target)
        assert "pipeline rank 0: the broadcast of the loss from the last stage (rank 1)" in str(error.value), error.value
        store.set("timed-out", "1")
        return "ok"
    run = pipe._executor.run

    def stalled(*args):
        run(*args)  # every message of the step has been sent; only the loss broadcast is left
        store.wait(["timed-out"])
        raise RuntimeError("stalled on purpose")  # a timed-out gloo collective leaves the group unusable

    pipe._executor.run = stalled
    with pytest.raises(RuntimeError, match="stalled on purpose"):
        pipe.step(x, mask, target=target)
    return "ok"


def test_a_peer_stalled_before_the_loss_broadcast_times_out_naming_it(tmp_path):
    assert run_ranks(2, stalled_before_the_loss_broadcast, tmp_path) == ["ok", "ok"]


ZB_COSTS = {"F": 2.95, "I": 4.85, "W": 2.25}


@pytest.mark.parametrize(("schedule", "chunks"), [
    ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2),
    (pipecomm.make_schedule("zb-v", 1, 4, costs=ZB_COSTS), 2), (pipecomm.make_schedule("zb-h2", 1, 4), 1),
], ids=["1f1b", "interleaved-1f1b", "zb-v", "zb-v-for-costs", "zb-h2-schedule"])
def test_one_process_pipeline_without_torch_distributed(schedule, chunks):
    """A pipeline of one rank (its chunks hand over through a loopback) is plain gradient accumulation."""
    stages = build_stages(chunks)
    reference = copy.deepcopy(stages)
    pipe = pipecomm.Pipeline(
        stages if chunks > 1 else stages[0], stage=list(range(chunks)) if chunks > 1 else 0, num_stages=chunks,
        loss_fn=loss_fn, micro_batches=4, schedule=schedule,
    )
    x, mask, target = batch(11)
    loss = pipe.step(x, mask, target=target)
    torch.testing.assert_close(loss, reference_grads(reference, 11), rtol=1e-5, atol=1e-6)
    for module, ref_module in zip(stages, reference):
        for param, ref_param in zip(module.parameters(), ref_module.parameters()):
            torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6)
    expected = (x[:3], mask[:3])
    with torch.no_grad():
        for stage in reference:
            expected = stage(*expected)
    torch.testing.assert_close(pipe.forward(x[:3], mask[:3]), expected, rtol=1e-5, atol=1e-6)


def test_a_schedule_that_does_not_fit_the_pipeline_is_refused():
    stages = build_stages(2)
    with pytest.raises(ValueError, match="runs 4 micro-batches of 2 stages, but the Pipeline has micro_batches=2"):
        pipecomm.Pipeline(stages, stage=[0, 1], num_stages=2, loss_fn=loss_fn, micro_batches=2,
                          schedule=pipecomm.make_schedule("zb-v", 1, 4))
    with pytest.raises(ValueError, match="the schedule 'zb-v' is for 2 ranks, but the pipeline group has 1"):
        pipecomm.Pipeline(stages, stage=[0, 1], num_stages=2, loss_fn=loss_fn, micro_batches=4,
                          schedule=pipecomm.make_schedule("zb-v", 2, 4))
    with pytest.raises(ValueError, match="the schedule 'forward' is forward-only, and step needs backwards"):
        pipecomm.Pipeline(stages, stage=[0, 1], num_stages=2, loss_fn=loss_fn, micro_batches=4,
                          schedule=forward_schedule(1, 4, (0, 0)))


def step_like_one_process(pipe, stages, reference, mine: list[int], step: int) -> None:
    """One step of ``batch(step)``: the loss and this rank's gradients as one process gives them; gradients cleared."""
    x, mask, target = batch(step)
    loss = pipe.step(x, mask, target=target)
    torch.testing.assert_close(loss, reference_grads(reference, step), rtol=1e-5, atol=1e-6)
    for stage in mine:
        for param, ref_param in zip(stages[stage].parameters(), reference[stage].parameters()):
            torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6)
            param.grad = None
            ref_param.grad = None


def auto_schedule(rank: int, world_size: int, chunks: int, fastest: str | None, recompute: bool) -> tuple:
    """schedule="auto" at 2 ranks for 10 steps, each equal to one process: 3 measured on the starting schedule, 3 on
    the plan and 3 on 1f1b (those that differ from the ones before), then the fastest. With ``fastest``, that
    schedule's steps are the ones timed shortest."""
    if fastest is not None:
        from pipecomm.runtime import step_trace

        step_trace.step_seconds = lambda executor: 1.0 if executor.schedule.name == fastest else 2.0
    num_stages = world_size * chunks
    torch.manual_seed(0)
    stages = build_stages(num_stages)
    reference = copy.deepcopy(stages)
    mine = [rank] if chunks == 1 else [rank, 2 * world_size - 1 - rank]
    pipe = pipecomm.Pipeline([stages[s] for s in mine] if chunks > 1 else stages[rank], stage=mine if chunks > 1 else rank,
                             num_stages=num_stages, loss_fn=loss_fn, micro_batches=4, schedule="auto", timeout=60,
                             recompute=recompute)
    names = []
    for step in range(10):
        step_like_one_process(pipe, stages, reference, mine, step)
        names.append(pipe.schedule.name)
    costs = pipe.planned_costs
    tried = [name for name, _ in pipe.auto_step_times]
    pipe.close()
    # Closed, the Pipeline leaves the user's Linear layers as they were.
    assert not any("forward" in layer.__dict__ for stage in mine for layer in stages[stage].modules())
    return names, sorted(costs) if costs else None, pipe.schedule.placement, tried


@pytest.mark.parametrize("chunks, fastest, recompute", [(1, "1f1b", False), (1, "zb-h1", True), (2, None, False)],
                         ids=["1f1b-timed-fastest", "zb-h1-timed-fastest-after-1f1b-recomputing", "v"])
def test_auto_measures_plans_tries_and_keeps_the_fastest_exactly(tmp_path, chunks, fastest, recompute):
    results = run_ranks(2, auto_schedule, tmp_path, chunks, fastest, recompute, timeout=120)
    initial = "zb-h1" if chunks == 1 else "zb-v"
    for names, costs, placement, tried in results:
        assert names[:2] == [initial] * 2, names  # the third step is the last measured one
        assert tried[0] == initial and (chunks == 2 or tried[-1] == "1f1b"), tried
        assert names[3 * len(tried) - 1:] == [names[-1]] * (11 - 3 * len(tried)), names  # settled
        assert costs == ["F", "I", "W"]
        if fastest is not None:
            assert names[-1] == fastest and "1f1b" in names, names
    assert results[0] == results[1]  # every rank tried and kept the same schedules
    assert results[0][2] == ((0, 1) if chunks == 1 else (0, 1, 1, 0))


def rebuilt_for_costs(rank: int, world_size: int, name: str) -> tuple:
    """schedule=name for 4 steps, each equal to one process, with I timed at three times F and W: from the second
    step on, the order list-scheduled for those costs."""
    from pipecomm.runtime import schedule_refit

    schedule_refit.CostMeter.costs = lambda meter: [1.0, 3.0, 1.0]
    chunks = 2 if name == "zb-v" else 1
    num_stages = world_size * chunks
    torch.manual_seed(0)
    stages = build_stages(num_stages)
    reference = copy.deepcopy(stages)
    mine = [rank] if chunks == 1 else [rank, 2 * world_size - 1 - rank]
    pipe = pipecomm.Pipeline([stages[s] for s in mine], stage=mine, num_stages=num_stages, loss_fn=loss_fn,
                             micro_batches=8, schedule=name, timeout=60)
    orders = []
    for step in range(4):
        orders.append(pipe.schedule.actions)  # the order this step runs
        step_like_one_process(pipe, stages, reference, mine, step)
    costs = pipe.planned_costs
    pipe.close()
    return orders, costs


@pytest.mark.parametrize("name", ["zb-v", "zb-h2"])
def test_a_list_scheduled_schedule_is_rebuilt_for_the_measured_costs_exactly(tmp_path, name):
    results = run_ranks(2, rebuilt_for_costs, tmp_path, name, timeout=120)
    orders, costs = results[0]
    assert costs == {"F": 1.0, "I": 3.0, "W": 1.0} and results[1] == results[0]
    chunks = 2 if name == "zb-v" else 1
    assert orders[0] == pipecomm.make_schedule(name, 2, 8, chunks).actions  # the first step: built for equal costs
    rebuilt = pipecomm.make_schedule(name, 2, 8, chunks, costs=costs).actions
    assert orders[1:] == [rebuilt] * 3 and rebuilt != orders[0]


def test_auto_refuses_placements_it_cannot_plan():
    stages = build_stages(3)
    with pytest.raises(ValueError, match='schedule="auto" plans one stage per rank, or two placed in a V'):
        pipecomm.Pipeline(stages, stage=[0, 1, 2], num_stages=3, loss_fn=loss_fn, micro_batches=4, schedule="auto")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_parameters_replaced_since_the_pipeline_was_built_are_refused(schedule):
    """load_state_dict(assign=True) swaps the parameter objects the Pipeline's sinks, deferrals and graphs hold: the
    next step says so (zb-h1 used to fail deep in its I pass, and CUDA graphs would have computed no gradient for the
    new objects), where loading in place trains on."""
    module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             schedule=schedule)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pipe.step(x, target=y)
    module.load_state_dict({name: value.clone() for name, value in module.state_dict().items()})  # in place
    pipe.step(x, target=y)
    module.load_state_dict({name: value.clone() for name, value in module.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match="stage 0's parameters are not the ones the Pipeline was built with"):
        pipe.step(x, target=y)


@pytest.mark.parametrize(("schedule", "main_grad", "refused_by"), [
    ("1f1b", False, None),
    ("zb-h1", False, "the zero-bubble schedule's split backward"),
    ("1f1b", True, "main_grad=True's accumulation"),
])
def test_post_accumulate_grad_hooks_run_per_micro_batch_or_are_refused(schedule, main_grad, refused_by):
    """A post-accumulate-grad hook runs after each micro-batch's accumulation, as it would with one process calling
    backward per micro-batch; a backward that adds gradients itself (a split one, main_grad buffers) cannot run it,
    so the step refuses before any work, naming the parameter (closing the Pipeline, as every failed call does), and a
    new one trains once the hook is gone."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if main_grad else torch.float32  # main_grad buffers are for low-precision parameters
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    reference = copy.deepcopy(module)
    seen, expected = [], []
    handle = module[2].weight.register_post_accumulate_grad_hook(lambda param: seen.append(param.grad.clone()))
    reference[2].weight.register_post_accumulate_grad_hook(lambda param: expected.append(param.grad.clone()))
    build = lambda: pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4,  # noqa: E731
                                      loss_fn=nn.functional.mse_loss, schedule=schedule, main_grad=main_grad)
    pipe = build()
    x, y = torch.randn(16, 8, dtype=dtype), torch.randn(16, 4, dtype=dtype)
    if refused_by:
        with pytest.raises(ValueError, match=f"stage 0's parameter '2.weight' has a post-accumulate-grad hook, "
                                             f"which {re.escape(refused_by)} would not run"):
            pipe.step(x, target=y)
        assert all(p.grad is None and getattr(p, "main_grad", torch.zeros(1)).eq(0).all() for p in module.parameters())
        assert not seen
        handle.remove()
        build().step(x, target=y)
        return
    pipe.step(x, target=y)
    for a, b in zip(x.chunk(4), y.chunk(4)):
        (nn.functional.mse_loss(reference(a), b) / 4).backward()
    assert len(seen) == len(expected) == 4
    for got, want in zip(seen, expected):
        torch.testing.assert_close(got, want)


def test_a_gradient_hook_on_a_weight_runs_under_a_split_backward():
    """register_hook on a Linear weight: zero-bubble schedules leave that weight's gradient to autograd (W would bypass
    the hook), so the hook runs for every micro-batch and .grad equals one process's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(module)
    calls = []
    for model in (module, reference):
        model[2].weight.register_hook(lambda grad: (calls.append(1), grad * 2)[1])
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=4, loss_fn=nn.functional.mse_loss,
                             schedule="zb-h1")
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    pipe.step(x, target=y)
    assert len(calls) == 4
    for a, b in zip(x.chunk(4), y.chunk(4)):
        (nn.functional.mse_loss(reference(a), b) / 4).backward()
    for param, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


@pytest.mark.parametrize(("loss_fn", "returned"), [
    (lambda output, target: (nn.functional.mse_loss(output, target), output.mean()), "tuple"),
    (lambda output, target: nn.functional.mse_loss(output, target, reduction="none").mean(1),
     r"a tensor of shape \(2,\)"),
    (lambda output, target: 3, "int"),
], ids=["tuple", "per-sample", "number"])
def test_a_loss_that_is_not_one_number_is_refused_by_name(loss_fn, returned):
    """loss.backward() refuses them in one process; a per-sample loss would otherwise be summed without a word."""
    pipe = pipecomm.Pipeline(nn.Linear(8, 8), stage=0, num_stages=1, loss_fn=loss_fn, micro_batches=2)
    with pytest.raises(TypeError, match=f"loss_fn must return .* one element.* it returned {returned};") as raised:
        pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
    assert raised.value.__notes__ == ["pipecomm: in the forward of stage 0, micro-batch 0, on pipeline rank 0"]


def test_a_loss_that_requires_no_grad_is_refused_and_a_one_element_loss_trains():
    """A detached loss: one process's backward() raises, where the step would return it and train nothing. A loss of
    shape (1,) backpropagates in one process, and does here."""
    detached = pipecomm.Pipeline(nn.Linear(8, 8), stage=0, num_stages=1, micro_batches=2,
                                 loss_fn=lambda output, target: nn.functional.mse_loss(output.detach(), target))
    with pytest.raises(RuntimeError, match="loss_fn returned a loss that does not require grad"):
        detached.step(torch.randn(4, 8), target=torch.randn(4, 8))
    module = nn.Linear(8, 8)
    reference = copy.deepcopy(module)
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=2,
                             loss_fn=lambda output, target: nn.functional.mse_loss(output, target).reshape(1))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loss = pipe.step(x, target=y)
    ref_loss = sum(nn.functional.mse_loss(reference(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for param, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


@pytest.mark.parametrize("layout", ["sparse", "channels_last"])
def test_sparse_and_channels_last_gradients_accumulate_under_a_split_backward(layout):
    """zb-h1 adds each micro-batch's returned gradients through the fused kernel, which takes dense contiguous ones
    only: an Embedding's sparse gradient and a channels_last convolution's failed the step with the kernel's error."""
    torch.manual_seed(0)
    if layout == "sparse":
        module = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 4))
        x, y = torch.randint(0, 10, (4, 3)), torch.randn(4, 4)
    else:
        module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 4)).to(memory_format=torch.channels_last)
        x, y = torch.randn(4, 3, 6, 6).to(memory_format=torch.channels_last), torch.randn(4, 4)
    reference = copy.deepcopy(module)
    pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=2, schedule="zb-h1",
                             loss_fn=nn.functional.mse_loss)
    for _ in range(2):  # the second step adds into the first's gradients
        pipe.step(x, target=y)
        for a, b in zip(x.chunk(2), y.chunk(2)):
            (nn.functional.mse_loss(reference(a), b) / 2).backward()
    for param, ref in zip(module.parameters(), reference.parameters()):
        assert param.grad.is_sparse == ref.grad.is_sparse
        torch.testing.assert_close(param.grad.to_dense(), ref.grad.to_dense())


class _SequenceFirst(nn.Module):
    """An LSTM on (time, batch, features) and a head on its outputs."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_sequence_first_batches_split_along_batch_dim_and_an_unsaid_one_warns():
    """Split along dim 0, a (time, batch) batch is cut in time: each micro-batch an LSTM over part of the sequence,
    silently another loss. batch_dim=1 splits it as one process accumulating over batch slices would."""
    torch.manual_seed(0)
    module = _SequenceFirst()
    reference = copy.deepcopy(module)
    with pytest.warns(UserWarning, match="stage 0 holds LSTM 'rnn' with batch_first=False"):
        pipecomm.Pipeline(copy.deepcopy(module), stage=0, num_stages=1, micro_batches=2, loss_fn=nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=2, batch_dim=1,
                                 loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(5, 6, 4), torch.randn(5, 6, 2)  # 5 steps of time, 6 sequences
    loss = pipe.step(x, target=y)
    ref_loss = sum(nn.functional.mse_loss(reference(a), b) / 2 for a, b in zip(x.chunk(2, 1), y.chunk(2, 1)))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for param, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)
    torch.testing.assert_close(pipe.forward(x), reference(x))  # joined along batch_dim too
    with pytest.raises(ValueError, match="batch_dim must be a dimension index >= 0, not -1"):
        pipecomm.Pipeline(module, stage=0, num_stages=1, micro_batches=2, batch_dim=-1, loss_fn=nn.functional.mse_loss)


class _DoublesItsInputInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.linear(x)


def test_an_in_place_op_on_a_received_input_says_why_one_process_allowed_it():
    """A later stage's inputs arrive as leaves that require grad, which autograd lets no in-place op change, where one
    process has them as the earlier stage's outputs: the error keeps torch's text and says so."""
    pipe = pipecomm.Pipeline([nn.Linear(4, 4), _DoublesItsInputInPlace()], stage=[0, 1], num_stages=2,
                             micro_batches=2, loss_fn=nn.functional.mse_loss, schedule="interleaved-1f1b")
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place") as raised:
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert raised.value.__notes__[0] == "pipecomm: in the forward of stage 1, micro-batch 0, on pipeline rank 0"
    assert "stage 1's inputs: they arrive from stage 0 as leaves" in raised.value.__notes__[1]
    assert "x = x.clone()" in raised.value.__notes__[1]
