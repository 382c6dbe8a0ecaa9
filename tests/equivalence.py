"""The central test's harness: a pipeline trains as the unsplit model does on one process, step for step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from models import HIDDEN
from ranks import held_stages, rank_device

import pipecomm

BATCH = 8
SEQ = 3
STEPS = 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# The Pipeline's cuda_graphs for each kind of run: "cuda-auto" leaves the default, which adopts graphs from step 3.
GRAPH_OPTION = {"cpu": "auto", "cuda": False, "cuda-graphs": True, "cuda-auto": "auto"}
# Every schedule with the fewest ranks that exercise it: (schedule, stages per rank).
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-h2", 1), ("zb-v", 2))


def mse(output, target):
    return nn.functional.mse_loss(output, target)


def float_batch(step: int):
    """(positional inputs, keyword inputs, target) of one step."""
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=generator),), {}, torch.randn(BATCH, SEQ, HIDDEN, generator=generator)


def one_process(stages, args, kwargs, target, loss_fn) -> torch.Tensor:
    """The unsplit model in plain PyTorch: each stage's output feeds the next as the pipeline passes it."""
    output = stages[0](*args, **kwargs)
    for stage in stages[1:]:
        output = stage(*output) if isinstance(output, tuple) else stage(output)
    loss = loss_fn(output, *(target if isinstance(target, tuple) else (target,)))
    if loss.requires_grad:  # not where every parameter is frozen
        loss.backward()
    return loss.detach()


def train_like_one_process(rank, world_size, build, make_batch, loss_fn, schedules=SCHEDULES, before_step=None,
                           steps=STEPS, micro_batches=4, prepare: Callable[[nn.Module], nn.Module] | None = None,
                           kind="cpu", **options) -> str:
    """For each schedule, ``steps`` AdamW steps of the pipeline against the unsplit model on this process's CPU:
    every step's loss and gradients, and every parameter at the end, to 1e-5 (1e-4 on GPUs: ``kind`` "cuda" or
    "cuda-graphs"). ``before_step(step, stages)`` may freeze or unfreeze parameters (applied to both). AdamW holds
    the frozen parameters too: a gradient invented for one would move it (weight decay). ``prepare`` turns each
    stage module the pipeline gets into what it runs (torch.compile, say: the reference stays eager); ``options``
    go to the Pipeline."""
    device = rank_device(rank, "cuda" if kind.startswith("cuda") else "cpu")
    tolerance = TOLERANCE if kind == "cpu" else dict(rtol=1e-4, atol=1e-5)
    for schedule, chunks in schedules:
        num_stages = world_size * chunks
        torch.manual_seed(0)
        stages = build(num_stages)
        reference = copy.deepcopy(stages)
        mine = held_stages(schedule, world_size, micro_batches, chunks, rank)
        modules = [stages[s].to(device) for s in mine]
        modules = [prepare(module) for module in modules] if prepare else modules
        pipe = pipecomm.Pipeline(modules, stage=mine, num_stages=num_stages, loss_fn=loss_fn,
                                 micro_batches=micro_batches, schedule=schedule, timeout=30,
                                 cuda_graphs=GRAPH_OPTION[kind], **options)
        named = [(f"{schedule}, stage {s}: {name}", p) for s in mine for name, p in stages[s].named_parameters()]
        ref_params = [p for s in mine for p in reference[s].parameters()]
        optimizer = torch.optim.AdamW({id(p): p for _, p in named}.values(), lr=1e-2)
        # A parameter several stages hold (a tied embedding and head) is one parameter to the optimizer.
        ref_optimizer = torch.optim.AdamW({id(p): p for stage in reference for p in stage.parameters()}.values(),
                                          lr=1e-2)
        for step in range(steps):
            if before_step:
                before_step(step, stages)
                before_step(step, reference)
            args, kwargs, target = make_batch(step)
            loss = pipe.step(*args, target=target, **kwargs)
            ref_loss = one_process(reference, args, kwargs, target, loss_fn)
            torch.testing.assert_close(loss.cpu(), ref_loss, **tolerance, msg=f"{schedule}: the loss of step {step}")
            for (name, param), ref_param in zip(named, ref_params):
                if ref_param.grad is None:
                    assert param.grad is None, f"{name} got a gradient at step {step}"
                else:
                    torch.testing.assert_close(param.grad.cpu(), ref_param.grad, **tolerance,
                                               msg=f"{name}, step {step}")
            optimizer.step()
            ref_optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
        for (name, param), ref_param in zip(named, ref_params):
            torch.testing.assert_close(param.detach().cpu(), ref_param.detach(), **tolerance, msg=name)
        if kind == "cuda-auto":  # every stage replayed graphs; a trial may drop those no faster than eager on the GPU
            assert all(state == "replaying" or state.startswith("eager: replaying its CUDA graphs took")
                       for state in pipe.cuda_graph_states.values()), (schedule, pipe.cuda_graph_states)
        pipe.close()
    return "ok"
