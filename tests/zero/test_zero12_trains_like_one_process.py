"""ZeRO-1/2 (``ShardedDataParallel`` + ``ZeroOptimizer``) against single-process training.

Every body trains a tiny model on dp ranks, each on its rows of a global batch, and a replica of
the same model in one process on the whole batch (loss = mean over the global batch), and
compares parameters after every step on every rank. Plain SGD moves each parameter by exactly
``lr * grad``, so a wrong averaging factor (a dropped or doubled 1/dp) shows after one step;
AdamW (fused and torch's) checks the shard views, state and per-group settings, with an ``eps``
that bounds how far the dp split's other order of additions can move a step
(``tolerances.ADAM_EPS_ACROSS_ORDERS``); Lion, which has no such bound, is compared one step at a
time outside the elements whose direction that order could flip (``_lion_flippable``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW, FusedLion, FusedSGD, count_launches
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

GLOBAL_BATCH = 8
IN, HID, OUT = 16, 32, 16

OPTIMIZERS = {
    "fused_adamw": (FusedAdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "torch_adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "sgd": (torch.optim.SGD, dict(lr=0.5)),  # large: a wrong factor moves params far outside FP32
    "fused_sgd_momentum": (FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "fused_lion": (FusedLion, dict(lr=1e-3, weight_decay=0.1)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g).to(dtype), torch.randn(GLOBAL_BATCH, OUT, generator=g).to(dtype)


def _groups(module: nn.Module, grouped: bool) -> list[dict] | None:
    """No decay and half the lr for biases: per-parameter groups given with the ORIGINAL params."""
    if not grouped:
        return None
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    biases = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": biases, "weight_decay": 0.0, "lr": 0.005}]


def _rows(ctx: ParallelContext) -> slice:
    rank, world = ctx.rank("dp"), ctx.size("dp")
    return slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)


def _lion_flippable(opt: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Per param of ``opt`` (before its step): the elements whose Lion direction another order
    of additions could flip.

    Lion moves each element by ``lr * sign(c)``, ``c = beta1 * m + (1 - beta1) * g``: unlike Adam
    there is no ``eps`` to bound how far a tiny change of ``g`` moves the param, so where ``|c|``
    is within the gradient's reduction-order spread the dp run may legitimately step the other
    way (by ``2 * lr``). The spread is at most ``n * 2**-24 * sum |terms|`` (tests/reduction_order.py);
    ``2**-12 * max |c|`` covers it with a factor of > 100 for these tensors.
    """
    out = {}
    for group in opt.param_groups:
        beta1 = group["betas"][0]
        for q in group["params"]:
            m = opt.state[q].get("exp_avg", torch.zeros_like(q)) if q in opt.state else torch.zeros_like(q)
            c = beta1 * m + (1 - beta1) * q.grad
            out[q] = c.abs() <= 2.0**-12 * c.abs().max()
    return out


def _train_equals_single_process(stage: int, opt_name: str, grouped: bool, steps: int = 10) -> int:
    ctx = ParallelContext.from_world()
    cls, kw = OPTIMIZERS[opt_name]
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.004)  # several buckets
    assert len(sdp.sharded_buckets) > 1
    ref = _model()
    opt = ZeroOptimizer(sdp, cls, _groups(sdp.module, grouped), **kw)
    groups = _groups(ref, grouped)
    ref_opt = cls(groups if groups is not None else ref.parameters(), **kw)
    sign_based = cls is FusedLion
    rows = _rows(ctx)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()  # the mean over the global batch
        flippable = _lion_flippable(ref_opt) if sign_based else {}
        ref_opt.step()
        for (name, p), q in zip(sdp.module.named_parameters(), ref.parameters()):
            msg = lambda m, n=name, s=step: f"param {n}, step {s}: {m}"  # noqa: E731
            if q in flippable:  # a flipped element may be 2 lr away; every other one matches
                keep = ~flippable[q]
                torch.testing.assert_close(p[keep], q[keep], **FP32, msg=msg)
                assert bool(((p - q).abs() <= 2 * kw["lr"] + FP32["atol"]).all()), msg("beyond a sign flip")
                with torch.no_grad():
                    q.copy_(p)  # a flip must not carry into the next step's comparison
            else:
                torch.testing.assert_close(p, q, **FP32, msg=msg)
    ctx.destroy()
    return len(sdp.sharded_buckets)


@pytest.mark.reduction_order
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_zero_trains_like_single_process(dist_pool, world_size: int, stage: int, opt_name: str) -> None:
    dist_pool.run(_train_equals_single_process, stage, opt_name, False, world_size=world_size, timeout=60)


@pytest.mark.reduction_order
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", ["fused_adamw", "sgd"])
def test_zero_param_groups_given_with_original_params(dist_pool, world_size: int, stage: int, opt_name: str) -> None:
    """No weight decay and another lr for biases, even though storage is flat and sharded (at
    dp 4 some ranks hold no bias at all: their group is empty and must still line up)."""
    dist_pool.run(_train_equals_single_process, stage, opt_name, True, world_size=world_size, timeout=60)


def _triton_kernels_path(stage: int) -> None:
    """The flatten copies and the gradient epilogue through Triton (interpreted here; compiled on
    CUDA): the same training as the torch path, against one process."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.004, backend="triton")
    ref = _model()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rows = _rows(ctx)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
        norm = sdp.clip_grad_norm_(0.1)
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1), **FP32)
        ref_opt.step()
        for p, q in zip(sdp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32)
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_interpreted_triton_kernels(dist_pool, stage: int) -> None:
    dist_pool.run(_triton_kernels_path, stage, world_size=2, timeout=120)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_dp1_takes_the_local_path(dist_pool, stage: int) -> None:
    """One rank: the collectives' local paths (no communication), same training as torch."""
    dist_pool.run(_train_equals_single_process, stage, "fused_adamw", True, 3, world_size=1, timeout=60)


def _one_launch_per_group() -> dict[str, int]:
    """The fused optimizer on shard views still takes one Triton launch per parameter group."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, 2, bucket_mb=0.004)
    opt = ZeroOptimizer(sdp, FusedAdamW, _groups(sdp.module, True), lr=1e-2, backend="triton")
    assert all(g["params"] for g in opt.param_groups)  # both groups have elements on this rank here
    x, y = _batch(0)
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
    with count_launches() as launches:
        opt.step()
    ctx.destroy()
    return dict(launches)


def test_zero_fused_optimizer_one_launch_per_group(dist_pool) -> None:
    for launches in dist_pool.run(_one_launch_per_group, world_size=2, timeout=120):
        assert sum(launches.values()) == 2, launches  # 2 groups, several shard views each
