"""Real models, split by their own annotations with no adapters, train on CPU ranks exactly as one process does."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import DTensor

from models import CAUSAL_LMS, VOCAB, EmbeddingDropoutLM, LongSkip, ResidualCNN, bart, causal_lm, gpt2, llama
from ranks import held_stages, needs_cuda, rank_device, run_ranks

import pipecomm

BATCH, SEQ, STEPS = 8, 8, 3


def lm_loss(output, labels):
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def lm_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[::3, :2] = 0  # left padding on some rows
    return (data[:, :-1],), {"attention_mask": mask}, data[:, 1:]


def reference_step(model, inputs, kwargs, target, loss_fn, micro_batches: int):
    """One process, gradient accumulation over the same micro-batches, in plain PyTorch."""
    total = 0.0
    for index in range(micro_batches):
        def piece(value):
            return value.chunk(micro_batches)[index] if isinstance(value, torch.Tensor) else value
        output = model(*map(piece, inputs), **{key: piece(value) for key, value in kwargs.items()})
        loss = loss_fn(output, piece(target)) / micro_batches
        loss.backward()
        total += loss.detach()
    return total


def split_model(build, num_stages: int, make_batch, compile_blocks: bool = False, stages: list[int] | None = None,
                device: torch.device | None = None) -> tuple:
    """The model, its unsplit reference (eager), what counts the compiled blocks' compilations (with
    ``compile_blocks``: each block compiled in place first) and ``stages`` (default: every stage) of one capture."""
    model = build(num_stages)
    reference = copy.deepcopy(model)
    compiler = _compile_blocks(model) if compile_blocks else None
    inputs, kwargs, _ = make_batch(100)
    split = pipecomm.split(model, num_stages, list(range(num_stages)) if stages is None else stages,
                           example_inputs=tuple(value[:2] for value in inputs),
                           example_kwargs={key: value[:2] for key, value in kwargs.items()}, device=device)
    return model, reference, compiler, split


def train_ranks(tmp_path, world_size: int, build, loss_fn, make_batch, schedule, virtual: int, micro_batches: int,
                kind: str = "cpu", cuda_graphs: bool = False, compile_blocks: bool = False, timeout: float = 240) -> list:
    """train_and_compare on ``world_size`` ranks. On CPU the model is built and captured once, before the ranks are
    forked from that process, each rank taking its stages; on GPUs each rank splits onto its own device (a process
    that forks must not have used CUDA)."""
    splitter = functools.partial(split_model, build, world_size * virtual, make_batch, compile_blocks)
    args = (loss_fn, make_batch, schedule, virtual, micro_batches, kind, cuda_graphs)
    if kind == "cpu":
        return run_ranks(world_size, train_and_compare, tmp_path, *args, timeout=timeout, prepare=splitter)
    return run_ranks(world_size, train_and_compare, tmp_path, splitter, *args, timeout=timeout)


def train_and_compare(rank, world_size, split, loss_fn, make_batch, schedule, virtual, micro_batches, kind="cpu",
                      cuda_graphs=False):
    """3 AdamW steps of the split model against the unsplit one: every step's loss and, at the end, every parameter.
    ``split`` is split_model's result for every stage, or split_model waiting for this rank's stages and device."""
    device = rank_device(rank, kind)
    num_stages = world_size * virtual
    mine = held_stages(schedule, world_size, micro_batches, virtual, rank)
    if callable(split):
        model, reference, compiler, stages = split(mine, device)
    else:
        model, reference, compiler, every = split
        stages = [every[index] for index in mine]
    pipe = pipecomm.Pipeline(stages if virtual > 1 else stages[0], stage=mine if virtual > 1 else mine[0],
                             num_stages=num_stages, loss_fn=loss_fn, micro_batches=micro_batches, schedule=schedule,
                             timeout=60, cuda_graphs=cuda_graphs)
    params = dict(model.named_parameters(remove_duplicate=False))
    own = {name: param for stage in stages for name, param in stage.named_parameters()}
    optimizer = torch.optim.AdamW(list({id(p): p for p in pipe.parameters()}.values()), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tolerance = dict(rtol=1e-5, atol=1e-5) if kind == "cpu" else dict(rtol=1e-4, atol=1e-4)
    # "auto" switches to its plan after its third step: two more steps run the plan.
    for step in range(STEPS + 2 if schedule == "auto" else STEPS):
        inputs, kwargs, target = make_batch(step)
        loss = pipe.step(*inputs, target=target, **kwargs)
        ref_loss = reference_step(reference, inputs, kwargs, target, loss_fn, micro_batches)
        torch.testing.assert_close(loss.cpu(), ref_loss, **tolerance, msg=f"step {step}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in own.items():
        torch.testing.assert_close(param.detach().cpu(), ref_params[name].detach(), **tolerance, msg=name)
    ref_buffers = dict(reference.named_buffers())
    for stage in stages:  # BatchNorm statistics, updated micro-batch by micro-batch in both
        for name, buffer in stage.named_buffers():
            torch.testing.assert_close(buffer.cpu(), ref_buffers[name], **tolerance, msg=name)
    assert set(own) <= set(params)
    assert schedule != "auto" or pipe.planned_costs is not None, "auto never switched to its plan"
    assert compiler is None or compiler.frame_count > 0, "the compiled blocks never compiled"
    pipe.close()
    return "ok"


def _compile_blocks(model: nn.Module) -> CompileCounterWithBackend:
    """Compiles each block in place (torchtitan's recipe); counts what dynamo compiles."""
    compiler = CompileCounterWithBackend("aot_eager")
    for module in model.modules():
        if type(module).__name__.endswith(("GPT2Block", "LlamaDecoderLayer")):  # fully_shard's subclass: FSDP...
            module.compile(backend=compiler)
    return compiler


LM_CASES = [
    ("gpipe", 2, 1, 4), ("1f1b", 2, 1, 4), ("zb-h1", 2, 1, 4), ("interleaved-1f1b", 2, 2, 4), ("1f1b", 4, 1, 4),
    ("zb-v", 2, 2, 4), ("auto", 2, 1, 4),
]


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(("schedule", "world_size", "virtual", "micro_batches"), LM_CASES,
                         ids=[f"{case[0]}-{case[1]}ranks" for case in LM_CASES])
def test_hugging_face_language_models_train_exactly(tmp_path, build, schedule, world_size, virtual, micro_batches):
    assert train_ranks(tmp_path, world_size, build, lm_loss, lm_batch, schedule, virtual,
                       micro_batches) == ["ok"] * world_size


@pytest.mark.parametrize(("build", "schedule", "virtual"),
                         [(llama, "zb-h1", 1), (gpt2, "zb-v", 2), (llama, "auto", 1)],
                         ids=["llama-zb-h1", "gpt2-zb-v", "llama-auto"])
def test_hugging_face_blocks_compiled_before_the_split_train_exactly(tmp_path, build, schedule, virtual):
    assert train_ranks(tmp_path, 2, build, lm_loss, lm_batch, schedule, virtual, 4, "cpu", False, True,
                       timeout=300) == ["ok"] * 2


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@needs_cuda
def test_hugging_face_blocks_compiled_before_the_split_replay_cuda_graphs_exactly(tmp_path, schedule):
    assert train_ranks(tmp_path, 2, llama, lm_loss, lm_batch, schedule, 1, 4, "cuda", True, True,
                       timeout=300) == ["ok"] * 2


@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
def test_more_hugging_face_architectures_train_exactly(tmp_path, name):
    # zb-h1 splits every block's backward in two: the hardest path for experts, ALiBi and sliding windows.
    build = functools.partial(causal_lm, name)
    assert train_ranks(tmp_path, 2, build, lm_loss, lm_batch, "zb-h1", 1, 4) == ["ok"] * 2


def test_a_router_output_read_across_stages_is_refused_by_name():
    # The auxiliary loss reads every block's router logits, which a hook records: they never leave a stage.
    model = causal_lm("mixtral", 2, output_router_logits=True)
    inputs, kwargs, _ = lm_batch(0)
    with pytest.raises(ValueError, match=r"computed inside 'model\.layers\.0', is used outside it .*output_router_logits"):
        pipecomm.split(model, 2, [0], example_inputs=tuple(value[:2] for value in inputs),
                       example_kwargs={key: value[:2] for key, value in kwargs.items()})


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b"])
@needs_cuda
def test_hugging_face_language_models_train_exactly_on_one_gpu_over_ipc(tmp_path, build, schedule):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    assert train_ranks(tmp_path, 2, build, lm_loss, lm_batch, schedule, virtual, 4, "cuda") == ["ok"] * 2


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@needs_cuda
def test_hugging_face_language_models_replay_cuda_graphs_exactly(tmp_path, build, schedule):
    assert train_ranks(tmp_path, 2, build, lm_loss, lm_batch, schedule, 1, 4, "cuda", True) == ["ok"] * 2


def image_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 3, 8, 8, generator=generator),), {}, torch.randint(0, 5, (BATCH,), generator=generator)


