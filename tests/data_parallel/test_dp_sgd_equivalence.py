"""DataParallel + plain SGD equals single-process SGD on the same global batch, step by step.

AdamW's update is nearly invariant to a constant gradient scale (m / sqrt(v)), so the AdamW
equivalence tests in ``test_data_parallel_trains_like_one_process.py`` cannot see a wrong averaging factor. Plain SGD
(no momentum, no weight decay) moves each parameter by exactly ``lr * grad``: a grad that is the
dp-*sum* instead of the dp-*average* (a dropped ``/ dp``), or one averaged twice, changes the
parameters by a factor of ``dp`` after the first step. The grads themselves are compared too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel import DataParallel
from tolerances import FP32

STEPS = 4
GLOBAL_BATCH = 8
LR = 0.5  # large on purpose: a wrong factor moves the parameters far outside FP32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _sgd_equivalence(as_view: bool, backend: str) -> float:
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    # bucket_mb tiny: several buckets, so every bucket's factor is exercised
    model = DataParallel(_model(), ctx, bucket_mb=0.0005, gradient_as_bucket_view=as_view, backend=backend)
    assert len(model.buckets) > 1
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()  # the mean over the global batch
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **FP32, msg=lambda m, n=name, s=step: f"grad {n}, step {s}: {m}")
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32, msg=lambda m, n=name, s=step: f"param {n}, step {s}: {m}")
            worst = max(worst, (p - q).abs().max().item())
    ctx.destroy()
    return worst


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_plain_sgd_equals_single_process(dist_pool, world_size: int, as_view: bool) -> None:
    worst = dist_pool.run(_sgd_equivalence, as_view, "auto", world_size=world_size, timeout=60)
    assert len(worst) == world_size  # every rank asserted step by step inside the body


def test_ddp_plain_sgd_interpreted_triton_unflatten(dist_pool) -> None:
    """The Triton unflatten kernel (interpreter) fuses the 1/dp scale: check its factor too."""
    dist_pool.run(_sgd_equivalence, False, "triton", world_size=2, timeout=120)
