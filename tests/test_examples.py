"""The training examples run end to end under torchrun on CPU processes, and the demo as `make demo` runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("schedule", ["zb-v", "auto"])
def test_train_hf_trains_with_a_schedule(schedule):
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLES / "train_hf.py"), "--pp", "2", "--schedule", schedule, "--steps", "6"],
        capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(loss) for loss in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], result.stdout
    # zb-v splits the model into four stages, two per rank in a V; auto runs its plan after the measured steps.
    summary = re.search(r"summary: schedule (\S+) \(running (\S+)\) pp=2: .* bubble (\d\.\d+)", result.stdout)
    assert summary and summary.group(1) == schedule, result.stdout
    if schedule == "zb-v":
        assert "model.embed_tokens, model.layers.3 first on rank 0" in result.stdout


def test_the_demo_trains_against_torch_checks_the_gradients_and_draws_a_step(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tqdm")
    # On CPU ranks wherever it runs: there both libraries' losses agree to rounding, where GPUs' fused attention
    # backward (atomics) lets two runs drift apart.
    result = subprocess.run([sys.executable, str(EXAMPLES / "demo.py"), "--steps", "5", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=240, check=False,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "of the gradient's largest entry -> exact" in result.stdout, result.stdout
    # Both libraries train the same stages from the same weights on the same data.
    ratio = re.search(r"runs at (\d+\.\d+)x torch's speed; last loss (\d+\.\d+) against (\d+\.\d+)", result.stdout)
    assert ratio and float(ratio.group(1)) > 0, result.stdout
    assert abs(float(ratio.group(2)) - float(ratio.group(3))) < 1e-3, result.stdout
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {event["pid"] for event in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]} == {0, 1}
    assert f"one step's timeline per rank: {tmp_path / 'timeline.png'}" in result.stdout
