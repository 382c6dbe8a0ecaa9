"""A failure on any rank ends every rank's call within seconds, naming the cause; then every Pipeline refuses further use."""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ports import free_port
from ranks import run_ranks

import pipecomm
from pipecomm.runtime import failure
from pipecomm.transport.channel import ChannelError

HIDDEN = 8
BOUND_SECONDS = 5.0  # every rank must raise this soon after the fault; the Pipelines' timeout is 60 s
TIMEOUT = 60.0


def chain(num_stages: int, tied: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(num_stages)]
    if tied:  # the first and last layers share a weight, as a tied embedding and LM head do
        layers[-1][0].weight = layers[0][0].weight
    return nn.Sequential(*layers)


def make_pipe(rank: int, world_size: int, *, loss_fn=nn.functional.mse_loss, model=None, micro_batches=4, **options):
    stage = pipecomm.split(model if model is not None else chain(world_size), world_size, rank)
    return pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=micro_batches,
                             timeout=TIMEOUT, **options)


def data(batch: int = 8, target_batch: int | None = None):
    generator = torch.Generator().manual_seed(batch)
    return torch.randn(batch, HIDDEN, generator=generator), torch.randn(target_batch or batch, HIDDEN, generator=generator)


def note_fault(clock: str) -> None:
    """Records when a fault is injected, so that detection times are measured from it."""
    with open(clock, "a") as file:
        file.write(f"{time.time()}\n")


def failing_at(micro_batch: int, clock: str, error: BaseException, function):
    """``function`` that raises ``error`` (or kills this process, for a signal number) at its micro_batch-th call."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == micro_batch + 1:
            note_fault(clock)
            if isinstance(error, int):
                os.kill(os.getpid(), error)
            raise error
        return function(*args, **kwargs)

    return wrapped


def fail_now(clock: str, message: str):
    note_fault(clock)
    raise RuntimeError(message)


# Each scenario builds this rank's Pipeline and returns it with the call that is to fail.

def indivisible_batch(rank, world_size, clock):
    pipe = make_pipe(rank, world_size)
    x, y = data(7)
    return pipe, lambda: (note_fault(clock) if rank == 0 else None, pipe.step(x, target=y))


def autograd_off(rank, world_size, clock):
    """One rank's training loop wraps the step in torch.no_grad(), as an evaluation loop would."""
    pipe = make_pipe(rank, world_size)
    x, y = data()

    def step():
        if rank != 1:
            return pipe.step(x, target=y)
        note_fault(clock)
        with torch.no_grad():
            return pipe.step(x, target=y)

    return pipe, step


def wrong_target_batch(rank, world_size, clock):
    pipe = make_pipe(rank, world_size)
    x, y = data(8, target_batch=4)  # divisible by the micro-batches, so only the last stage can tell
    return pipe, lambda: pipe.step(x, target=y)


def micro_batches_differ(rank, world_size, clock):
    """Rank 1 builds its Pipeline for 2 micro-batches, rank 0 for 4: both raise while building it."""
    def build():
        if rank == 1:
            note_fault(clock)
        make_pipe(rank, world_size, micro_batches=2 if rank == 1 else 4)

    return None, build


def construction_fails(rank, world_size, clock):
    """Rank 1's Pipeline cannot be built: rank 0, waiting for it to connect, stops at once."""
    stage = pipecomm.split(chain(world_size), world_size, rank)

    def build():
        if rank == 1:
            note_fault(clock)
        pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=nn.functional.mse_loss, micro_batches=4,
                          schedule="1f1b" if rank == 0 else "pipedream", timeout=TIMEOUT)

    return None, build


def loss_fails(rank, world_size, clock, backend="auto"):
    loss = nn.functional.mse_loss
    if rank == world_size - 1:
        loss = failing_at(2, clock, ArithmeticError("the loss of micro-batch 2 failed"), loss)
    pipe = make_pipe(rank, world_size, loss_fn=loss, transport=backend)
    x, y = data()
    return pipe, lambda: pipe.step(x, target=y)


def loss_fails_over_dist(rank, world_size, clock):
    return loss_fails(rank, world_size, clock, backend="dist")


