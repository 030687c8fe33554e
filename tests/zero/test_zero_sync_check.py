"""``check_sync`` at stages 1 and 2: ranks that diverge raise the same error on every rank.

Issue #7's case "ranks that diverge (one rank runs one more forward)": without the check, the
extra backward's reduce-scatter pairs with the other rank's parameter all-gather or next
reduce-scatter (wrong values or a hang until the timeout). With ``check_sync=True`` every ZeRO
collective is preceded by an all-gather of ``(count, kind, bucket, phase)``
([Note: diverged ranks] in parallel/zero/sync_check.py). Stage 3's unit order is covered in
test_zero3_memory_traffic_prefetch.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from zero3_models import dp_rows, zero3_batch, zero3_model


def _loss(sdp, ctx, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(sdp(x[dp_rows(ctx)]), y[dp_rows(ctx)])


def _diverged(stage: int, how: str, check_sync: bool) -> str:
    """Rank 1 departs from rank 0 in one of three ways; returns the error each rank saw."""
    ctx = ParallelContext.from_world(timeout=timedelta(seconds=20))
    sdp = ShardedDataParallel(zero3_model(), ctx, stage, bucket_mb=0.01, check_sync=check_sync)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    x, y = zero3_batch(0)
    odd = ctx.rank("dp") == 1
    try:
        for _ in range(2):
            opt.zero_grad()
            if how == "extra_backward" and odd:  # one more reducing forward/backward on rank 1
                _loss(sdp, ctx, x, y).backward()
            if how == "missed_no_sync":  # stage 1 accumulation: rank 1 forgets no_sync
                if odd:
                    _loss(sdp, ctx, x, y).backward()
                else:
                    with sdp.no_sync():
                        _loss(sdp, ctx, x, y).backward()
            _loss(sdp, ctx, x, y).backward()
            if how == "skipped_step" and odd:  # rank 1 skips one optimizer step
                how = ""
                continue
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.destroy()
    return "no error"


@pytest.mark.parametrize("stage,how", [(1, "extra_backward"), (2, "extra_backward"), (1, "missed_no_sync"), (1, "skipped_step")])
def test_check_sync_names_both_ranks_on_every_rank(dist_pool, stage: int, how: str) -> None:
    messages = dist_pool.run(_diverged, stage, how, True, world_size=2, timeout=90)
    for m in messages:
        assert "diverged" in m and "rank 0: collective #" in m and "rank 1: collective #" in m, messages
    assert messages[0] == messages[1]  # the same rows on every rank: the same message


def _train(check_sync: bool, stage: int) -> tuple[list[torch.Tensor], int]:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(zero3_model(), ctx, stage, bucket_mb=0.01, check_sync=check_sync)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    for i in range(3):
        x, y = zero3_batch(i)
        opt.zero_grad()
        _loss(sdp, ctx, x, y).backward()
        sdp.clip_grad_norm_(1.0)
        opt.step()
    params = [p.detach().clone() for p in sdp.module.parameters()]
    checks = sdp._shards.sync.count if sdp._shards.sync is not None else 0
    buckets = len(sdp._shards.buckets)
    ctx.destroy()
    # per step: one reduce-scatter and one all-gather per bucket, one epilogue
    assert checks == (3 * (2 * buckets + 1) if check_sync else 0), (checks, buckets)
    return params, checks


@pytest.mark.parametrize("stage", [1, 2])
def test_check_sync_changes_nothing_when_ranks_agree(dist_pool, stage: int) -> None:
    with_check = dist_pool.run(_train, True, stage, world_size=2, timeout=90)
    without = dist_pool.run(_train, False, stage, world_size=2, timeout=90)
    for (a, n), (b, _) in zip(with_check, without):
        assert n > 0
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb)
