"""Tests for pipecomm.build_info() and pipecomm.cuda_built()."""

from __future__ import annotations

import re

import torch

import pipecomm


def major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    assert match is not None, f"not a version string: {version!r}"
    return int(match.group(1)), int(match.group(2))


def test_build_info_keys_and_types() -> None:
    info = pipecomm.build_info()
    assert isinstance(info, dict)
    assert {"cuda", "torch", "cuda_version", "version"} <= info.keys()
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["torch"], str)
    assert info["cuda_version"] is None or isinstance(info["cuda_version"], str)
    assert isinstance(info["version"], str) and re.match(r"\d+\.\d+", info["version"])


def test_cuda_built_matches_build_info() -> None:
    built = pipecomm.cuda_built()
    assert isinstance(built, bool)
    assert built == pipecomm.build_info()["cuda"]


def test_cuda_version_present_when_built_with_cuda() -> None:
    info = pipecomm.build_info()
    if info["cuda"]:
        assert isinstance(info["cuda_version"], str) and major_minor(info["cuda_version"])


def test_built_against_running_torch_minor_version() -> None:
    assert major_minor(pipecomm.build_info()["torch"]) == major_minor(torch.__version__)


def test_version_matches_package_attribute() -> None:
    version_attribute = getattr(pipecomm, "__version__", None)
    assert version_attribute is None or version_attribute == pipecomm.build_info()["version"]