def fails_after_the_last_message(rank, world_size, clock, tied=False):
    """The last rank fails once it has sent everything: its peers are in the collectives that end the step."""
    pipe = make_pipe(rank, world_size, model=chain(world_size, tied))
    if rank == world_size - 1:
        run = pipe._executor.run

        def run_then_fail(*args):
            run(*args)
            fail_now(clock, "failed after the last message")

        pipe._executor.run = run_then_fail
    x, y = data()
    return pipe, lambda: pipe.step(x, target=y)


def fails_before_the_shared_reduction(rank, world_size, clock):
    return fails_after_the_last_message(rank, world_size, clock, tied=True)


def result_broadcast(rank, world_size, clock):
    pipe = make_pipe(rank, world_size)
    if rank == world_size - 1:
        stage = pipe.modules[rank]
        stage.forward = failing_at(3, clock, RuntimeError("the last micro-batch's forward failed"), stage.forward)
    x, _ = data()
    return pipe, lambda: pipe.forward(x, broadcast_result=True)


def data_parallel(rank, world_size, clock):
    context = pipecomm.init(pipeline_size=2, data_size=2)
    loss = nn.functional.mse_loss
    if rank == world_size - 1:
        loss = failing_at(3, clock, ArithmeticError("the last loss of replica 1 failed"), loss)
    stage = pipecomm.split(chain(2), 2, context.stage)
    pipe = pipecomm.Pipeline(stage, stage=context.stage, num_stages=2, loss_fn=loss, micro_batches=4,
                             group=context.pipeline_group, data_group=context.data_group, timeout=TIMEOUT)
    x, y = data()
    return pipe, lambda: pipe.step(x, target=y)


def clip_grad_norm(rank, world_size, clock):
    pipe = make_pipe(rank, world_size)
    x, y = data()
    pipe.step(x, target=y)
    if rank == 1:
        pipe._collectives.wire_device = lambda: fail_now(clock, "clip_grad_norm_ failed on rank 1")
    return pipe, lambda: pipe.clip_grad_norm_(1.0)


def next_step(rank, world_size, clock):
    """The last rank fails after the loss broadcast: its peer finished the step and learns at its next one."""
    pipe = make_pipe(rank, world_size)
    if rank == world_size - 1:
        broadcast = pipe._collectives.broadcast

        def broadcast_then_fail(*args):
            broadcast(*args)
            fail_now(clock, "failed after the loss broadcast")

        pipe._collectives.broadcast = broadcast_then_fail
    x, y = data()

    def two_steps():
        pipe.step(x, target=y)
        if rank != world_size - 1:
            time.sleep(0.5)  # the failure is published while this rank is between steps
        pipe.step(x, target=y)

    return pipe, two_steps


def uncaught_exception(rank, world_size, clock):
    """A process ended by an exception outside pipecomm: its excepthook tells the peers why before it exits."""
    pipe = make_pipe(rank, world_size)
    x, y = data()
    if rank == 0:
        return pipe, lambda: pipe.step(x, target=y)
    return pipe, uncaught(clock, KeyError("the user's data loader failed"))


def uncaught(clock: str, error: Exception):
    """User code that raises ``error``, uncaught: the interpreter's excepthook runs here, where the harness would
    catch the error before the interpreter saw it."""
    def user_code_fails():
        try:
            note_fault(clock)
            raise error
        except type(error):
            sys.excepthook(*sys.exc_info())
            raise

    return user_code_fails


def fails_before_building(rank, world_size, clock):
    """Rank 1's program fails after pipecomm.init, before its Pipeline (a checkpoint shard missing): rank 0, building
    its Pipeline, waits for rank 1 to connect and stops at once."""
    pipecomm.init()
    if rank == 0:
        return None, lambda: make_pipe(rank, world_size)
    return None, uncaught(clock, FileNotFoundError("rank 1's checkpoint shard is missing"))


def exit_between_steps(rank, world_size, clock):
    """sys.exit outside a Pipeline call, which no excepthook sees: the interpreter's exit tells the peers."""
    pipe = make_pipe(rank, world_size)
    x, y = data()
    if rank == 0:
        return pipe, lambda: pipe.step(x, target=y)

    def user_code_exits():
        note_fault(clock)
        atexit._run_exitfuncs()  # what sys.exit(3) runs on its way out, here where the harness would catch it
        os._exit(3)

    return pipe, user_code_exits


