"""Compiled modules and the module wrappers users bring train exactly as one eager process under every schedule,
and a deferred weight gradient that would go missing is an error naming its layer."""

from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.utils import parametrizations

from equivalence import SCHEDULES, STEPS, float_batch, mse, train_like_one_process
from models import HIDDEN, Block
from ranks import needs_cuda, run_ranks

import pipecomm
from pipecomm.runtime import split_backward
from pipecomm.runtime.failure import PeerFailedError

ALL_SCHEDULES = (*SCHEDULES, ("auto", 1))
COUNTERS: list[CompileCounterWithBackend] = []  # this process's compilations, to check that compiled code ran


def blocks(num_stages: int) -> list[nn.Module]:
    """Two pre-norm blocks per stage, then a tanh: autograd saves the stage's output (tanh's), inside the compiled
    region when the whole stage is compiled, so the executor must keep it after the send."""
    return [nn.Sequential(Block(), Block(), nn.Tanh()) for _ in range(num_stages)]


def _backend(name: str) -> CompileCounterWithBackend:
    # Every build compiles anew: one cache grown over several schedules' stages would reach dynamo's recompile
    # limit, after which it runs the code eagerly without a word.
    torch._dynamo.reset()
    COUNTERS.append(CompileCounterWithBackend(name))
    return COUNTERS[-1]


def compile_blocks_in_place(stage: nn.Module, backend: str = "aot_eager") -> nn.Module:
    """torchtitan's recipe: each block compiled in place (``nn.Module.compile``)."""
    compiler = _backend(backend)
    for module in stage:
        if isinstance(module, Block):
            module.compile(backend=compiler)
    return stage


def compile_blocks_wrapped(stage: nn.Module, backend: str = "aot_eager") -> nn.Module:
    """Each block replaced by its ``torch.compile`` wrapper (``_orig_mod`` in the names)."""
    compiler = _backend(backend)
    return nn.Sequential(*(torch.compile(module, backend=compiler) if isinstance(module, Block) else module
                           for module in stage))


def compile_stage(stage: nn.Module, backend: str = "aot_eager") -> nn.Module:
    return torch.compile(stage, backend=_backend(backend))


PREPARE = {"blocks in place": compile_blocks_in_place, "wrapped blocks": compile_blocks_wrapped,
           "whole stage": compile_stage}


def train_compiled(rank: int, world_size: int, prepare: str, schedules, backend: str = "aot_eager",
                   options: dict | None = None) -> str:
    COUNTERS.clear()
    train_like_one_process(rank, world_size, blocks, float_batch, mse, schedules,
                           prepare=functools.partial(PREPARE[prepare], backend=backend),
                           steps=STEPS + 2 if ("auto", 1) in schedules else STEPS, **(options or {}))
    assert COUNTERS and all(counter.frame_count > 0 for counter in COUNTERS), "a compiled stage never compiled"
    return "ok"


@pytest.mark.parametrize("prepare", sorted(PREPARE))
def test_compiled_modules_train_exactly_under_every_schedule(tmp_path, prepare):
    assert run_ranks(2, train_compiled, tmp_path, prepare, ALL_SCHEDULES, timeout=300) == ["ok"] * 2


def test_inductor_compiled_blocks_train_exactly_under_zero_bubble(tmp_path):
    assert run_ranks(2, train_compiled, tmp_path, "blocks in place", (("zb-h1", 1),), "inductor",
                     timeout=300) == ["ok"] * 2


def recompute_blocks(module: nn.Module) -> bool:
    return isinstance(module, Block)


@pytest.mark.parametrize(("prepare", "recompute"), [("blocks in place", True), ("whole stage", recompute_blocks)],
                         ids=["blocks-in-place-recompute-all", "whole-stage-recompute-blocks"])
def test_compiled_modules_recompute_exactly(tmp_path, prepare, recompute):
    schedules = (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2))
    assert run_ranks(2, train_compiled, tmp_path, prepare, schedules, "aot_eager", {"recompute": recompute},
                     timeout=300) == ["ok"] * 2


# -- module wrappers -----------------------------------------------------------------------------


class Doubled(nn.Module):
    """A user's forward hook that rewrites a Linear's output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.proj.register_forward_hook(_double_output)
        self.proj.register_forward_pre_hook(_shift_input)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def _double_output(module, args, output):
    return output * 2


def _shift_input(module, args):
    return (args[0] + 1,)


class ScaledLinear(nn.Linear):
    """A Linear subclass with a forward of its own: the deferral must not assume nn.Linear's."""

    def __init__(self):
        super().__init__(HIDDEN, HIDDEN)
        self.gain = nn.Parameter(torch.full((HIDDEN,), 0.5))

    def forward(self, x):
        return nn.functional.linear(x, self.weight * self.gain[:, None], self.bias)


