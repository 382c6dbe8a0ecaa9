"""One GPU: peak memory and time of 1F1B's first stage with and without recomputation (Pipeline(recompute=...)) and
activation offload (Pipeline(offload=...)).

The stage is stage 0 of an 8-layer stack split into p stages (8 / p layers, bf16), on the compute config by default
(d = 2048, seq = 1024, micro-batch size 4). ``--model gpt`` (default): e2e.py's GPT blocks, on hidden states.
``--model llama``: a transformers Llama built from a LlamaConfig (no download; the config's d, heads and
seq, a quarter of the heads for keys and values, MLP 2.75 d, vocabulary 32000), on token ids: its stage 0 is the
embedding and the first 8 / p decoder layers in llama_stage.py's LlamaStage, which computes the positions and rotary
embeddings inside the stage and runs causal sdpa with no mask, as LlamaModel does without padding.
Each round runs that stage's passes of a 1F1B step of 2p micro-batches in their order (p forwards, then one backward
and one forward in turn, then the last backwards; random output gradients). The other stages' passes are left out;
the time the stage waits for them in a pipeline is timed both ways: "alone" runs the passes back to back, "in the
pipeline" idles the GPU before each pass (a sleep kernel) as long as the simulated 1F1B step, at this mode's
measured F and B on every stage, has stage 0 wait there. Offload hides its copies in those waits, so only the
second says what it costs. At its peak the stage holds p micro-batches between forward and backward. Each
forward sends nothing but has its output freed as the executor frees a sent output (when
nothing autograd saved shares its storage), so the memory is what the pipeline keeps.
Modes: none; stage (``recompute=True``: each stage forward recomputed during its backward); layers (the callable
picking each GPT block or Llama decoder layer); offload (the saved activations the plan picks go to pinned host
memory after their forward and come back before their backward, on side streams: ``plan_offload`` for the 1F1B
schedule of p stages, from this stage's F and B and the bytes and copy speeds measured here); offload+stage (both).
Per mode: peak = torch.cuda.max_memory_allocated over the timed rounds; above_base = peak minus what is allocated
before a round (weights, gradients, the batch); kept = the bytes of the storages autograd keeps per micro-batch,
parameters aside (counted on any device); ms per micro-batch forward + backward, alone, and the round's time per
micro-batch in the pipeline (CUDA events); offloaded = how many of the round's micro-batches the plan sends to host
memory. The copy speeds each way are printed.
--smoke runs toy sizes on the CPU (no memory counter there but kept; offload copies host to host) to check the
control flow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipecomm.runtime import stage_runner  # noqa: E402
from pipecomm.runtime.offload import ActivationOffloader  # noqa: E402
from pipecomm.runtime.offload_planner import copy_speeds  # noqa: E402
from pipecomm.runtime.recompute import checkpoint_stages  # noqa: E402
from pipecomm.schedules.offload import plan_offload  # noqa: E402
from pipecomm.schedules.schedule import make_schedule  # noqa: E402
from pipecomm.schedules.simulation import simulate  # noqa: E402
from _common import elapsed_ms, environment, print_environment, print_table, write_json  # noqa: E402
from e2e import Config, build_chunk, config_named, make_batch  # noqa: E402
from llama_stage import LlamaStage, llama_config  # noqa: E402

LAYERS = 8  # in the whole stack, e2e.py's and the Llama's
MODELS = {"gpt": "e2e.py's GPT blocks", "llama": "transformers Llama: embedding + decoder layers"}
LLAMA_VOCAB = {"gpu": 32000, "smoke": 256}
MODES = ("none", "stage", "layers", "offload", "offload+stage")
COLUMNS = ["p", "mode", "layers", "peak_GiB", "above_base_GiB", "kept_MiB", "ms_per_micro_batch", "pipeline_ms",
           "offloaded", "peak/none", "time/none", "pipeline/none"]


class _Kept:
    """Adds up the bytes of each new storage autograd saves during a forward, parameters aside."""

    def __init__(self, parameters: set[int]):
        self.parameters = parameters
        self.pointers: set[int] = set()
        self.nbytes = 0

    def observe(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self.pointers and pointer not in self.parameters:
            self.pointers.add(pointer)
            self.nbytes += tensor.untyped_storage().nbytes()
        return tensor.detach()  # as autograd would hold it: a new tensor on the same storage


def build_stage(model: str, config: Config, size: str, layers: range, device: torch.device,
                dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, list[nn.Module]]:
    """Stage 0 of ``model`` holding ``layers``, one micro-batch of its inputs, and its layers (what the "layers"
    mode recomputes each of); size is "gpu" or "smoke". Either stage outputs hidden states (micro-batch size, seq,
    hidden)."""
    if model == "gpt":
        module = build_chunk(layers, config, device, dtype)
        inputs, _ = make_batch(config, device, dtype)
        return module, inputs[: config.micro_batch_size], list(module)
    vocab = LLAMA_VOCAB[size]
    llama = llama_config(config.hidden, LAYERS, config.seq, vocab, intermediate_size=11 * config.hidden // 4,
                         num_attention_heads=config.heads, num_key_value_heads=max(1, config.heads // 4))
    with torch.device(device):
        module = LlamaStage(llama, layers, first=True, last=False).to(dtype)
    generator = torch.Generator(device).manual_seed(7)
    tokens = torch.randint(0, vocab, (config.micro_batch_size, config.seq), generator=generator, device=device)
    return module, tokens, list(module.layers)


def idle_before_each_pass(passes) -> dict:
    """Seconds stage 0 waits before each of its compute passes (by action) in a simulated timeline ((start, end,
    action) per pass)."""
    idle, free_at = {}, 0.0
    for start, end, action in passes:
        idle[action] = max(0.0, start - free_at)
        free_at = end
    return idle


_SLEEP_CYCLES_PER_SECOND: dict[torch.device, float] = {}


def idle_for(seconds: float, device: torch.device) -> None:
    """The device's compute stream idles ``seconds`` (a one-block sleep kernel; side streams go on); the host, on the
    CPU."""
    if device.type != "cuda":
        time.sleep(seconds)
        return
    if device not in _SLEEP_CYCLES_PER_SECOND:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # the first launch loads the kernel
        _SLEEP_CYCLES_PER_SECOND[device] = cycles / (elapsed_ms(lambda: torch.cuda._sleep(cycles), device) / 1e3)
    torch.cuda._sleep(int(seconds * _SLEEP_CYCLES_PER_SECOND[device]))


def recompute_for(mode: str, layers: list[nn.Module]) -> bool | Callable[[nn.Module], bool]:
    """A mode's Pipeline(recompute=...): each of the stage's layers, the whole stage, or nothing."""
    if mode == "layers":
        return lambda module: any(module is layer for layer in layers)
    return mode.endswith("stage")


def measure(model: str, config_name: str, p: int, mode: str, device: torch.device, dtype: torch.dtype, warmup: int,
            rounds: int, speeds: tuple[float, float]) -> dict:
    size = "gpu" if device.type == "cuda" else "smoke"
    config = config_named(config_name, size)
    layers = range(LAYERS // p)
    module, inputs, stage_layers = build_stage(model, config, size, layers, device, dtype)
    undo = checkpoint_stages([module], recompute_for(mode, stage_layers))
    schedule = make_schedule("1f1b", p, 2 * p)
    inputs = inputs.repeat(2 * p, *[1] * (inputs.dim() - 1))
    micro_batches = inputs.chunk(2 * p)  # the first stage's inputs need no gradient
    output_grads = [torch.randn(config.micro_batch_size, config.seq, config.hidden, device=device, dtype=dtype)
                    for _ in micro_batches]
    parameters = {param.untyped_storage().data_ptr() for param in module.parameters()}
    order = schedule.actions[0]
    kept: list[int] = []
    cuda = device.type == "cuda"
    pass_times: dict[str, list[float]] = {"F": [], "B": []}

    def timed(kind: str, work) -> None:
        pass_times[kind].append(elapsed_ms(work, device) / 1e3)

    def one_round(offloader: ActivationOffloader | None = None, reloads: dict | None = None,
                  time_passes: bool = False, idle: dict | None = None) -> None:
        outputs = {}
        if offloader:
            offloader.start()
        else:
            kept.clear()
        for index, action in enumerate(order):
            for wait in (reloads or {}).get(index, ()):
                offloader.reload(wait)
            if idle and idle.get(action, 0.0) > 0:
                idle_for(idle[action], device)
            micro_batch = action.micro_batch
            if action.kind == "F":
                def forward() -> None:
                    if offloader:  # its hooks, innermost, see what the forward saves: kept is the first round's
                        with offloader.saving((0, micro_batch, "F")):
                            output = module(micro_batches[micro_batch])
                        offloader.offload((0, micro_batch, "F"))
                    else:
                        saved = _Kept(parameters)
                        with saved.observe():
                            output = module(micro_batches[micro_batch])
                        kept.append(saved.nbytes)
                    stage_runner.free_data(stage_runner.held_only_by_themselves([output]))  # as after its send
                    outputs[micro_batch] = output
                timed("F", forward) if time_passes else forward()
            elif action.kind == "B":
                def backward() -> None:
                    stage_runner.run_backward([outputs.pop(micro_batch)], [output_grads[micro_batch]],
                                              list(module.parameters()), keep_graph=False)
                    if offloader:
                        offloader.forget((0, micro_batch, "F"))
                timed("B", backward) if time_passes else backward()
        module.zero_grad(set_to_none=True)

    offloader, reloads, offloaded = None, None, 0
    for _ in range(warmup):
        one_round()
    one_round(time_passes=True)
    costs = {kind: statistics.median(times) for kind, times in pass_times.items()}
    # Only stage 0 runs here: the others take as long as it does, as on a balanced pipeline.
    timeline = simulate(schedule, costs).timeline
    idle = idle_before_each_pass(timeline[0])
    if mode.startswith("offload"):
        activation_bytes = statistics.median(kept)
        plan = plan_offload(schedule, timeline, activation_bytes / speeds[0], activation_bytes / speeds[1])
        offloader = ActivationOffloader(device, plan.offloaded[0], [module])
        reloads = plan.reloads_at(0)
        offloaded = len(plan.offloaded[0])
        one_round(offloader, reloads, idle=idle)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)

    def timed_round(idle: dict | None) -> float:
        """One round's milliseconds per micro-batch."""
        return elapsed_ms(lambda: one_round(offloader, reloads, idle=idle), device) / len(micro_batches)

    alone = [timed_round(None) for _ in range(rounds)]
    in_pipeline = [timed_round(idle) for _ in range(rounds)]
    row = {"p": p, "mode": mode, "layers": len(layers), "kept_MiB": statistics.mean(kept) / 2**20,
           "ms_per_micro_batch": statistics.median(alone), "pipeline_ms": statistics.median(in_pipeline),
           "offloaded": offloaded}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        row.update(peak_GiB=peak / 2**30, above_base_GiB=(peak - base) / 2**30)
    undo()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="gpt",
                        help="gpt: e2e.py's GPT blocks; llama: a transformers Llama built from a config")
    parser.add_argument("--config", default="compute")
    parser.add_argument("--stages", default="2,4", help="pipeline sizes p: stage 0 holds 8 / p layers and p "
                                                        "micro-batches in flight")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: the control flow only")
    parser.add_argument("--json", help="write the environment and rows here")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    env = environment(device)
    print_environment(env)
    speeds = copy_speeds(device)
    env["copy_GB_per_s"] = {"to_host": speeds[0] / 1e9, "to_device": speeds[1] / 1e9}
    print(f"# copies between device and pinned host memory: {speeds[0] / 1e9:.1f} GB/s out, "
          f"{speeds[1] / 1e9:.1f} GB/s back")
    rows = []
    for p in (int(value) for value in args.stages.split(",")):
        measured = []
        for mode in modes:
            measured.append(measure(args.model, args.config, p, mode, device, dtype, args.warmup, args.rounds, speeds))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the mode's stage and activations are gone with its frame
        baseline = next((row for row in measured if row["mode"] == "none"), None)
        for row in measured:
            if baseline and row.get("peak_GiB") is not None:
                row["peak/none"] = row["peak_GiB"] / baseline["peak_GiB"]
            if baseline:
                row["time/none"] = row["ms_per_micro_batch"] / baseline["ms_per_micro_batch"]
                row["pipeline/none"] = row["pipeline_ms"] / baseline["pipeline_ms"]
        rows += measured
    print(f"# {args.config}, {args.model} ({MODELS[args.model]}): 1F1B stage 0 of p stages, 2p micro-batches "
          f"(p in flight at the peak), on {device}")
    print_table(rows, COLUMNS)
    if args.json:
        write_json(args.json, {"env": env, "model": args.model, "config": args.config, "rows": rows})


if __name__ == "__main__":
    main()