def peer_killed(rank, world_size, clock, backend="auto"):
    loss = nn.functional.mse_loss
    if rank == world_size - 1:
        loss = failing_at(2, clock, signal.SIGKILL, loss)
    pipe = make_pipe(rank, world_size, loss_fn=loss, transport=backend)
    x, y = data()
    return pipe, lambda: pipe.step(x, target=y)


def peer_killed_over_dist(rank, world_size, clock):
    return peer_killed(rank, world_size, clock, backend="dist")


def store_host_killed(rank, world_size, clock):
    """Rank 0's process hosts the TCPStore and dies: rank 1 can publish nothing, and its own error stands; a rank
    further on (3 ranks) hears of it from rank 1's abort, a PeerFailedError, where it raised a ProtocolError."""
    pipe = make_pipe(rank, world_size)
    # Every rank's Pipeline built before the store's host dies in its step (a rank still building meets the store
    # gone: a PeerDiedError there, which this scenario does not measure).
    torch.distributed.barrier()
    if rank == 0:
        stage = pipe.modules[0]
        stage.forward = failing_at(2, clock, signal.SIGKILL, stage.forward)
    x, y = data()
    return pipe, lambda: pipe.step(x, target=y)


def fault_run(rank: int, world_size: int, scenario, clock: str) -> dict:
    pipe, call = scenario(rank, world_size, clock)
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - what each rank raised is the result
        outcome = {"type": type(error).__name__, "text": str(error), "time": time.time()}
    else:
        outcome = {"type": None, "text": "", "time": time.time()}
    if pipe is None:  # the Pipeline was never built: nothing to refuse
        outcome["refused"] = True
        return outcome
    x, y = data()
    try:
        pipe.step(x, target=y)
    except RuntimeError as error:
        outcome["refused"] = "an earlier call failed" in str(error)
    else:
        outcome["refused"] = False
    return outcome


CASES = {
    # scenario: (ranks, the ranks that die, the failing rank's error type, what every rank's error must contain)
    "indivisible batch on 3 stages": (indivisible_batch, 3, (), "ValueError", "not divisible by micro_batches=4"),
    "step with autograd off on one rank": (autograd_off, 2, (), "RuntimeError", "autograd is off"),
    "target of the wrong batch size": (wrong_target_batch, 3, (), "ValueError", "target has batch size 4 but the inputs have 8"),
    "a peer's Pipeline cannot be built": (construction_fails, 2, (), "ValueError", "unknown schedule 'pipedream'"),
    "micro_batches differ between ranks": (micro_batches_differ, 2, (), "ValueError",
                                           "every rank must pass the same schedule, num_stages and micro_batches"),
    "loss raises (peer waits on shm)": (loss_fails, 2, (), "ArithmeticError", "the loss of micro-batch 2 failed"),
    "loss raises (peer waits on dist)": (loss_fails_over_dist, 2, (), "ArithmeticError", "the loss of micro-batch 2 failed"),
    "peer in the loss broadcast": (fails_after_the_last_message, 2, (), "RuntimeError", "failed after the last message"),
    "peer in the shared-parameter all-reduce": (fails_before_the_shared_reduction, 2, (), "RuntimeError",
                                                "failed after the last message"),
    "peer in the result broadcast": (result_broadcast, 2, (), "RuntimeError", "the last micro-batch's forward failed"),
    "peers in data-parallel all-reduces": (data_parallel, 4, (), "ArithmeticError", "the last loss of replica 1 failed"),
    "peer in clip_grad_norm_": (clip_grad_norm, 2, (), "RuntimeError", "clip_grad_norm_ failed on rank 1"),
    "peer starting its next step": (next_step, 2, (), "RuntimeError", "failed after the loss broadcast"),
    "uncaught exception in user code": (uncaught_exception, 2, (), "KeyError", "the user's data loader failed"),
    "a peer fails before building its Pipeline": (fails_before_building, 2, (), "FileNotFoundError",
                                                  "checkpoint shard is missing"),
    "sys.exit between steps": (exit_between_steps, 2, (1,), None, "exited with the Pipeline open, outside its calls"),
    "peer SIGKILLed (shm)": (peer_killed, 2, (1,), None, "died"),
    "peer SIGKILLed (dist)": (peer_killed_over_dist, 2, (1,), None, "died"),
    "store host SIGKILLed": (store_host_killed, 2, (0,), None, "died"),
    "store host SIGKILLed, 3 ranks": (store_host_killed, 3, (0,), None, "died"),
}


