"""ZeRO-3 (``ShardedDataParallel(stage=3)``) against single-process training, and its contract.

Every body trains the model on dp ranks, each on its rows of a global batch, and a replica in
one process on the whole batch, and compares ``full_state_dict()`` (stage 3 holds only a shard
of each parameter: the module's own tensors are freed between steps) with the replica after
every step. The comm and prefetch tests read the collectives a rank recorded, in order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from tolerances import ADAM_EPS_ACROSS_ORDERS
from zero3_models import assert_matches_replica, dp_rows, zero3_batch, zero3_model


OPTIMIZERS = {
    "fused_adamw": (FusedAdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "torch_adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "sgd": (torch.optim.SGD, dict(lr=0.5)),  # large: a wrong factor moves params far outside FP32
}


def _groups(module: nn.Module, grouped: bool) -> list[dict] | None:
    if not grouped:
        return None
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    biases = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": biases, "weight_decay": 0.0, "lr": 0.005}]


def _train_equals_single_process(opt_name: str, grouped: bool, reshard: bool, steps: int = 10) -> int:
    ctx = ParallelContext.from_world()
    cls, kw = OPTIMIZERS[opt_name]
    sdp = ShardedDataParallel(zero3_model(), ctx, 3, bucket_mb=0.01, reshard_after_forward=reshard)
    assert [u.name for u in sdp._units.units] == ["", "0", "2", "4"]  # the root (empty) and each Linear
    ref = zero3_model()
    opt = ZeroOptimizer(sdp, cls, _groups(sdp.module, grouped), **kw)
    groups = _groups(ref, grouped)
    ref_opt = cls(groups if groups is not None else ref.parameters(), **kw)
    rows = dp_rows(ctx)
    for step in range(steps):
        x, y = zero3_batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        assert_matches_replica(sdp, ref, step)
        # between steps only the shards are held: every unit's full buffer is freed
        assert all(sb.flat_param.untyped_storage().nbytes() == 0 for sb in sdp.sharded_buckets)
    ctx.destroy()
    return len(sdp.sharded_buckets)


@pytest.mark.reduction_order
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_trains_like_single_process(dist_pool, world_size: int, opt_name: str, reshard: bool) -> None:
    dist_pool.run(_train_equals_single_process, opt_name, False, reshard, world_size=world_size, timeout=90)


@pytest.mark.reduction_order
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_param_groups_given_with_original_params(dist_pool, world_size: int) -> None:
    dist_pool.run(_train_equals_single_process, "fused_adamw", True, True, world_size=world_size, timeout=90)