def annotated_cnn(num_stages: int) -> ResidualCNN:
    torch.manual_seed(0)
    model = ResidualCNN()
    for index, module in enumerate([model.stem, model.conv1, model.conv2, model.head]):
        module.pipeline_stage = index * num_stages // 4
    return model


def vector_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 8, generator=generator),), {}, torch.randn(BATCH, 8, generator=generator)


def long_skip(num_stages: int) -> LongSkip:
    torch.manual_seed(0)
    return LongSkip()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_cnn_with_functional_ops_in_its_forward_trains_exactly(tmp_path, schedule):
    assert train_ranks(tmp_path, 2, annotated_cnn, nn.functional.cross_entropy, image_batch, schedule, 1, 4,
                       timeout=180) == ["ok"] * 2


def test_a_skip_over_four_stages_trains_exactly(tmp_path):
    assert train_ranks(tmp_path, 4, long_skip, nn.functional.mse_loss, vector_batch, "1f1b", 1, 4,
                       timeout=180) == ["ok"] * 4


class NormNet(nn.Module):
    """BatchNorm between two layers: its statistics are per micro-batch, in the pipeline as in accumulation."""

    def __init__(self, num_stages: int):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.second = nn.Linear(8, 8)
        self.first.pipeline_stage = self.norm.pipeline_stage = 0
        self.second.pipeline_stage = num_stages - 1

    def forward(self, x):
        return self.second(torch.relu(self.norm(self.first(x))))


