"""Tests for pipecomm.accumulate_ against a plain-PyTorch fp32 reference."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import pytest
import torch

import pipecomm
from ranks import needs_cuda

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (accumulator dtype, grad dtype) pairs the contract supports.
SUPPORTED_PAIRS = [(F32, F32), (F32, BF16), (F32, F16), (BF16, BF16), (F16, F16)]
PAIR_IDS = ["f32<-f32", "f32<-bf16", "f32<-f16", "bf16<-bf16", "f16<-f16"]

SCALES = [1.0, 0.125, -3.0]

# Odd sizes so no tensor is a multiple of a vector width; plus 0-element, 0-d and N-D.
ODD_SHAPES: list[tuple[int, ...]] = [
    (1,),
    (3,),
    (17,),
    (1023,),
    (65537,),
    (0,),
    (),
    (4, 5, 6),
    (2, 0, 3),
    (7, 1, 9),
]

# More than 1M elements so a kernel that splits work into chunks needs several of them.
LARGE_NUMEL = (1 << 20) + 4099


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(tuple(shape), dtype=F32, device=device).to(dtype)


def make_lists(
    shapes: Sequence[Sequence[int]],
    pairs: Sequence[tuple[torch.dtype, torch.dtype]],
    device: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Accumulators and grads for each shape, cycling through the given dtype pairs."""
    accumulators, grads = [], []
    for index, shape in enumerate(shapes):
        acc_dtype, grad_dtype = pairs[index % len(pairs)]
        accumulators.append(random_tensor(shape, acc_dtype, device))
        grads.append(random_tensor(shape, grad_dtype, device))
    return accumulators, grads


def reference_accumulate(
    accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float
) -> list[torch.Tensor]:
    return [(acc.float() + scale * grad.float()).to(acc.dtype) for acc, grad in zip(accumulators, grads)]


def assert_matches_reference(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], scale: float
) -> None:
    assert len(actual) == len(expected)
    # A power-of-two scale makes scale * grad exact in fp32, so fused multiply-add and separate
    # multiply+add agree and the single rounding to the accumulator dtype must match bit for bit.
    scale_is_power_of_two = scale != 0.0 and math.frexp(abs(scale))[0] == 0.5
    for index, (got, want) in enumerate(zip(actual, expected)):
        assert got.dtype == want.dtype and got.shape == want.shape, f"tensor {index}"
        if scale_is_power_of_two:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"tensor {index}: {m}")
        elif got.dtype == F32:
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-6, msg=lambda m: f"tensor {index}: {m}")
        else:
            torch.testing.assert_close(got, want, msg=lambda m: f"tensor {index}: {m}")


def run_and_check(accumulators: list[torch.Tensor], grads: list[torch.Tensor], scale: float) -> None:
    expected = reference_accumulate(accumulators, grads, scale)
    grads_before = [grad.clone() for grad in grads]
    result = pipecomm.accumulate_(accumulators, grads, scale)
    assert result is None
    assert_matches_reference(accumulators, expected, scale)
    for grad, before in zip(grads, grads_before):
        assert torch.equal(grad, before), "grads must not be modified"


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("pair", SUPPORTED_PAIRS, ids=PAIR_IDS)
def test_odd_sizes_match_reference(device: str, pair: tuple[torch.dtype, torch.dtype], scale: float) -> None:
    accumulators, grads = make_lists(ODD_SHAPES, [pair], device)
    run_and_check(accumulators, grads, scale)


@pytest.mark.parametrize("scale", SCALES)
def test_mixed_pairs_in_one_list(device: str, scale: float) -> None:
    shapes = ODD_SHAPES * 2  # every pair lands on several different sizes
    accumulators, grads = make_lists(shapes, SUPPORTED_PAIRS, device)
    assert len({(a.dtype, g.dtype) for a, g in zip(accumulators, grads)}) == len(SUPPORTED_PAIRS)
    run_and_check(accumulators, grads, scale)


@pytest.mark.parametrize("scale", [0.125, -3.0])
@pytest.mark.parametrize("pair", SUPPORTED_PAIRS, ids=PAIR_IDS)
def test_large_tensor_among_small_ones(device: str, pair: tuple[torch.dtype, torch.dtype], scale: float) -> None:
    accumulators, grads = make_lists([(5,), (LARGE_NUMEL,), (33,)], [pair], device)
    run_and_check(accumulators, grads, scale)


