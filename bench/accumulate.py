"""GPU benchmark: pipecomm.accumulate_ vs a per-tensor add_ loop, torch._foreach_add_ and a copy ceiling."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from _common import environment, gb_per_s, print_environment, print_table, time_on, write_json

import pipecomm

DTYPE_CASES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    # name: (accumulator dtype, grad dtype)
    "bf16->fp32": (torch.float32, torch.bfloat16),
    "fp32->fp32": (torch.float32, torch.float32),
}

TABLE_COLUMNS = ["case", "dtypes", "tensors", "params", "method", "ms", "GB/s", "vs_copy", "vs_foreach"]


@dataclass(frozen=True)
class GptConfig:
    hidden: int
    vocab: int
    context: int
    layers: int


def gpt_fixed_params(hidden: int, vocab: int, context: int) -> int:
    return (vocab + context) * hidden + 2 * hidden  # embeddings + final layernorm


def gpt_layer_params(hidden: int) -> int:
    return 12 * hidden * hidden + 13 * hidden  # qkv, out-proj, 2 mlp matrices, their biases, 2 layernorms


def fit_gpt_config(target_params: float, hidden: int | None, vocab: int | None, context: int) -> GptConfig:
    """Pick the layer count that lands nearest target_params.

    Without an explicit --hidden, hidden/vocab/context shrink together until a dozen layers fit,
    so tiny smoke-test targets still produce a many-tensor, transformer-shaped list.
    """
    if hidden is None:
        hidden, vocab_guess = 2048, vocab or 50304
        while (hidden > 64
               and gpt_fixed_params(hidden, vocab_guess, context) + 12 * gpt_layer_params(hidden) > target_params):
            hidden, vocab_guess, context = hidden // 2, vocab_guess // 2, max(context // 2, 16)
        vocab = vocab_guess
    vocab = vocab or 50304
    remaining = target_params - gpt_fixed_params(hidden, vocab, context)
    layers = max(1, round(remaining / gpt_layer_params(hidden)))
    return GptConfig(hidden=hidden, vocab=vocab, context=context, layers=layers)


def gpt_shapes(config: GptConfig) -> list[tuple[int, ...]]:
    h = config.hidden
    shapes: list[tuple[int, ...]] = [(config.vocab, h), (config.context, h)]
    for _ in range(config.layers):
        shapes += [
            (h,), (h,),  # layernorm 1 weight, bias
            (3 * h, h), (3 * h,),  # qkv
            (h, h), (h,),  # attention out-projection
            (h,), (h,),  # layernorm 2 weight, bias
            (4 * h, h), (4 * h,),  # mlp up
            (h, 4 * h), (h,),  # mlp down
        ]
    shapes += [(h,), (h,)]  # final layernorm
    return shapes


def small_shapes(count: int, max_numel: int, seed: int = 0) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(n,) for n in torch.randint(1, max_numel + 1, (count,), generator=generator).tolist()]


def numel_of(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_lists(
    shapes: list[tuple[int, ...]], acc_dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    accumulators = [torch.randn(shape, dtype=acc_dtype, device=device) for shape in shapes]
    grads = [torch.randn(shape, dtype=grad_dtype, device=device) for shape in shapes]
    return accumulators, grads


def check_pipecomm_matches_foreach(
    accumulators: list[torch.Tensor], grads: list[torch.Tensor], scale: float
) -> None:
    expected = [acc.clone() for acc in accumulators]
    torch._foreach_add_(expected, grads, alpha=scale)
    pipecomm.accumulate_(accumulators, grads, scale)
    mismatched = [
        index
        for index, (got, want) in enumerate(zip(accumulators, expected))
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    ]
    if mismatched:
        raise SystemExit(f"pipecomm.accumulate_ disagrees with torch._foreach_add_ on tensors {mismatched[:10]}")


def bench_case(
    case: str,
    shapes: list[tuple[int, ...]],
    dtype_case: str,
    device: torch.device,
    scale: float,
    warmup: int,
    iters: int,
) -> list[dict[str, object]]:
    acc_dtype, grad_dtype = DTYPE_CASES[dtype_case]
    params = sum(numel_of(shape) for shape in shapes)
    acc_size = torch.empty((), dtype=acc_dtype).element_size()
    grad_size = torch.empty((), dtype=grad_dtype).element_size()
    traffic_bytes = params * (2 * acc_size + grad_size)  # accumulator read + write, grad read
    common = {"case": case, "dtypes": dtype_case, "tensors": len(shapes), "params": params}
    print(f"[{case} {dtype_case}] {len(shapes)} tensors, {params / 1e9:.3f} G params", file=sys.stderr, flush=True)

    accumulators, grads = make_lists(shapes, acc_dtype, grad_dtype, device)
    check_pipecomm_matches_foreach(accumulators, grads, scale)
    free_memory()

    def per_tensor_loop() -> None:
        for acc, grad in zip(accumulators, grads):
            acc.add_(grad, alpha=scale)

    methods: dict[str, Callable[[], object]] = {
        "per_tensor_loop": per_tensor_loop,
        "foreach": lambda: torch._foreach_add_(accumulators, grads, alpha=scale),
        "pipecomm": lambda: pipecomm.accumulate_(accumulators, grads, scale),
    }
    milliseconds = {name: time_on(device, fn, warmup, iters) for name, fn in methods.items()}
    del accumulators, grads, methods, per_tensor_loop
    free_memory()

    # Ceiling: one flat device-to-device copy moving the same bytes (read + write) as the accumulate.
    copy_elements = traffic_bytes // 2 // 4
    source = torch.empty(copy_elements, dtype=torch.float32, device=device).normal_()
    destination = torch.empty_like(source)
    copy_bytes = 2 * copy_elements * 4
    copy_ms = time_on(device, lambda: destination.copy_(source), warmup, iters)
    del source, destination
    free_memory()

    copy_gbps = gb_per_s(copy_bytes, copy_ms)
    foreach_gbps = gb_per_s(traffic_bytes, milliseconds["foreach"])
    rows = []
    for name, ms in milliseconds.items():
        gbps = gb_per_s(traffic_bytes, ms)
        rows.append({
            **common,
            "method": name,
            "ms": ms,
            "bytes": traffic_bytes,
            "GB/s": gbps,
            "vs_copy": gbps / copy_gbps,
            "vs_foreach": gbps / foreach_gbps,
        })
    rows.append({**common, "method": "copy_ceiling", "ms": copy_ms, "bytes": copy_bytes, "GB/s": copy_gbps,
                 "vs_copy": 1.0, "vs_foreach": copy_gbps / foreach_gbps})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write all numbers to this JSON file")
    parser.add_argument("--scale-params", type=float, default=1.6e9,
                        help="target parameter count of the GPT-like list (default 1.6e9)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size of the GPT-like list (default 2048, layer count fitted to the target)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 50304)")
    parser.add_argument("--context", type=int, default=2048, help="position-embedding rows (default 2048)")
    parser.add_argument("--small-count", type=int, default=20000, help="tensors in the many-small-tensors case")
    parser.add_argument("--small-max-numel", type=int, default=4096, help="largest small tensor (elements)")
    parser.add_argument("--cases", default="gpt,small", help="comma-separated subset of: gpt, small")
    parser.add_argument("--dtypes", default=",".join(DTYPE_CASES),
                        help=f"comma-separated subset of: {', '.join(DTYPE_CASES)}")
    parser.add_argument("--scale", type=float, default=1e-3,
                        help="accumulate scale; small so repeated timing iterations stay finite")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    # CPU smoke-test path (e.g. --device cpu --scale-params 1e6 --small-count 200); not a benchmark.
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        if case not in ("gpt", "small"):
            parser.error(f"unknown case {case!r}")
    for dtype_case in args.dtypes.split(","):
        if dtype_case not in DTYPE_CASES:
            parser.error(f"unknown dtype case {dtype_case!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and pipecomm.cuda_built()):
        raise SystemExit("needs a CUDA device and a pipecomm build with CUDA kernels")
    torch.manual_seed(0)

    env = environment(device)
    config = fit_gpt_config(args.scale_params, args.hidden, args.vocab, args.context)
    shape_sets = {
        "gpt": gpt_shapes(config),
        "small": small_shapes(args.small_count, args.small_max_numel),
    }
    rows = []
    for case in args.cases.split(","):
        for dtype_case in args.dtypes.split(","):
            rows += bench_case(case, shape_sets[case], dtype_case, device, args.scale, args.warmup, args.iters)

    print_environment(env)
    print(f"# gpt case: hidden {config.hidden}, layers {config.layers}, vocab {config.vocab}, "
          f"context {config.context}; GB/s counts accumulator read + write + grad read")
    print_table(rows, TABLE_COLUMNS)
    if args.json:
        write_json(args.json, {"env": env, "config": {**vars(args), "gpt": vars(config)}, "rows": rows})


if __name__ == "__main__":
    main()
