"""The zero-bubble backward split: I then W equals the ordinary backward, and W does not redo I's work."""

from __future__ import annotations

import torch
from torch import nn

from pipecomm.executor import _run_backward
from pipecomm.split_backward import backward_input, backward_weight


class CountingIdentity(torch.autograd.Function):
    """Counts how often the backward pass crosses this point."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CountingIdentity.calls += 1
        return grad


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.unused = nn.Parameter(torch.ones(1))

    def forward(self, x):
        hidden = CountingIdentity.apply(torch.tanh(self.first(x)))
        return self.second(hidden) * self.scale


def test_input_then_weight_grads_equal_the_full_backward_without_redoing_the_input_path():
    torch.manual_seed(0)
    stage = Stage()
    params = list(stage.parameters())
    used = [p for p in params if p is not stage.unused]
    x = torch.randn(4, 8, requires_grad=True)
    grad_out = torch.randn(4, 8)

    out = stage(x)
    expected = dict(zip([x] + used, torch.autograd.grad(out, [x] + used, grad_out)))

    out = stage(x)
    CountingIdentity.calls = 0
    input_grads, deferred = backward_input((out,), (grad_out,), [x], params, _run_backward)
    assert CountingIdentity.calls == 1
    weight_grads = backward_weight(deferred, _run_backward)
    assert CountingIdentity.calls == 1, "W walked the input path again"
    assert deferred.outputs is None
    torch.testing.assert_close(input_grads[0], expected[x])
    for param, got in zip(params, weight_grads):
        if param is stage.unused:
            assert got is None
        else:
            torch.testing.assert_close(got, expected[param])


def test_a_first_stage_without_input_grads_falls_back_to_the_full_backward():
    torch.manual_seed(0)
    stage = Stage()
    params = list(stage.parameters())
    used = [p for p in params if p is not stage.unused]
    data = torch.randn(4, 8)
    grad_out = torch.randn(4, 8)
    expected = dict(zip(used, torch.autograd.grad(stage(data), used, grad_out)))

    input_grads, deferred = backward_input((stage(data),), (grad_out,), [], params, _run_backward)
    assert input_grads == ()
    weight_grads = backward_weight(deferred, _run_backward)
    for param, got in zip(params, weight_grads):
        if param is stage.unused:
            assert got is None
        else:
            torch.testing.assert_close(got, expected[param])