@pytest.mark.parametrize("scale", [1.0, -3.0])
@pytest.mark.parametrize("pair", SUPPORTED_PAIRS, ids=PAIR_IDS)
def test_misaligned_views(device: str, pair: tuple[torch.dtype, torch.dtype], scale: float) -> None:
    """Contiguous views at odd element offsets have data pointers off any vector alignment."""
    acc_dtype, grad_dtype = pair
    sizes = [1, 3, 17, 1023, 65537]
    acc_offsets = [1, 3, 5, 7, 1]
    grad_offsets = [3, 2, 1, 0, 5]  # includes an aligned grad next to a misaligned accumulator
    padding = 8
    storages, accumulators, grads = [], [], []
    for size, acc_offset, grad_offset in zip(sizes, acc_offsets, grad_offsets):
        acc_storage = random_tensor((size + 2 * padding,), acc_dtype, device)
        grad_storage = random_tensor((size + 2 * padding,), grad_dtype, device)
        accumulators.append(acc_storage[acc_offset : acc_offset + size])
        grads.append(grad_storage[grad_offset : grad_offset + size])
        storages.append((acc_storage, acc_storage.clone(), acc_offset, size))
    assert all(acc.is_contiguous() and acc.storage_offset() > 0 for acc in accumulators)

    run_and_check(accumulators, grads, scale)

    # Elements of the storage around each view must be left alone by the unaligned head/tail path.
    for acc_storage, before, offset, size in storages:
        assert torch.equal(acc_storage[:offset], before[:offset])
        assert torch.equal(acc_storage[offset + size :], before[offset + size :])


def test_default_scale_is_one(device: str) -> None:
    accumulators, grads = make_lists(ODD_SHAPES, SUPPORTED_PAIRS, device)
    expected = reference_accumulate(accumulators, grads, 1.0)
    pipecomm.accumulate_(accumulators, grads)
    assert_matches_reference(accumulators, expected, 1.0)


def test_updates_in_place(device: str) -> None:
    accumulators, grads = make_lists([(17,), (3, 4), (1023,)], SUPPORTED_PAIRS, device)
    pointers_before = [acc.data_ptr() for acc in accumulators]
    objects_before = list(accumulators)
    expected = reference_accumulate(accumulators, grads, 0.125)

    result = pipecomm.accumulate_(accumulators, grads, 0.125)

    assert result is None
    assert [acc.data_ptr() for acc in accumulators] == pointers_before
    assert all(acc is before for acc, before in zip(accumulators, objects_before))
    assert_matches_reference(accumulators, expected, 0.125)


def test_accepts_tuples(device: str) -> None:
    accumulators, grads = make_lists([(3,), (17,)], SUPPORTED_PAIRS, device)
    expected = reference_accumulate(accumulators, grads, -3.0)
    pipecomm.accumulate_(tuple(accumulators), tuple(grads), -3.0)
    assert_matches_reference(accumulators, expected, -3.0)


def test_empty_lists_are_a_noop() -> None:
    assert pipecomm.accumulate_([], [], 2.0) is None


def test_only_zero_element_tensors(device: str) -> None:
    accumulators, grads = make_lists([(0,), (3, 0), (0, 5, 2)], SUPPORTED_PAIRS, device)
    assert pipecomm.accumulate_(accumulators, grads, 2.0) is None
    assert [acc.shape for acc in accumulators] == [(0,), (3, 0), (0, 5, 2)]


def test_same_grad_for_several_accumulators(device: str) -> None:
    grad = random_tensor((257,), F32, device)
    accumulators = [random_tensor((257,), F32, device) for _ in range(3)]
    run_and_check(accumulators, [grad, grad, grad], -3.0)


def test_grad_aliasing_its_accumulator(device: str) -> None:
    """Aliasing is not checked; an accumulator that is its own grad is still updated element by element."""
    tensor = random_tensor((1023,), F32, device)
    expected = tensor * 1.5
    pipecomm.accumulate_([tensor], [tensor], 0.5)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize(
    "shapes, pairs",
    [
        ([(3,), (17,), (2, 5)], [(F32, F32)]),
        ([(1,), (1023,), (), (0,), (4, 3, 2)], SUPPORTED_PAIRS),
    ],
    ids=["f32", "mixed"],
)
def test_opcheck(device: str, shapes: list[tuple[int, ...]], pairs: list[tuple[torch.dtype, torch.dtype]]) -> None:
    accumulators, grads = make_lists(shapes, pairs, device)
    torch.library.opcheck(torch.ops.pipecomm.accumulate_.default, (accumulators, grads, 0.5))


# --------------------------------------------------------------------------- errors


def raises_value_error(message: str) -> pytest.RaisesExc:
    return pytest.raises(ValueError, match=re.escape(message))


def test_error_length_mismatch(device: str) -> None:
    accumulators, grads = make_lists([(3,), (3,), (3,)], [(F32, F32)], device)
    with raises_value_error("accumulate_: got 3 accumulators but 2 grads"):
        pipecomm.accumulate_(accumulators, grads[:2])


def test_error_shape_mismatch_same_numel(device: str) -> None:
    accumulators = [random_tensor((4,), F32, device), random_tensor((2, 3), F32, device)]
    grads = [random_tensor((4,), F32, device), random_tensor((3, 2), F32, device)]
    with raises_value_error("accumulate_: accumulators[1] has shape [2, 3] but grads[1] has shape [3, 2]"):
        pipecomm.accumulate_(accumulators, grads)


