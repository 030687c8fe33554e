"""The small ZeRO-3 model, batches and replica check shared by the stage-3 tests (tests/zero/test_zero3_*.py, test_zero_sync_check.py)."""

from __future__ import annotations

import torch
from torch import nn
from shardkit.comm import ParallelContext
from shardkit.parallel.zero import ShardedDataParallel
from tolerances import FP32


GLOBAL_BATCH = 8

D = 64


def zero3_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Every tensor a multiple of 64 elements: the flat buckets carry no padding."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).to(dtype)


def dp_rows(ctx: ParallelContext) -> slice:
    rank, world = ctx.rank("dp"), ctx.size("dp")
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def zero3_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, D, generator=g)


def assert_matches_replica(sdp: ShardedDataParallel, ref: nn.Module, step: int) -> None:
    full = sdp.full_state_dict()
    for name, q in ref.state_dict().items():
        torch.testing.assert_close(full[name], q, **FP32, msg=lambda m, n=name: f"{n}, step {step}: {m}")