def run_case(name: str, tmp_path: Path) -> list:
    """Runs a case; returns, per rank, (seconds from the fault to its error, error type, message) or None if it died."""
    scenario, world_size, dead, _, _ = CASES[name]
    clock = str(tmp_path / f"fault-{os.getpid()}-{abs(hash(name))}")
    outcomes = run_ranks(world_size, fault_run, tmp_path, scenario, clock, timeout=3 * TIMEOUT,
                         may_exit=frozenset(dead), tcp_store=name.startswith("store host SIGKILLed"))
    faulted = min(float(line) for line in Path(clock).read_text().split()) if Path(clock).exists() else None
    rows = []
    for rank, outcome in enumerate(outcomes):
        if rank in dead:
            rows.append(None)
            continue
        start = faulted if faulted is not None else min(o["time"] for o in outcomes if isinstance(o, dict))
        rows.append((outcome["time"] - start, outcome["type"], outcome["text"], outcome["refused"]))
    return rows


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_within_seconds_naming_the_cause(tmp_path, name):
    _, world_size, dead, failing_type, cause = CASES[name]
    rows = run_case(name, tmp_path)
    for rank, row in enumerate(rows):
        if rank in dead:
            continue
        seconds, error_type, text, refused = row
        assert error_type is not None, f"rank {rank} raised nothing"
        assert seconds < BOUND_SECONDS, f"rank {rank} raised {seconds:.1f} s after the fault: {error_type}: {text}"
        assert cause in text, f"rank {rank}: {error_type}: {text}"
        assert error_type in (failing_type, "PeerFailedError", "PeerDiedError"), f"rank {rank}: {error_type}: {text}"
        assert refused, f"rank {rank}'s Pipeline did not refuse the next call"


def fails_late_in_building(rank: int, world_size: int, flag: str) -> tuple:
    """Rank 1 fails after its channels are open, before the gather of the shared parameters' holders, and stays
    alive: (the error rank 0 raised and its seconds, or rank 1's text)."""
    import pipecomm.pipeline as pipeline_module
    tuning = pipeline_module.StepTuning
    if rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("rank 1's step tuning failed")
        pipeline_module.StepTuning = failing
    started = time.monotonic()
    try:
        make_pipe(rank, world_size)
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        if rank == 1:
            pipeline_module.StepTuning = tuning
            deadline = time.monotonic() + 30
            while not Path(flag).exists() and time.monotonic() < deadline:  # alive until rank 0 has raised
                time.sleep(0.05)
            return str(error)
        Path(flag).touch()
        return type(error).__name__, str(error), time.monotonic() - started
    Path(flag).touch()
    return None


def test_a_peer_that_fails_late_in_building_its_pipeline_ends_the_others_at_once(tmp_path):
    """The holders of shared parameters were gathered with dist.all_gather_object, which waited for a rank that had
    raised (for gloo's 30 minutes, or until its process exited): now through the store, ended by its failure note."""
    (error_type, text, seconds), own = run_ranks(2, fails_late_in_building, tmp_path, str(tmp_path / "raised"),
                                                 timeout=60)
    assert "rank 1's step tuning failed" in own
    assert error_type == "PeerFailedError" and "rank 1's step tuning failed" in text, (error_type, text)
    assert "the shared parameters' holders" in text and seconds < BOUND_SECONDS, (text, seconds)


def closes_after_one_step(rank: int, world_size: int) -> str:
    """Rank 0 closes its Pipeline after one step while rank 1 goes on to a second: what rank 1 raised."""
    pipe = make_pipe(rank, world_size)
    x, y = data()
    pipe.step(x, target=y)
    if rank == 0:
        pipe.close()
        return ""
    with pytest.raises(ChannelError) as error:
        pipe.step(x, target=y)
    return str(error.value)