def test_batch_norm_matches_accumulation_over_the_same_micro_batches(tmp_path):
    assert train_ranks(tmp_path, 2, NormNet, nn.functional.mse_loss, vector_batch, "1f1b", 1, 4,
                       timeout=180) == ["ok"] * 2


def seq2seq_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    ids, decoder_ids = (torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(2))
    return (ids,), {"decoder_input_ids": decoder_ids}, torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def logits_loss(output, labels):
    return nn.functional.cross_entropy(output.flatten(0, 1), labels.flatten())


def token_batch(step: int):
    inputs, _, target = lm_batch(step)
    return inputs, {}, target


def evaluation_between_steps(rank: int, world_size: int, split, make_batch, loss_fn, kind: str = "cpu") -> str:
    """A model whose own forward drops out by its training flag: steps in training mode (on GPUs, enough for the
    default CUDA graphs to be adopted), then an evaluation and a step in eval mode, deterministic and so exactly one
    process's, and back, with one Pipeline."""
    device = rank_device(rank, kind)
    model, reference, _, stages = split([rank], device) if callable(split) else split
    stage = stages[0] if callable(split) else stages[rank]
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=loss_fn, micro_batches=2, timeout=60)
    inputs, kwargs, target = make_batch(0)
    on_device = [tuple(value.to(device) for value in inputs), {key: value.to(device) for key, value in kwargs.items()},
                 target.to(device)]
    tolerance = dict(rtol=1e-5, atol=1e-5) if kind == "cpu" else dict(rtol=1e-4, atol=1e-4)
    reference_grads = None
    for evaluation in range(2):
        for _ in range(4):
            trained = pipe.step(*on_device[0], target=on_device[2], **on_device[1])
        model.eval()
        reference.eval()
        with torch.no_grad():
            expected = reference(*inputs, **kwargs)
        evaluated = pipe.forward(*on_device[0], broadcast_result=True, **on_device[1])
        torch.testing.assert_close(getattr(evaluated, "logits", evaluated).cpu(), getattr(expected, "logits", expected),
                                   **tolerance)
        stage.zero_grad()
        loss = pipe.step(*on_device[0], target=on_device[2], **on_device[1])
        if reference_grads is None:
            torch.testing.assert_close(loss.cpu(), reference_step(reference, inputs, kwargs, target, loss_fn, 2),
                                       **tolerance)
            reference_grads = {name: param.grad for name, param in reference.named_parameters(remove_duplicate=False)}
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad.cpu(), reference_grads[name], **tolerance, msg=name)
        assert not torch.equal(trained, loss)  # the training steps' dropout ran
        model.train()
        stage.zero_grad()
    pipe.close()
    return "ok"


