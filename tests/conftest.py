"""Shared pytest fixtures: a cpu/cuda `device` twin for every test and per-test RNG seeding."""

from __future__ import annotations

import pytest
import torch

import pipecomm

_CUDA_USABLE = torch.cuda.is_available() and pipecomm.cuda_built()


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not _CUDA_USABLE,
                reason="needs a CUDA device and a pipecomm build with CUDA kernels",
            ),
        ),
    ],
    ids=["cpu", "cuda"],
)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed_rng() -> None:
    # Each test draws from a fresh, fixed stream so a failure reproduces when run alone.
    torch.manual_seed(0)