def test_a_peer_that_closed_its_pipeline_is_named_with_the_calls_it_made(tmp_path):
    _, text = run_ranks(2, closes_after_one_step, tmp_path)
    assert "peer rank 0 closed the channel" in text
    assert "(rank 0 (pipeline rank 0) closed its Pipeline after 1 call of step; every rank must make the same calls" in text


def test_a_peer_hears_which_action_of_which_micro_batch_failed(tmp_path):
    """A compute action's error carries where it came from (a note on the failing rank), and the peers get it too."""
    _, _, text, _ = run_case("loss raises (peer waits on shm)", tmp_path)[0]
    assert "in the forward of stage 1, micro-batch 2, on pipeline rank 1: ArithmeticError: the loss" in text, text


def interrupted_while_waiting(rank: int, world_size: int) -> tuple:
    """Ctrl-C on rank 0 while it waits for rank 1, whose stage is busy for 3 s: (what each rank raised, its text,
    seconds after the signal)."""
    pipe = make_pipe(rank, world_size)
    if rank == 1:
        forward, calls = pipe.modules[1].forward, []
        pipe.modules[1].forward = lambda *args: (calls or time.sleep(3), calls.append(1), forward(*args))[2]
    signalled = time.monotonic() + 0.5
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    x, y = data()
    try:
        pipe.step(x, target=y)
    except BaseException as error:  # noqa: BLE001 - what each rank raised is the result
        return type(error).__name__, str(error), time.monotonic() - signalled
    return None, "", time.monotonic() - signalled


def test_ctrl_c_ends_a_wait_at_once_and_the_peers_hear_of_it(tmp_path):
    # The channels wait in native code, where Python's SIGINT handler ran only once the wait ended: Ctrl-C did
    # nothing until the peer's message came or the timeout (60 s here, 300 s by default) ran out.
    (first, _, first_seconds), (second, text, second_seconds) = run_ranks(2, interrupted_while_waiting, tmp_path,
                                                                           timeout=3 * TIMEOUT)
    assert first == "KeyboardInterrupt" and first_seconds < 1.0, (first, first_seconds)
    assert second == "PeerFailedError" and "SIGINT" in text and second_seconds < BOUND_SECONDS, (second, text)


def calls_out_of_step(rank: int, world_size: int) -> str:
    """Rank 0 evaluates alone (a forward), then both step: rank 1's step would read that forward's activations."""
    pipe = make_pipe(rank, world_size)
    x, y = data()
    started = time.monotonic()
    try:
        if rank == 0:
            pipe.forward(x)  # its sends may already meet rank 1's failure
        pipe.step(x, target=y)
    except (ValueError, failure.PeerFailedError) as error:
        assert time.monotonic() - started < BOUND_SECONDS
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_ranks_whose_calls_differ_fail_at_the_first_activation_between_them(tmp_path):
    """Before, rank 1's step trained on rank 0's inference activations and every later step was out of step, silently."""
    results = run_ranks(2, calls_out_of_step, tmp_path, timeout=60)
    message = "this rank is in step but stage 0 sent the activation of a forward: every rank of the pipeline must make"
    assert results[1].startswith("ValueError: " + message), results[1]
    assert results[0].startswith("PeerFailedError") and message in results[0], results[0]


def overlapping_threads(rank: int, world_size: int) -> list:
    """Two Pipelines on one group, stepped from two threads: the overlapping call is refused on every rank, and the
    other Pipeline's losses stay exact."""
    first, second = make_pipe(rank, world_size), make_pipe(rank, world_size)
    inside, attempted = threading.Event(), threading.Event()

    def hold(module, args):
        inside.set()
        attempted.wait(10)

    first.modules[rank].register_forward_pre_hook(hold)
    x, y = data()
    results = {}

    def step_second():
        inside.wait(10)
        try:
            second.step(x, target=y)
        except RuntimeError as error:
            results["second"] = str(error)
        finally:
            attempted.set()

    thread = threading.Thread(target=step_second, name="second")
    thread.start()
    loss = first.step(x, target=y)
    thread.join()
    reference = chain(world_size)
    expected = sum(nn.functional.mse_loss(reference(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4))) / 4
    torch.testing.assert_close(loss, expected.detach())
    with pytest.raises(RuntimeError, match="an earlier call failed"):
        second.step(x, target=y)
    first.close()
    return [results.get("second", "")]