def test_a_model_reading_its_training_flag_evaluates_between_steps_exactly(tmp_path):
    splitter = functools.partial(split_model, bart, 2, seq2seq_batch)
    assert run_ranks(2, evaluation_between_steps, tmp_path, seq2seq_batch, lm_loss, timeout=240,
                     prepare=splitter) == ["ok"] * 2


@needs_cuda
def test_a_model_reading_its_training_flag_evaluates_between_steps_exactly_under_cuda_graphs(tmp_path):
    splitter = functools.partial(split_model, EmbeddingDropoutLM, 2, token_batch, False)
    assert run_ranks(2, evaluation_between_steps, tmp_path, splitter, token_batch, logits_loss, "cuda",
                     timeout=300) == ["ok"] * 2


def greedy_decoding(rank: int, world_size: int, batch: int) -> str:
    model = gpt2(world_size)
    reference = copy.deepcopy(model).eval()
    prompt = torch.randint(0, VOCAB, (batch, 4), generator=torch.Generator().manual_seed(5))
    stage = pipecomm.split(model, world_size, rank, example_inputs=(prompt[:2] if batch > 1 else prompt.repeat(2, 1),))
    stage.eval()
    pipe = pipecomm.Pipeline(stage, stage=rank, num_stages=world_size, loss_fn=lm_loss, micro_batches=4, timeout=60)
    tokens = expected = prompt
    for _ in range(8):
        logits = pipe.forward(tokens, broadcast_result=True).logits
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        with torch.no_grad():
            ref_logits = reference(expected).logits
        expected = torch.cat([expected, ref_logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, expected)
    pipe.close()
    return "ok"


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_decoding_token_for_token_with_a_broadcast_result(tmp_path, batch):
    assert run_ranks(2, greedy_decoding, tmp_path, batch, timeout=180) == ["ok"] * 2


def fsdp_and_pipeline(rank, world_size, split, schedule, compile_blocks=False):
    """pp 2 × FSDP dp 2: each transformer block sharded over the replicas (the tied embedding and head stay whole),
    3 AdamW steps against one process accumulating over the same micro-batches of the global batch; with
    ``compile_blocks``, each sharded block then compiled in place. ``split``: split_model's, for both stages."""
    from torch.distributed.fsdp import fully_shard

    ctx = pipecomm.init(pipeline_size=2, data_size=2)
    micro_batches = 2
    _, reference, _, every = split
    stage = every[ctx.stage]
    blocks = [module for module in stage.modules() if type(module).__name__ in ("GPT2Block", "LlamaDecoderLayer")]
    assert blocks
    for block in blocks:
        fully_shard(block, mesh=ctx.mesh["dp"])
    compiler = _compile_blocks(stage) if compile_blocks else None
    pipe = pipecomm.Pipeline(stage, stage=ctx.stage, num_stages=2, loss_fn=lm_loss, micro_batches=micro_batches,
                             schedule=schedule, group=ctx.pipeline_group, data_group=ctx.data_group, timeout=60)
    optimizer = torch.optim.AdamW(list({id(p): p for p in pipe.parameters()}.values()), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    share = slice(BATCH // 2 * ctx.dp_rank, BATCH // 2 * (ctx.dp_rank + 1))
    for step in range(STEPS):
        inputs, kwargs, target = lm_batch(step)
        pipe.step(*(value[share] for value in inputs), target=target[share],
                  **{key: value[share] for key, value in kwargs.items()})
        reference_step(reference, inputs, kwargs, target, lm_loss, 2 * micro_batches)
        for optim in (optimizer, ref_optimizer):
            optim.step()
            optim.zero_grad()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in stage.named_parameters():
        param = param.full_tensor() if isinstance(param, DTensor) else param
        torch.testing.assert_close(param.detach(), ref_params[name].detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert compiler is None or compiler.frame_count > 0, "the compiled blocks never compiled"
    pipe.close()
    return "ok"


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_hugging_face_models_with_fsdp_blocks_train_exactly(tmp_path, build, schedule):
    assert run_ranks(4, fsdp_and_pipeline, tmp_path, schedule, timeout=240,
                     prepare=functools.partial(split_model, build, 2, lm_batch)) == ["ok"] * 4


def test_fsdp_sharded_blocks_compiled_in_place_train_exactly_under_zero_bubble(tmp_path):
    assert run_ranks(4, fsdp_and_pipeline, tmp_path, "zb-h1", True, timeout=300,
                     prepare=functools.partial(split_model, llama, 2, lm_batch)) == ["ok"] * 4
