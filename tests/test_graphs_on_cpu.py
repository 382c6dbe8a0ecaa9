"""The real ``GraphedStage`` under a Pipeline on a CPU, its graphs stood in for (tests/stand_in_graphs.py): captures,
landing buffers, the replay order, the accumulators and the check, on every schedule, with cuda_graphs=True and with
"auto", a rank's stages captured together; exact against one process. The graphs themselves are the GPU twins'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipecomm
from pipecomm.runtime import graph_runner
from pipecomm.schedules.schedule import Action, Schedule
from stand_in_graphs import StandInGraph, stand_in_graphs

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


class _HostBound:
    """``PassTimer`` on a CPU: every watched pass host-bound, every replayed one faster, so "auto" captures and keeps
    its graphs."""

    largest_growth = 1 << 20  # bytes a forward left allocated
    watched = True

    def start(self):
        return None

    def stop(self, started):
        pass

    def per_pass_ms(self):
        return (1.0, 0.95) if _HostBound.watched else (0.3, 0.1)


def _train(monkeypatch, schedule: str, stages: int, cuda_graphs, steps: int = 6,
           zero_grad: bool = True, data_grads: bool = False, loss_temperature: bool = False) -> pipecomm.Pipeline:
    """``steps`` steps of a one-rank Pipeline whose stages replay stand-in graphs (with two stages on the rank, a
    Linear tied across them), losses and gradients equal one process's every step (without ``zero_grad``, summed
    over the steps; with ``data_grads``, the inputs' and targets' too, which require grad; with
    ``loss_temperature``, that of a temperature loss_fn holds); the Pipeline."""
    monkeypatch.setattr(graph_runner, "PassTimer", _HostBound)
    monkeypatch.setattr(_HostBound, "watched", True)
    # "auto" passes the Pipeline's check of a CPU device; the runners get the mode asked for.
    monkeypatch.setattr(pipecomm.pipeline, "graph_mode", lambda *args, **kwargs: cuda_graphs)
    torch.manual_seed(0)
    tied = nn.Linear(8, 8)
    modules = ([nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))] if stages == 1 else
               [nn.Sequential(tied, nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Tanh(), tied, nn.Linear(8, 4))])
    reference = copy.deepcopy(nn.Sequential(*modules))
    temperature = nn.Parameter(torch.tensor(2.0), requires_grad=loss_temperature)
    ref_temperature = temperature.detach().clone().requires_grad_(loss_temperature)
    pipe = pipecomm.Pipeline(modules if stages > 1 else modules[0], stage=list(range(stages)) if stages > 1 else 0,
                             num_stages=stages, micro_batches=4, schedule=schedule,
                             loss_fn=lambda output, target: nn.functional.mse_loss(output / temperature, target))
    for step in range(steps):
        x, y = torch.randn(16, 8, requires_grad=data_grads), torch.randn(16, 4, requires_grad=data_grads)
        ref_x, ref_y = x.detach().requires_grad_(data_grads), y.detach().requires_grad_(data_grads)
        loss = pipe.step(x, target=y)
        expected = sum(nn.functional.mse_loss(reference(a) / ref_temperature, b) / 4
                       for a, b in zip(ref_x.chunk(4), ref_y.chunk(4)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
        for data, ref in ((x, ref_x), (y, ref_y)) if data_grads else ():
            torch.testing.assert_close(data.grad, ref.grad, **TOLERANCE, msg=f"the data's gradient, step {step}")
        if loss_temperature:
            torch.testing.assert_close(temperature.grad, ref_temperature.grad, **TOLERANCE)
            temperature.grad = ref_temperature.grad = None
        for param, ref in zip(nn.Sequential(*modules).parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE, msg=f"step {step}")
            if zero_grad:
                param.grad = ref.grad = None
        _HostBound.watched = set(pipe.cuda_graph_states.values()) != {"replaying"}
    return pipe


@pytest.mark.parametrize("cuda_graphs", [True, "auto"])
@pytest.mark.parametrize(("schedule", "stages"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1),
                                                  ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_graphed_stages_train_as_one_process(monkeypatch, schedule, stages, cuda_graphs):
    """Six steps, exact every step (``_train``), and every stage ends replaying, captured in the order of the
    schedule it runs (zb-h2 and zb-v rebuilt for the costs their first step measured, with cuda_graphs=True too)."""
    stand_in_graphs(monkeypatch)
    pipe = _train(monkeypatch, schedule, stages, cuda_graphs)
    assert (pipe.planned_costs is not None) == (schedule in ("zb-h2", "zb-v")), "rebuilt for the measured costs"
    group = pipe._executor.stages[0].graphed._group
    assert group.order == tuple((action.stage, action.kind, action.micro_batch) for action in pipe.schedule.actions[0]
                                if action.kind in "FBIW"), "the captures follow the schedule the rank runs"
    assert set(pipe.cuda_graph_states.values()) == {"replaying"}, pipe.cuda_graph_states
    assert StandInGraph.replays > 0


@pytest.mark.parametrize(("schedule", "stages"), [("zb-h1", 1), ("zb-v", 2)])
def test_graphed_gradients_add_up_over_steps_without_zero_grad(monkeypatch, schedule, stages):
    """cuda_graphs=True, .grad never zeroed: the replays' accumulators go on adding, as eager .grad does."""
    stand_in_graphs(monkeypatch)
    pipe = _train(monkeypatch, schedule, stages, True, zero_grad=False)
    assert set(pipe.cuda_graph_states.values()) == {"replaying"}


