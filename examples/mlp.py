"""A stack of MLP blocks with an MSE loss: the smallest model worth parallelizing.

Each block is ``fc1: Linear(hidden -> ffn) -> GELU -> fc2: Linear(ffn -> hidden)`` with an
optional residual connection; Megatron shards ``fc1`` by columns and ``fc2`` by rows.

Example::

    model = build(hidden=64, ffn=256, layers=2)
    loss = model(*model.example_inputs(8))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, residual: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.gelu(self.fc1(x)))
        return x + out if self.residual else out


class MLP(nn.Module):
    """``forward(x [batch, hidden], target [batch, hidden]) -> mean-squared error``."""

    def __init__(self, *, hidden: int, ffn: int, layers: int, residual: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.blocks = nn.ModuleList(MLPBlock(hidden, ffn, residual) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, target)

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, ...]:
        """A global batch ``(x, target)``, deterministic (seed 0); ``device`` defaults to the model's."""
        device = torch.device(device) if device is not None else next(self.parameters()).device
        shape = (batch_size, self.hidden)
        if device.type == "meta":
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=generator)
        target = torch.randn(shape, generator=generator)
        return x.to(device), target.to(device)


def build(*, hidden: int = 64, ffn: int = 256, layers: int = 2, residual: bool = True) -> MLP:
    """Build the MLP stack; module names are ``blocks.N.fc1`` and ``blocks.N.fc2``.

    Example::

        with torch.device("meta"):
            model = build(hidden=1024, ffn=4096, layers=8)
    """
    if hidden < 1 or ffn < 1 or layers < 1:
        raise ValueError(f"hidden, ffn and layers must be positive, got {hidden=}, {ffn=}, {layers=}")
    return MLP(hidden=hidden, ffn=ffn, layers=layers, residual=residual)