class Adapter(nn.Module):
    """A LoRA-style adapter around a frozen Linear, one of its own Linears called with its argument by keyword."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.down = nn.Linear(HIDDEN, 2, bias=False)
        self.up = nn.Linear(2, HIDDEN, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(input=x))


class Wrapped(nn.Module):
    """A parametrized (weight-normed) Linear, a subclassed one, a hooked one and an adapter in one stage."""

    def __init__(self):
        super().__init__()
        self.normed = parametrizations.weight_norm(nn.Linear(HIDDEN, HIDDEN))
        self.scaled = ScaledLinear()
        self.hooked = Doubled()
        self.adapter = Adapter()

    def forward(self, x):
        return x + self.adapter(self.hooked(self.scaled(torch.tanh(self.normed(x)))))


def wrapped_stages(num_stages: int) -> list[nn.Module]:
    return [Wrapped() for _ in range(num_stages)]


def wrappers(rank: int, world_size: int, compiled: bool) -> str:
    COUNTERS.clear()
    train_like_one_process(rank, world_size, wrapped_stages, float_batch, mse, SCHEDULES,
                           prepare=compile_stage if compiled else None)
    return "ok"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parametrized_subclassed_hooked_and_adapted_linears_train_exactly(tmp_path, compiled):
    assert run_ranks(2, wrappers, tmp_path, compiled, timeout=300) == ["ok"] * 2


def test_a_hook_computed_weight_gets_its_gradient_through_what_it_is_computed_from():
    """The old weight_norm sets ``weight`` in a forward pre-hook from two parameters: that layer is not deferred."""
    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated, not gone
            return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(HIDDEN, HIDDEN)), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN))

    model, reference = build(), build()
    (x,), _, target = float_batch(0)
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, loss_fn=mse, micro_batches=2, schedule="zb-h1")
    loss = pipe.step(x, target=target)
    pipe.close()
    ref_loss = sum(mse(reference(xs), ts) for xs, ts in zip(x.chunk(2), target.chunk(2))) / 2
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)


# -- the invariant -------------------------------------------------------------------------------


def _silent_backward(ctx, grad_output):
    """A deferral's backward that loses what W needs, as a traced region that does not call back would."""
    return grad_output, None, None, None, None


def lost_weight_gradient(rank: int, world_size: int) -> str:
    split_backward._ReportInput.backward = staticmethod(_silent_backward)
    torch.manual_seed(0)
    stages = blocks(world_size)
    pipe = pipecomm.Pipeline(stages[rank], stage=rank, num_stages=world_size, loss_fn=mse, micro_batches=2,
                             schedule="zb-h1", timeout=30)
    (x,), _, target = float_batch(0)
    with pytest.raises((RuntimeError, PeerFailedError)) as raised:
        pipe.step(x, target=target)
    return str(raised.value)


def test_a_deferred_weight_gradient_that_goes_missing_fails_the_step_on_every_rank_with_its_layer(tmp_path):
    messages = run_ranks(2, lost_weight_gradient, tmp_path, timeout=120)
    for message in messages:
        assert "0.proj" in message and "W pass" in message, message


def test_a_deferred_layer_whose_output_has_no_part_in_the_loss_is_no_error():
    """Nothing reaches such a layer's deferral in the backward, as nothing reaches its weight in one process."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            self.unused(x)
            return self.used(x)

    torch.manual_seed(0)
    model = Unused()
    reference = copy.deepcopy(model)
    (x,), _, target = float_batch(0)
    pipe = pipecomm.Pipeline(model, stage=0, num_stages=1, loss_fn=mse, micro_batches=2, schedule="zb-h1")
    pipe.step(x.requires_grad_(), target=target)
    pipe.close()
    (sum(mse(reference(xs), ts) for xs, ts in zip(x.chunk(2), target.chunk(2))) / 2).backward()
    assert model.unused.weight.grad is None and reference.unused.weight.grad is None
    torch.testing.assert_close(model.used.weight.grad, reference.used.weight.grad)


# -- GPUs ------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kind", ["cuda", "cuda-graphs"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_on_gpus_compiled_blocks_eager_and_replaying_cuda_graphs(tmp_path, kind, backend):
    schedules = (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2))
    assert run_ranks(2, train_compiled, tmp_path, "blocks in place", schedules, backend, {"kind": kind},
                     timeout=600) == ["ok"] * 2


def test_a_zero_bubble_schedule_that_defers_nothing_says_so_once():
    (x,), _, target = float_batch(0)
    for compiled in (False, True):
        torch.manual_seed(0)
        stage = blocks(1)[0]
        pipe = pipecomm.Pipeline(compile_stage(stage) if compiled else stage, stage=0, num_stages=1, loss_fn=mse,
                                 micro_batches=2, schedule="zb-h1")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.step(x, target=target)
            pipe.step(x, target=target)
        pipe.close()
        said = [str(warning.message) for warning in caught if "deferred its weight gradient" in str(warning.message)]
        assert len(said) == (1 if compiled else 0), said


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("how", ["in place", "wrapped", "whole stage"])
def test_modules_compiled_with_inductor_cuda_graphs_are_refused_by_name(how, mode):
    stage = blocks(1)[0]
    if how == "whole stage":
        stage, name = torch.compile(stage, mode=mode), "module"
    elif how == "wrapped":
        stage[1], name = torch.compile(stage[1], mode=mode), "'1'"
    else:
        stage[1].compile(mode=mode)
        name = "'1'"
    with pytest.raises(ValueError, match=re.escape(f"stage 0's {name} is compiled with inductor's CUDA graphs")):
        pipecomm.Pipeline(stage, stage=0, num_stages=1, loss_fn=mse, micro_batches=2)
    pipecomm.Pipeline(torch.compile(blocks(1)[0], mode="max-autotune-no-cudagraphs"), stage=0, num_stages=1,
                      loss_fn=mse, micro_batches=2).close()
