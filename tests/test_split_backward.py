"""The zero-bubble backward split: I then W gives the ordinary backward's gradients, and I really leaves the Linear weight GEMMs to W."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipecomm.executor import GradientSink, _run_backward
from pipecomm.split_backward import WeightGradStore, defer_linear_weight_grads


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.second = nn.Linear(16, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))
        self.unused = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.second(torch.tanh(self.norm(self.first(x)))) * self.scale


def split_backward(stage: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, micro_batches: int = 2):
    """I then W over a few micro-batches through the executor's pieces; returns x's grads and I's deferred count."""
    store = WeightGradStore()
    undo = defer_linear_weight_grads([stage], store)
    sink = GradientSink(list(stage.parameters()), main_grad=False)
    input_grads, deferred_counts, weights_before_w = [], [], None
    for chunk, chunk_grad in zip(x.chunk(micro_batches), grad_out.chunk(micro_batches)):
        leaf = chunk.detach().requires_grad_()
        out = stage(leaf)
        store.collecting = deferred = []
        results = _run_backward((out,), (chunk_grad,), [leaf] + sink.params, keep_graph=False)
        store.collecting = None
        input_grads.append(results[0])
        sink.add(results[1:])
        deferred_counts.append(len(deferred))
        if weights_before_w is None:
            weights_before_w = [p.grad for p in (stage.first.weight, stage.second.weight)]
        sink.add_weight_grads(deferred)
        assert all(p.grad is None or p.grad.grad_fn is None for p in sink.params), "W recorded autograd history"
    undo()
    return torch.cat(input_grads), deferred_counts, weights_before_w


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_input_then_weight_grads_equal_the_full_backward(autocast):
    torch.manual_seed(0)
    stage = Stage()
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 3, 8)
    grad_out = torch.randn(4, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        leaf = x.clone().requires_grad_()
        reference(leaf).backward(grad_out)
        input_grad, deferred_counts, weights_before_w = split_backward(stage, x, grad_out)
    assert deferred_counts == [2, 2], "both Linear weight GEMMs are left to W"
    assert weights_before_w == [None, None], "no Linear weight grad before the first W"
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(input_grad, leaf.grad, **tolerance)
    for (name, param), ref_param in zip(stage.named_parameters(), reference.parameters()):
        if name == "unused":
            assert param.grad is None
        else:
            torch.testing.assert_close(param.grad, ref_param.grad, **tolerance, msg=name)
    assert "forward" not in stage.first.__dict__, "undo restores the layers"


def test_without_collecting_the_patched_layers_compute_everything_at_once():
    torch.manual_seed(0)
    stage = Stage()
    reference = copy.deepcopy(stage)
    undo = defer_linear_weight_grads([stage], WeightGradStore())
    x = torch.randn(4, 8)
    stage(x).sum().backward()
    reference(x).sum().backward()
    undo()
    for param, ref_param in zip(stage.parameters(), reference.parameters()):
        if ref_param.grad is not None:
            torch.testing.assert_close(param.grad, ref_param.grad)


def test_tied_and_subclassed_linears_are_left_alone():
    embed = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    attention = nn.MultiheadAttention(8, 2)
    own = nn.Linear(8, 8)
    model = nn.ModuleDict({"embed": embed, "head": head, "attention": attention, "own": own})
    undo = defer_linear_weight_grads([model], WeightGradStore())
    assert "forward" in own.__dict__
    assert "forward" not in head.__dict__
    assert "forward" not in attention.out_proj.__dict__
    undo()
    assert "forward" not in own.__dict__