@pytest.mark.parametrize(
    "grad_dtype, name",
    [(torch.int32, "Int"), (torch.float64, "Double"), (torch.int64, "Long"), (torch.bool, "Bool")],
)
def test_error_unsupported_grad_dtype(device: str, grad_dtype: torch.dtype, name: str) -> None:
    accumulators = [random_tensor((5,), F32, device)]
    grads = [torch.ones(5, dtype=grad_dtype, device=device)]
    with raises_value_error(f"accumulate_: grads[0] has dtype {name} but grads must be Float, BFloat16 or Half"):
        pipecomm.accumulate_(accumulators, grads)


@pytest.mark.parametrize(
    "acc_dtype, grad_dtype, acc_name, grad_name",
    [
        (BF16, F32, "BFloat16", "Float"),
        (F16, BF16, "Half", "BFloat16"),
        (BF16, F16, "BFloat16", "Half"),
        (torch.float64, F32, "Double", "Float"),
    ],
)
def test_error_unsupported_accumulator_dtype(
    device: str, acc_dtype: torch.dtype, grad_dtype: torch.dtype, acc_name: str, grad_name: str
) -> None:
    accumulators = [random_tensor((5,), F32, device), random_tensor((5,), acc_dtype, device)]
    grads = [random_tensor((5,), F32, device), random_tensor((5,), grad_dtype, device)]
    with raises_value_error(
        f"accumulate_: accumulators[1] has dtype {acc_name} but grads[1] has dtype {grad_name}; "
        "an accumulator must be Float or its grad's dtype"
    ):
        pipecomm.accumulate_(accumulators, grads)


def test_error_first_message_example_bf16_acc_f32_grad(device: str) -> None:
    accumulators = [random_tensor((5,), BF16, device)]
    grads = [random_tensor((5,), F32, device)]
    with raises_value_error(
        "accumulate_: accumulators[0] has dtype BFloat16 but grads[0] has dtype Float; "
        "an accumulator must be Float or its grad's dtype"
    ):
        pipecomm.accumulate_(accumulators, grads)


def test_error_accumulator_not_contiguous(device: str) -> None:
    accumulators = [random_tensor((3, 4), F32, device).t()]
    grads = [random_tensor((4, 3), F32, device)]
    with raises_value_error("accumulate_: accumulators[0] is not contiguous"):
        pipecomm.accumulate_(accumulators, grads)


def test_error_grad_not_contiguous(device: str) -> None:
    accumulators = [random_tensor((6,), F32, device), random_tensor((6,), F32, device)]
    grads = [random_tensor((6,), F32, device), random_tensor((12,), F32, device)[::2]]
    with raises_value_error("accumulate_: grads[1] is not contiguous"):
        pipecomm.accumulate_(accumulators, grads)


def test_error_accumulator_and_grad_on_different_devices(device: str) -> None:
    if device == "cpu":
        pytest.skip("a device mismatch needs a second device type")
    accumulators = [random_tensor((5,), F32, "cpu")]
    grads = [random_tensor((5,), F32, device)]
    with raises_value_error("accumulate_: accumulators[0] is on cpu but grads[0] is on cuda:0"):
        pipecomm.accumulate_(accumulators, grads)


def test_error_accumulators_on_different_gpus(device: str) -> None:
    if device == "cpu":
        pytest.skip("a device mismatch needs a second device type")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    devices = ["cuda:0", "cuda:0", "cuda:1"]
    accumulators = [random_tensor((5,), F32, d) for d in devices]
    grads = [random_tensor((5,), F32, d) for d in devices]
    with raises_value_error("accumulate_: accumulators[2] is on cuda:1 but accumulators[0] is on cuda:0"):
        pipecomm.accumulate_(accumulators, grads)


@needs_cuda
def test_inside_a_cuda_graph_every_replay_adds_the_same_sums() -> None:
    """A captured accumulate_ (a CUDA-graphed W pass adds deferred weight gradients with it) replays the same sums
    however the host's pinned memory is used between replays."""
    grads = [torch.randn(1023, device="cuda", dtype=BF16), torch.randn(17, device="cuda", dtype=BF16)]
    accumulators = [torch.zeros(1023, device="cuda"), torch.zeros(17, device="cuda", dtype=BF16)]
    expected = [a.clone() for a in accumulators]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pipecomm.accumulate_([a.clone() for a in accumulators], grads, 0.5)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pipecomm.accumulate_(accumulators, grads, 0.5)
    for _ in range(3):
        torch.empty(4096, dtype=torch.int64, pin_memory=True).fill_(-1).to("cuda", non_blocking=True)
        graph.replay()
        for acc, grad in zip(expected, grads):
            acc.add_(grad, alpha=0.5)
    torch.cuda.synchronize()
    for got, want in zip(accumulators, expected):
        assert torch.equal(got, want)