def test_overlapping_calls_from_two_threads_are_refused(tmp_path):
    for (message,) in run_ranks(2, overlapping_threads, tmp_path):
        assert "called from thread 'second' while thread 'MainThread' is in step" in message, message
        assert "Pipelines are not thread-safe" in message, message


def disjoint_pipelines(rank: int, world_size: int) -> str:
    """Two models' Pipelines on ranks {0, 1} and {2, 3} of one job, each its job's first: the second's failure is its
    own; the first goes on (an inference that only sends, the all-reduce of clipping, a step)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    stage = dist.get_rank(group)

    def loss_fn(output, target):
        if rank == 3:
            raise ArithmeticError("the other model's loss failed")
        return nn.functional.mse_loss(output, target)

    pipe = pipecomm.Pipeline(chain(2)[stage], stage=stage, num_stages=2, loss_fn=loss_fn, micro_batches=2, group=group,
                             timeout=30)
    x, y = data()
    if rank >= 2:
        with pytest.raises((ArithmeticError, failure.PeerFailedError), match="the other model's loss failed"):
            pipe.step(x, target=y)
        dist.barrier()
        return "failed"
    dist.barrier()  # the other model has failed
    pipe.forward(x)
    pipe.clip_grad_norm_(1.0)
    pipe.step(x, target=y)
    pipe.close()
    return "ok"


def test_a_failure_stops_the_pipelines_it_concerns_only(tmp_path):
    # A failure note was keyed by the Pipeline's number alone: the first Pipeline of ranks {0, 1} raised the failure of
    # the first Pipeline of ranks {2, 3}, another model's, and closed for good.
    assert run_ranks(4, disjoint_pipelines, tmp_path, timeout=60) == ["ok", "ok", "failed", "failed"]


def test_a_pipeline_call_nested_in_another_is_refused_saying_so():
    # It was refused as calls from two threads, naming the main thread twice.
    inner = pipecomm.Pipeline(chain(1), stage=0, num_stages=1, loss_fn=nn.functional.mse_loss, micro_batches=2)
    outer = pipecomm.Pipeline(chain(1), stage=0, num_stages=1, micro_batches=2,
                              loss_fn=lambda output, target: nn.functional.mse_loss(inner.forward(output), target))
    with pytest.raises(RuntimeError, match=r"forward was called inside another Pipeline call \(thread 'MainThread' is in "
                                           r"step of the Pipeline of rank 0\), from its loss_fn, a stage's forward or a "
                                           "hook: Pipeline calls cannot nest"):
        x, y = data()
        outer.step(x, target=y)


EXIT_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
import pipecomm
from pipecomm.runtime import failure
from pipecomm.transport.channel import ChannelError

context = pipecomm.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
stage = pipecomm.split(model, context.num_stages, context.stage)
pipe = pipecomm.Pipeline(stage, stage=context.stage, num_stages=context.num_stages, micro_batches=4,
                         loss_fn=nn.functional.mse_loss, group=context.pipeline_group)
optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
for _ in range(2):
    pipe.step(torch.randn(8, 8), target=torch.randn(8, 4))
    optimizer.step()
    optimizer.zero_grad()
{close}
dist.destroy_process_group()
"""


