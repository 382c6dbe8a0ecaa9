"""GPU benchmark: pipecomm.pack / unpack_ vs torch.cat and per-tensor slice copies."""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable

import torch

from _common import (
    MIXED_DTYPES,
    environment,
    gb_per_s,
    mixed_tensors,
    print_environment,
    print_table,
    random_tensor,
    time_on,
    write_json,
)

import pipecomm

TABLE_COLUMNS = ["case", "tensors", "MB", "op", "method", "ms", "GB/s", "vs_torch"]


def small_tensors(count: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for index in range(count):
        dtype = MIXED_DTYPES[index % len(MIXED_DTYPES)]
        element_size = torch.empty((), dtype=dtype).element_size()
        nbytes = int(torch.randint(1024, 8193, (), generator=generator))
        tensors.append(random_tensor((nbytes // element_size,), dtype, device))
    return tensors


def boundary_tensors(micro_batch: int, seq: int, hidden: int, device: torch.device) -> list[torch.Tensor]:
    """What one pipeline stage typically sends the next: activations, attention mask, token ids."""
    return [
        random_tensor((micro_batch, seq, hidden), torch.bfloat16, device),
        random_tensor((micro_batch, seq), torch.bool, device),
        random_tensor((micro_batch, seq), torch.int64, device),
    ]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def torch_pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([as_bytes(tensor) for tensor in tensors])


def byte_spans(tensors: list[torch.Tensor], align: int) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((offset, offset + nbytes))
        offset += (nbytes + align - 1) // align * align
    return spans


def torch_unpack(flat: torch.Tensor, out_bytes: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
    for out, (start, end) in zip(out_bytes, spans):
        out.copy_(flat[start:end])


def check_round_trips(tensors: list[torch.Tensor]) -> None:
    packed = pipecomm.pack(tensors)
    dense = torch_pack(tensors)
    pipecomm_spans = byte_spans(tensors, align=16)
    if not torch.equal(torch.cat([packed[start:end] for start, end in pipecomm_spans]), dense):
        raise SystemExit("pipecomm.pack bytes disagree with torch.cat")
    outs = [torch.empty_like(tensor) for tensor in tensors]
    pipecomm.unpack_(packed, outs)
    if not all(torch.equal(out, tensor) for out, tensor in zip(outs, tensors)):
        raise SystemExit("pipecomm.unpack_ did not restore the packed tensors")


def bench_case(case: str, tensors: list[torch.Tensor], device: torch.device, warmup: int,
               iters: int) -> list[dict[str, object]]:
    data_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    moved_bytes = 2 * data_bytes  # every byte is read once and written once
    print(f"[{case}] {len(tensors)} tensors, {data_bytes / 1e6:.1f} MB", file=sys.stderr, flush=True)
    check_round_trips(tensors)

    packed = pipecomm.pack(tensors)
    dense = torch_pack(tensors)
    pipecomm_outs = [torch.empty_like(tensor) for tensor in tensors]
    torch_out_bytes = [as_bytes(torch.empty_like(tensor)) for tensor in tensors]
    dense_spans = byte_spans(tensors, align=1)

    methods: dict[tuple[str, str], Callable[[], object]] = {
        ("pack", "pipecomm"): lambda: pipecomm.pack(tensors),
        ("pack", "torch"): lambda: torch_pack(tensors),
        ("unpack", "pipecomm"): lambda: pipecomm.unpack_(packed, pipecomm_outs),
        ("unpack", "torch"): lambda: torch_unpack(dense, torch_out_bytes, dense_spans),
    }
    milliseconds = {key: time_on(device, fn, warmup, iters) for key, fn in methods.items()}

    rows = []
    for (op, method), ms in milliseconds.items():
        gbps = gb_per_s(moved_bytes, ms)
        torch_gbps = gb_per_s(moved_bytes, milliseconds[(op, "torch")])
        rows.append({"case": case, "tensors": len(tensors), "MB": data_bytes / 1e6, "op": op, "method": method,
                     "ms": ms, "bytes": moved_bytes, "GB/s": gbps, "vs_torch": gbps / torch_gbps})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write all numbers to this JSON file")
    parser.add_argument("--mixed-mb", default="64,256",
                        help="comma-separated totals (MB) for the 8-mixed-tensor cases (default 64,256)")
    parser.add_argument("--small-count", type=int, default=64, help="tensors in the small-tensors case")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    # CPU smoke-test path (e.g. --device cpu --mixed-mb 4); not a benchmark.
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and pipecomm.cuda_built()):
        raise SystemExit("needs a CUDA device and a pipecomm build with CUDA kernels")
    torch.manual_seed(0)
    env = environment(device)

    cases: dict[str, Callable[[], list[torch.Tensor]]] = {}
    for megabytes in (int(mb) for mb in args.mixed_mb.split(",") if mb):
        cases[f"mixed8_{megabytes}MB"] = lambda mb=megabytes: mixed_tensors(mb * 10**6, device)
    cases[f"small{args.small_count}"] = lambda: small_tensors(args.small_count, device)
    cases["boundary"] = lambda: boundary_tensors(args.micro_batch, args.seq, args.hidden, device)

    rows = []
    for case, make in cases.items():
        rows += bench_case(case, make(), device, args.warmup, args.iters)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print_environment(env)
    print("# GB/s counts each tensor byte read once and written once; torch = torch.cat / slice + copy_")
    print_table(rows, TABLE_COLUMNS)
    if args.json:
        write_json(args.json, {"env": env, "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
