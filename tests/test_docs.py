"""Every ```python block of README.md and docs/*.md runs, each in processes of its own, as its marker asks.

A block runs in one process unless the line before its fence is a marker: ``<!-- test: ranks=4 -->`` runs it on 4
CPU ranks started as torchrun starts them (``pipecomm.init()`` joins their group), and ``gpus`` among the options
puts each rank on a GPU of its own (the block is skipped without enough GPUs). The ranks are forked from the test
suite's rank server (tests/ranks.py), which imported torch, pipecomm and transformers once.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from ranks import needs_cuda, needs_two_gpus, run_ranks

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- test: (?P<options>[^>]*?) -->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
GPU_MARKS = {1: needs_cuda, 2: needs_two_gpus}


def blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            options = dict(option.partition("=")[::2] for option in (match["options"] or "").split())
            ranks, gpus = int(options.get("ranks", "1")), "gpus" in options
            line = text.count("\n", 0, match.start("code"))  # lines before the block's first
            # Padded to its place in the page, so that a traceback names the page's own line.
            code = "\n" * line + match["code"]
            marks = [GPU_MARKS[ranks]] if gpus else []
            found.append(pytest.param(str(page.relative_to(ROOT)), code, ranks, gpus, marks=marks,
                                      id=f"{page.relative_to(ROOT)}:{line + 1}"))
    return found


def run_block(rank: int, world_size: int, page: str, code: str) -> None:
    """As one of torchrun's ranks, in a namespace of its own."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # Unredirected, the examples' prints would land in whatever held the rank server's standard output.
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, page, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("page, code, ranks, gpus", blocks())
def test_the_block_runs(tmp_path, page, code, ranks, gpus):
    run_ranks(ranks, run_block, tmp_path, page, code, timeout=120,
              process_group="cpu:gloo,cuda:nccl" if gpus else "gloo")


def test_every_page_has_a_block_that_runs_on_cpu():
    pages = {values[0] for values, marks in ((param.values, param.marks) for param in blocks()) if not marks}
    assert pages == {str(page.relative_to(ROOT)) for page in PAGES}
