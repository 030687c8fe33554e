"""Offload the way jobs use it: two offloaded models in one process sharing one ``nvme_dir``.

Actor and critic, or a model and its EMA copy, are commonly configured from one config, so
both get the same ``nvme_dir``. Each must train exactly as it does with ``offload=None``
(docs/offload.md: NVMe offload is bitwise the on-device optimizer), whatever the other writes.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from shardkit.parallel.zero.nvme import claim_model_dir

D = 32


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


def _pair(ctx: ParallelContext, stage: int, offload: str | None, nvme_dir: str | None) -> list:
    out = []
    for seed in (0, 1):  # actor and critic: same shapes, different weights
        sdp = ShardedDataParallel(_model(seed), ctx, stage, bucket_mb=0.002, offload=offload, nvme_dir=nvme_dir)
        out.append((sdp, ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)))
    return out


def _two_models_one_dir(stage: int, nvme_dir: str) -> None:
    ctx = ParallelContext.from_world()
    runs = {"nvme": _pair(ctx, stage, "nvme", nvme_dir), "device": _pair(ctx, stage, None, None)}
    n, r = ctx.size("dp"), ctx.rank("dp")
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        rows = slice(r * 8 // n, (r + 1) * 8 // n)
        for pair in runs.values():
            for sdp, opt in pair:  # interleaved, as an actor-critic step is
                opt.zero_grad()
                nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
                opt.step()
    for (sdp, _), (ref, _) in zip(runs["nvme"], runs["device"], strict=True):
        got, want = sdp.full_state_dict(), ref.full_state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k}: {(got[k] - want[k]).abs().max()} off offload=None"
    rank_dir = os.path.join(nvme_dir, f"rank{ctx.global_rank}")
    assert sorted(d for d in os.listdir(rank_dir) if not d.endswith(".lock")) == ["model0", "model1"]
    ctx.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_two_nvme_models_sharing_one_dir_each_train_as_without_offload(dist_pool, tmp_path, stage: int) -> None:
    dist_pool.run(_two_models_one_dir, stage, str(tmp_path), world_size=2, timeout=120)


def test_a_released_model_dir_is_claimed_again(tmp_path) -> None:
    """A crashed or finished run's lock dies with it: the next model reuses ``model0``."""
    d0, fd0 = claim_model_dir(str(tmp_path))
    d1, fd1 = claim_model_dir(str(tmp_path))
    assert (os.path.basename(d0), os.path.basename(d1)) == ("model0", "model1")
    os.close(fd0)
    d2, fd2 = claim_model_dir(str(tmp_path))
    assert d2 == d0
    os.close(fd1)
    os.close(fd2)


def _offloaded_bytes(offload: str, dtype: torch.dtype, nvme_dir: str) -> dict[str, int]:
    ctx = ParallelContext.from_world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(dtype)
    where = nvme_dir if offload == "nvme" else None
    sdp = ShardedDataParallel(model, ctx, 2, bucket_mb=0.01, offload=offload, nvme_dir=where)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    sdp(torch.randn(4, 64, dtype=dtype)).float().square().mean().backward()
    opt.step()
    off = sdp.memory_report()["offloaded"]
    ctx.destroy()
    return {"host": off["cpu"] + off["cpu_buffers"], "nvme": off["nvme"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_planner_offload_bytes_equal_the_runtimes(dist_pool, tmp_path, offload: str, dtype: torch.dtype) -> None:
    """The planner's host and NVMe bytes against what the offloaded optimizer holds after a step
    (fp32 params: the host step keeps an fp32 master next to Adam's moments, 16 bytes per shard
    element on the host with ``"cpu"``, not 12; the sizes are multiples of 64: no padding)."""
    from shardkit.parallel.zero import plan_memory

    measured = dist_pool.run(_offloaded_bytes, offload, dtype, str(tmp_path), world_size=2, timeout=60)[0]
    psi = 2 * (64 * 64 + 64)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    # grads reduced in fp32 (G = 4): ShardedDataParallel's default, for bf16 params too
    plan = plan_memory(psi, dp=2, stage=2, precision=precision, offload=offload, nvme_subgroup_params=1, grad_dtype_bytes=4)
    # the runtime counts a 4-byte `step` per shard param (4 of them) and the planner two 1-element
    # NVMe sub-groups of staging: both under 0.5% here, against the 25% / 33% a missing master is
    assert measured["host"] == pytest.approx(plan.cpu, rel=5e-3), (measured, plan)
    assert measured["nvme"] == pytest.approx(plan.nvme, rel=5e-3), (measured, plan)
