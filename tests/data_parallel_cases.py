"""The model, batches and helpers shared by the DataParallel tests (tests/data_parallel/test_data_parallel_*.py)."""

from __future__ import annotations

import torch
from torch import nn


GLOBAL_BATCH = 8


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 13, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def max_dev(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class WithUnusedParam(nn.Module):
    """``net`` on every row; ``extra`` added on the rows where ``mask`` is 1 (skipped when no row
    of the batch needs it, so a rank without such rows produces no grad for it); ``unused``
    never."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(0)  # seeds: extra and unused are the same on every rank
        self.extra = nn.Linear(13, 3)
        self.unused = nn.Linear(5, 5)  # registered last, so its bucket is launched first

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if bool(mask.any()):
            out = out + self.extra(x) * mask[:, None]
        return out
