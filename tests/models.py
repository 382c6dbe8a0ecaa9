"""Small modules the pipeline and partition tests both build their models from."""

from __future__ import annotations

import torch
from torch import nn


class MaskedBlock(nn.Module):
    """A transformer-like residual MLP block that also carries a bool mask across the stage boundary."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x, mask):
        update = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + update * mask.unsqueeze(-1), mask
