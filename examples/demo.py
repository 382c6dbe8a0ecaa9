"""Demo until the scheduler lands: checks pipecomm's kernels against PyTorch and times them against its peers."""

import time

import torch

import pipecomm


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() and pipecomm.cuda_built() else [])


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_kernels(device: str) -> None:
    sizes = [0, 1, 3, 1023, 65537, 300_001]
    accumulators = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
    expected = [a + 0.5 * g.float() for a, g in zip(accumulators, grads)]
    pipecomm.accumulate_(accumulators, grads, 0.5)
    for got, want in zip(accumulators, expected):
        torch.testing.assert_close(got, want)
    message = [torch.randn(4, 17, device=device), torch.rand(4, 17, device=device) > 0.5,
               torch.randint(0, 50_000, (4, 17), device=device)]
    outs = [torch.empty_like(t) for t in message]
    pipecomm.unpack_(pipecomm.pack(message), outs)
    assert all(torch.equal(a, b) for a, b in zip(message, outs))
    print(f"[{device}] accumulate_ and pack/unpack_ match PyTorch")


def time_kernels(device: str) -> None:
    numel = 8_000_000 if device == "cpu" else 200_000_000
    sizes = [numel // 100] * 100
    accumulators = [torch.zeros(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
    moved = sum(sizes) * (4 + 4 + 2)
    rows = [
        ("accumulate_ bf16->fp32", lambda: pipecomm.accumulate_(accumulators, grads, 1e-3)),
        ("torch._foreach_add_", lambda: torch._foreach_add_(accumulators, grads, alpha=1e-3)),
    ]
    print(f"[{device}] {len(sizes)} tensors, {sum(sizes) / 1e6:.0f} M elements")
    for name, fn in rows:
        seconds = median_seconds(fn, device)
        print(f"  {name:<26} {moved / seconds / 1e9:8.1f} GB/s")


def main() -> None:
    print(f"pipecomm {pipecomm.build_info()}")
    for device in devices():
        check_kernels(device)
        time_kernels(device)


if __name__ == "__main__":
    main()
