"""The training examples run end to end under torchrun on CPU processes."""

from __future__ import annotations

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