class _Launcher:
    """tests/launcher.py serving the exit tests of this module: its imports are paid once, while the first test's
    torchrun runs, instead of once per test after it."""

    def __init__(self, log: Path):
        self.log = log
        self.process = None

    def run(self, script: Path, runs: int, timeout: float) -> str:
        """'ok', or what failed: the failed ranks' runs and statuses, then the launcher's standard error meanwhile."""
        self.start()
        seen = self.log.stat().st_size
        self.process.stdin.write(f"{runs} {script}\n")
        self.process.stdin.flush()
        answer = ""
        if select.select([self.process.stdout], [], [], timeout)[0]:
            answer = self.process.stdout.readline().strip()
        if not answer:
            # Killed, so that the next test gets a launcher of its own instead of this one's late answer.
            self.process.kill()
            answer = f"no answer within {timeout:g} s (launcher exit status {self.process.wait()})"
        if answer == "ok":
            return answer
        with self.log.open() as log:
            log.seek(seen)
            return f"{answer}\n{log.read()[-3000:]}"

    def start(self) -> None:
        if self.process is None or self.process.poll() is not None:
            with self.log.open("a") as log:
                self.process = subprocess.Popen(
                    [sys.executable, str(Path(__file__).parent / "launcher.py"), "--nproc", "2"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()  # the end of its input: it exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    serving = _Launcher(tmp_path_factory.mktemp("launcher") / "stderr")
    serving.start()
    yield serving
    serving.close()


@pytest.mark.parametrize(("close", "runs"), [("pipe.close()", 9),
                                             ("# the Pipeline is left open: the atexit hook closes it", 4)])
def test_a_correct_script_exits_cleanly(tmp_path, launcher, close, runs):
    """gloo's worker threads must hold nothing of Python's once the interpreter finalizes: before the fix, 2 to 3
    runs of 12 aborted with SIGABRT ("terminate called without an active exception"). Once under torchrun, as a user
    launches it, then ``runs`` more times on ranks forked from one launcher (tests/launcher.py): the same script and
    the same interpreter exit, without torchrun's agent and the imports that made each launch cost 8 s of CPU."""
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT.format(close=close))
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert torchrun.returncode == 0, f"torchrun: exit {torchrun.returncode}\n{torchrun.stderr[-3000:]}"
    answer = launcher.run(script, runs, timeout=10 * runs + 60)
    assert answer == "ok", answer


class _SlowWork:
    """A collective's work that completes just after a wait's slice runs out, as a loaded machine makes it."""

    def __init__(self, error: RuntimeError | None = None):
        self.error = error
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return self.waits > 0


@pytest.mark.parametrize("failed", [False, True])
def test_a_collective_done_as_its_wait_slice_ends_is_not_a_failure(monkeypatch, failed):
    monkeypatch.setattr(failure.dist, "get_backend", lambda group: "gloo")
    work = _SlowWork(RuntimeError("Connection closed by peer") if failed else None)
    collective = failure.Collective(lambda: work, [], None, "the broadcast of the loss")
    if failed:
        with pytest.raises(failure.PeerDiedError, match="the broadcast of the loss: a process of the collective died"):
            collective.wait(5.0, None, 0)
    else:
        collective.wait(5.0, None, 0)
    assert work.waits == 2


SILENT_PEER_SCRIPT = """
import time, torch, pipecomm
from torch import nn
ctx = pipecomm.init()
pipe = pipecomm.Pipeline(nn.Linear(4, 4), stage=ctx.stage, num_stages=ctx.num_stages, micro_batches=2,
                         loss_fn=nn.functional.mse_loss, timeout=2)
pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
if ctx.rank == 1:
    time.sleep(600)  # stuck in the program's own code, alive: no failure to hear of
pipe.clip_grad_norm_(1.0)  # rank 0: its all-reduce of the norm times out
"""


def test_a_rank_whose_collective_timed_out_on_a_silent_peer_exits():
    """The wait gave up after the Pipeline's timeout and raised, but gloo's worker thread went on waiting for the
    process group's timeout (300 s from pipecomm.init, 30 minutes by default), and the process hung at exit joining
    it: the job never ended. gloo's own timeout now ends a few seconds after the wait's."""
    port = str(free_port())
    processes = [subprocess.Popen([sys.executable, "-c", SILENT_PEER_SCRIPT], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank),
                                       "LOCAL_RANK": str(rank)})
                 for rank in range(2)]
    try:
        _, errors = processes[0].communicate(timeout=90)
        assert processes[0].returncode != 0
        assert "clip_grad_norm_'s all-reduce of the gradient norm: not done after 2 s" in errors, errors[-2000:]
    finally:
        for process in processes:
            process.kill()
            process.communicate()