@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_inputs_and_targets_that_require_grad_run_eagerly_or_are_refused(monkeypatch, schedule, stages):
    """The caller's inputs and targets that require grad get their gradients, which go on into the caller's autograd
    graph, where no CUDA graph reaches: "auto" runs their micro-batches eagerly and captures none of them, exact
    every step; cuda_graphs=True refuses them by name."""
    stand_in_graphs(monkeypatch)
    pipe = _train(monkeypatch, schedule, stages, "auto", data_grads=True)
    assert "replaying" not in pipe.cuda_graph_states.values(), pipe.cuda_graph_states
    assert StandInGraph.replays == 0
    with pytest.raises(ValueError, match="of the caller's input or target tensors require grad"):
        _train(monkeypatch, schedule, stages, True, data_grads=True)


@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)])
def test_a_loss_fn_holding_parameters_runs_its_stage_eagerly_or_is_refused(monkeypatch, schedule, stages):
    """Parameters that loss_fn holds get their gradients outside the stage's, which no CUDA graph returns: "auto"
    leaves the last stage eager, exact every step; cuda_graphs=True refuses it by name."""
    stand_in_graphs(monkeypatch)
    pipe = _train(monkeypatch, schedule, stages, "auto", loss_temperature=True)
    assert pipe.cuda_graph_states[stages - 1].startswith("eager: its forward or loss_fn reaches 1 tensor(s) requiring "
                                                         "grad that are none of the stage's parameters"), \
        pipe.cuda_graph_states
    with pytest.raises(ValueError, match="its forward or loss_fn reaches 1 tensor"):
        _train(monkeypatch, schedule, stages, True, loss_temperature=True)


def test_a_failed_check_of_stages_captured_together_leaves_both_eager(monkeypatch):
    """"auto" on a rank of two stages whose graphs replay stale (stand-ins that do nothing): the check of the capture
    they share fails, both stages run eagerly from then on, each with one warning saying why, and every step stays
    exact."""
    stand_in_graphs(monkeypatch, inert=True)
    with pytest.warns(UserWarning, match="runs eagerly from now on: capturing its CUDA graphs failed") as caught:
        pipe = _train(monkeypatch, "zb-v", 2, "auto", steps=5)
    states = pipe.cuda_graph_states
    assert all(state.startswith("eager: capturing its CUDA graphs failed (GraphCheckError: stage 0") for state in
               states.values()), states
    assert sum("runs eagerly from now on" in str(warning.message) for warning in caught) == 2


@pytest.mark.parametrize("cuda_graphs", [True, "auto"])
def test_sends_after_the_next_replay_get_copies_of_the_landing_buffers(monkeypatch, cuda_graphs):
    """A replayed stage sends its outputs and input gradients from its landing buffers themselves. Under a schedule
    that sends them only after the stage's next forward and backward replays (which write those buffers again),
    each micro-batch must still send its own: the replays first leave the micro-batches not sent yet a copy."""
    stand_in_graphs(monkeypatch)
    micro_batches = 4
    late = [Action("F", 0, k) for k in range(micro_batches)] + [Action("SEND_F", 0, k) for k in range(micro_batches)]
    for k in range(micro_batches):
        late += [Action("RECV_F", 1, k), Action("F", 1, k)]
    late += [Action("B", 1, k) for k in range(micro_batches)] + [Action("SEND_B", 1, k) for k in range(micro_batches)]
    for k in range(micro_batches):
        late += [Action("RECV_B", 0, k), Action("B", 0, k)]
    schedule = Schedule("sends-late", 1, 2, micro_batches, (tuple(late),))
    pipe = _train(monkeypatch, schedule, 2, cuda_graphs)
    assert set(pipe.cuda_graph_states.values()) == {"replaying"}, pipe.cuda_graph_states
