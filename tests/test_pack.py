"""Tests for pipecomm.pack / unpack_ / packed_nbytes against a plain-PyTorch byte layout."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest
import torch

import pipecomm

ALIGNMENT = 16


def align16(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-(2**7) if dtype != torch.uint8 else 0, 2**7, shape, dtype=dtype, device=device)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # reshape first: a 0-d tensor cannot be viewed as another dtype, and reshape copies non-contiguous input.
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def reference_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    pieces = []
    for tensor in tensors:
        data = raw_bytes(tensor)
        padding = torch.zeros(align16(data.numel()) - data.numel(), dtype=torch.uint8, device=data.device)
        pieces += [data, padding]
    return torch.cat(pieces)


def reference_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    offsets, offset = [], 0
    for tensor in tensors:
        offsets.append(offset)
        offset += align16(nbytes(tensor))
    return offsets


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.device == expected.device
    assert torch.equal(raw_bytes(actual), raw_bytes(expected))


def mixed_tensors(device: str) -> list[torch.Tensor]:
    """Every listed dtype, 0-d and 0-element tensors, and byte sizes that are not multiples of 16."""
    return [
        random_tensor((5, 7), torch.float32, device),  # 140 bytes
        random_tensor((), torch.bfloat16, device),  # 2 bytes
        random_tensor((0,), torch.float16, device),  # 0 bytes
        random_tensor((3,), torch.int64, device),  # 24 bytes
        random_tensor((1,), torch.uint8, device),  # 1 byte
        random_tensor((2, 3, 4), torch.int32, device),  # 96 bytes, already aligned
        random_tensor((17,), torch.bool, device),  # 17 bytes
        random_tensor((3,), torch.uint8, device),  # 3 bytes
        random_tensor((), torch.float32, device),  # 4 bytes
        random_tensor((2, 0, 3), torch.int64, device),  # 0 bytes inside an N-D shape
        random_tensor((5, 7), torch.float16, device),  # 70 bytes
        random_tensor((17,), torch.bfloat16, device),  # 34 bytes
        random_tensor((4, 4), torch.float32, device),  # 64 bytes, already aligned
    ]


CASES = {
    "mixed": mixed_tensors,
    "single_byte": lambda device: [random_tensor((1,), torch.uint8, device)],
    "single_0d": lambda device: [random_tensor((), torch.int64, device)],
    "only_empty": lambda device: [random_tensor((0,), torch.float32, device), random_tensor((0, 3), torch.bool, device)],
    "large_odd": lambda device: [
        random_tensor(((1 << 20) + 3,), torch.bfloat16, device),
        random_tensor((3,), torch.uint8, device),
        random_tensor((65537,), torch.float32, device),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_pack_matches_reference_layout(device: str, case: str) -> None:
    tensors = CASES[case](device)
    packed = pipecomm.pack(tensors)
    expected = reference_pack(tensors)
    assert packed.dtype == torch.uint8
    assert packed.dim() == 1
    assert packed.device == tensors[0].device
    assert packed.is_contiguous()
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(device: str, case: str) -> None:
    tensors = CASES[case](device)
    packed = pipecomm.pack(tensors)
    outs = [torch.empty_like(tensor) for tensor in tensors]
    pointers_before = [out.data_ptr() for out in outs]

    assert pipecomm.unpack_(packed, outs) is None

    assert [out.data_ptr() for out in outs] == pointers_before
    for out, tensor in zip(outs, tensors):
        assert_bitwise_equal(out, tensor)


@pytest.mark.parametrize("case", list(CASES))
def test_packed_nbytes_agrees_with_buffer(device: str, case: str) -> None:
    tensors = CASES[case](device)
    assert pipecomm.packed_nbytes(tensors) == pipecomm.pack(tensors).numel() == reference_pack(tensors).numel()


def test_packed_nbytes_values() -> None:
    def make(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    assert pipecomm.packed_nbytes([make(0, torch.float32)]) == 0
    assert pipecomm.packed_nbytes([make(1, torch.uint8)]) == 16
    assert pipecomm.packed_nbytes([make(4, torch.float32)]) == 16
    assert pipecomm.packed_nbytes([make(17, torch.uint8)]) == 32
    assert pipecomm.packed_nbytes([torch.zeros((), dtype=torch.int64)]) == 16
    assert pipecomm.packed_nbytes([make(3, torch.uint8), make(0, torch.int32), make(5, torch.float64)]) == 16 + 0 + 48
    assert pipecomm.packed_nbytes([torch.zeros(5, 7)]) == 144


def test_offsets_are_16_aligned_and_padding_is_zero(device: str) -> None:
    tensors = mixed_tensors(device)
    packed_size = pipecomm.packed_nbytes(tensors)
    for _ in range(5):
        # Recently freed memory full of 0xAB makes uninitialised padding likely to show up.
        garbage = torch.full((packed_size,), 0xAB, dtype=torch.uint8, device=device)
        del garbage
        packed = pipecomm.pack(tensors)
        offsets = reference_offsets(tensors)
        assert all(offset % ALIGNMENT == 0 for offset in offsets)
        for tensor, offset in zip(tensors, offsets):
            size = nbytes(tensor)
            assert torch.equal(packed[offset : offset + size], raw_bytes(tensor))
            padding = packed[offset + size : offset + align16(size)]
            assert torch.count_nonzero(padding).item() == 0, f"nonzero padding after tensor at offset {offset}"


def test_non_contiguous_inputs_pack_like_contiguous(device: str) -> None:
    base = random_tensor((6, 5), torch.float32, device)
    tensors = [
        base.t(),  # transposed
        random_tensor((9, 3), torch.bfloat16, device)[::2],  # strided rows
        torch.arange(3, device=device).expand(4, 3),  # zero stride
        random_tensor((4, 6), torch.bool, device)[:, 1::2],
        random_tensor((20,), torch.uint8, device)[3:20:3],
    ]
    assert not any(tensor.is_contiguous() for tensor in tensors)
    packed = pipecomm.pack(tensors)
    assert torch.equal(packed, pipecomm.pack([tensor.contiguous() for tensor in tensors]))
    assert torch.equal(packed, reference_pack(tensors))


def test_unpack_into_misaligned_outs(device: str) -> None:
    """Outputs that are contiguous views at odd byte offsets still receive the right bytes."""
    tensors = [random_tensor((17,), torch.float32, device), random_tensor((33,), torch.bfloat16, device)]
    storages = [torch.zeros(40, dtype=torch.float32, device=device), torch.zeros(60, dtype=torch.bfloat16, device=device)]
    outs = [storages[0][1:18], storages[1][3:36]]
    pipecomm.unpack_(pipecomm.pack(tensors), outs)
    for out, tensor in zip(outs, tensors):
        assert_bitwise_equal(out, tensor)
    assert torch.count_nonzero(storages[0][18:]).item() == 0 and storages[0][0].item() == 0
    assert torch.count_nonzero(storages[1][36:]).item() == 0 and torch.count_nonzero(storages[1][:3]).item() == 0


def test_unpack_reference_buffer(device: str) -> None:
    """unpack_ reads the documented layout, not just whatever pack happens to write."""
    tensors = mixed_tensors(device)
    outs = [torch.empty_like(tensor) for tensor in tensors]
    pipecomm.unpack_(reference_pack(tensors), outs)
    for out, tensor in zip(outs, tensors):
        assert_bitwise_equal(out, tensor)


def test_unpack_empty_outs_and_empty_buffer_is_a_noop(device: str) -> None:
    assert pipecomm.unpack_(torch.empty(0, dtype=torch.uint8, device=device), []) is None


def test_pack_accepts_tuple(device: str) -> None:
    tensors = tuple(mixed_tensors(device)[:4])
    assert torch.equal(pipecomm.pack(tensors), reference_pack(tensors))


# --------------------------------------------------------------------------- opcheck


def test_opcheck_pack(device: str) -> None:
    torch.library.opcheck(torch.ops.pipecomm.pack.default, (mixed_tensors(device),))


def test_opcheck_unpack(device: str) -> None:
    tensors = mixed_tensors(device)
    buffer = reference_pack(tensors)
    outs = [torch.empty_like(tensor) for tensor in tensors]
    torch.library.opcheck(torch.ops.pipecomm.unpack_.default, (buffer, outs))


# --------------------------------------------------------------------------- errors


def raises_value_error(message: str) -> pytest.RaisesExc:
    return pytest.raises(ValueError, match=re.escape(message))


def test_error_pack_empty_list() -> None:
    with raises_value_error("pack: needs at least one tensor"):
        pipecomm.pack([])


def test_error_pack_devices_differ(device: str) -> None:
    if device == "cpu":
        pytest.skip("a device mismatch needs a second device type")
    tensors = [torch.zeros(3, device="cpu"), torch.zeros(3, device=device)]
    with raises_value_error("pack: tensors[1] is on cuda:0 but tensors[0] is on cpu"):
        pipecomm.pack(tensors)


@pytest.mark.parametrize(
    "make_buffer",
    [
        lambda device: torch.zeros(2, 32, dtype=torch.uint8, device=device),
        lambda device: torch.zeros(16, dtype=torch.float32, device=device),
        lambda device: torch.zeros(64, dtype=torch.int8, device=device),
        lambda device: torch.zeros((), dtype=torch.uint8, device=device),
    ],
    ids=["2d", "float32", "int8", "0d"],
)
def test_error_unpack_buffer_not_1d_uint8(device: str, make_buffer: Callable[[str], torch.Tensor]) -> None:
    outs = [torch.empty(4, device=device)]
    with raises_value_error("unpack_: buffer must be a 1-D uint8 tensor"):
        pipecomm.unpack_(make_buffer(device), outs)


def test_error_unpack_buffer_too_small(device: str) -> None:
    outs = [torch.empty(16, device=device), torch.empty(1, device=device)]  # 64 + align16(4) bytes
    with raises_value_error("unpack_: buffer holds 64 bytes but outs need 80"):
        pipecomm.unpack_(torch.zeros(64, dtype=torch.uint8, device=device), outs)


def test_error_unpack_out_not_contiguous(device: str) -> None:
    outs = [torch.empty(4, device=device), torch.empty(3, 2, device=device).t()]
    with raises_value_error("unpack_: outs[1] is not contiguous"):
        pipecomm.unpack_(torch.zeros(64, dtype=torch.uint8, device=device), outs)


def test_error_unpack_out_on_other_device(device: str) -> None:
    if device == "cpu":
        pytest.skip("a device mismatch needs a second device type")
    outs = [torch.empty(4, device="cpu")]
    with raises_value_error("unpack_: outs[0] is on cpu but buffer is on cuda:0"):
        pipecomm.unpack_(torch.zeros(16, dtype=torch.uint8, device=device), outs)
