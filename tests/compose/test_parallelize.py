"""``parallelize``: dp × tp × pp compositions of TinyGPT trained against the dense single-process
model (same seed, same global batch, clipping active), and bad arguments before any collective."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks, lm_loss
from shardkit.parallel import DynamicLossScaler, parallelize
from shardkit.parallel.tensor import gpt_plan
from parallelize_cases import B, T, VOCAB, lm_batches, tiny_gpt, train_parallelized


@pytest.mark.parametrize(
    "world_size, tp, pp, tie, schedule",
    [
        (2, 1, 1, True, "1f1b"),  # dp 2
        (2, 2, 1, True, "1f1b"),  # tp 2, vocab-parallel loss, tied embedding
        (4, 2, 1, True, "1f1b"),  # tp 2 x dp 2
        (2, 1, 2, False, "1f1b"),  # pp 2
        (4, 1, 2, False, "gpipe"),  # pp 2 x dp 2: coalesced dp all-reduce after the pipeline
        (4, 2, 2, False, "1f1b"),  # tp 2 x pp 2
        (2, 1, 2, True, "1f1b"),  # pp 2, embedding tied to the head across stages: the norm counts it once
        (4, 2, 2, True, "zb-h1"),  # tp 2 x pp 2, tied across stages, split backward
    ],
)
def test_parallelize_trains_like_the_dense_model(dist_pool, world_size, tp, pp, tie, schedule):
    dist_pool.run(train_parallelized, tp, pp, tie, schedule, world_size=world_size, timeout=180)


@pytest.mark.parametrize("dp", ["zero1", "zero2", "zero3"])
def test_parallelize_zero_with_tp_trains_like_the_dense_model(dist_pool, dp):
    """tp 2 x dp 2 with ZeRO on the dp axis: each rank shards its TP slices over its dp peers; the
    clip norm adds over dp and tp with the replicated params (norms, row biases) counted once."""
    dist_pool.run(train_parallelized, 2, 1, True, "1f1b", False, dp, world_size=4, timeout=180)


@pytest.mark.parametrize("world_size, strategy", [(2, "ddp"), (4, "ddp"), (4, "zero2")])
def test_parallelize_sequence_parallel_trains_like_the_dense_model(dist_pool, world_size, strategy):
    """gpt_plan(sequence_parallel=True): sequence shards between the linears, LayerNorm gradients
    summed over tp; the same losses, norms and parameters as the dense model."""
    dist_pool.run(train_parallelized, 2, 1, True, "1f1b", False, strategy, True, world_size=world_size, timeout=180)


@pytest.mark.parametrize("world_size, tp, pp, checkpointing", [(2, 1, 1, True), (2, 2, 1, "cpu"), (2, 1, 2, True)])
def test_parallelize_with_activation_checkpointing_trains_like_the_dense_model(dist_pool, world_size, tp, pp, checkpointing):
    dist_pool.run(train_parallelized, tp, pp, True, "1f1b", checkpointing, world_size=world_size, timeout=180)


def _bad_arguments() -> None:
    from unittest import mock

    import torch.distributed as dist

    with ParallelContext.from_world(dp=1, tp=2) as ctx:
        cases = [
            (dict(dp="zero4"), ValueError, "dp"),
            (dict(), ValueError, "tp_plan"),
            (dict(tp_plan=gpt_plan(), dp="ddp", loss_scaler=DynamicLossScaler()), ValueError, "loss_scaler"),
            (dict(tp_plan=gpt_plan(), pp={"microbatches": 2}), ValueError, "pp"),
            (dict(tp_plan=gpt_plan(), checkpointing="gpu"), ValueError, "checkpointing"),
            (dict(tp_plan=gpt_plan(), checkpointing=True), ValueError, "blocks"),
            (dict(tp_plan=[("x", 1)]), TypeError, "tp_plan"),
            (dict(tp_plan=gpt_plan(), loss_fn=3), TypeError, "loss_fn"),
        ]
        names = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "barrier", "send", "recv")
        patches = [mock.patch.object(dist, n, side_effect=AssertionError(f"collective {n}")) for n in names]
        for patch in patches:
            patch.start()
        try:
            for kwargs, exc, word in cases:
                with pytest.raises(exc, match=word):
                    parallelize(tiny_gpt(), ctx, **kwargs)
            with pytest.raises(TypeError, match="model"):
                parallelize(nn.Linear(2, 2).weight, ctx)
        finally:
            for patch in patches:
                patch.stop()
    with ParallelContext.from_world(dp=1, pp=2) as ctx:
        with pytest.raises(ValueError, match="blocks"):
            parallelize(tiny_gpt(), ctx, pp={"microbatches": 2})
        with pytest.raises(ValueError, match="unknown option"):
            parallelize(tiny_gpt(), ctx, pp={"micro": 2}, blocks=gpt_blocks)
        with pytest.raises(ValueError, match="zero3"):
            parallelize(tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, dp="zero3")


def test_parallelize_bad_arguments_raise_before_any_collective(dist_pool):
    dist_pool.run(_bad_arguments, world_size=2, timeout=120)


def test_gpt_blocks_compose_to_the_model():
    model = tiny_gpt()
    x = torch.randint(VOCAB, (2, T))
    out = x
    for block in gpt_blocks(copy.deepcopy(model)):
        out = block(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def _no_sync_body(strategy: str) -> None:
    """pp 2 x dp 2: two half-batch forward_backward calls, the first under ``par.no_sync()``: no
    gradient traffic on the dp group inside the block (only the pipeline's few-byte token count
    over dp, for its loss normalization), the gradients of this rank's stages reduced after the
    second call, and the accumulated gradient's norm equals the dense model's over both halves
    (each half's token-weighted mean, summed)."""
    import torch.distributed as dist

    with ParallelContext.from_world(dp=2, pp=2) as ctx:
        par = parallelize(tiny_gpt(False), ctx, dp=strategy, blocks=gpt_blocks, pp={"microbatches": 2})
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3)
        dp_group = ctx.group("dp")
        dp_stats = [par.stats] + ([par.module.comm_stats] if par.strategy is not None else [])

        def dp_bytes() -> int:
            return sum(s.bytes(group=dp_group) for s in dp_stats)

        grad_bytes = sum(p.numel() * 4 for p in par.parameters())

        x, y = lm_batches()[0]
        r = ctx.rank("dp")
        halves = [slice(0, B // 2), slice(B // 2, B)]
        mine = [slice(h.start + r * B // 4, h.start + (r + 1) * B // 4) for h in halves]
        opt.zero_grad(set_to_none=True)
        before = dp_bytes()
        with par.no_sync():
            par.forward_backward(x[mine[0]], y[mine[0]])
        inside = dp_bytes() - before
        assert inside <= 64, f"{strategy}: {inside} bytes on dp inside no_sync"
        par.forward_backward(x[mine[1]], y[mine[1]])
        after = dp_bytes() - before - inside
        assert after >= grad_bytes, f"{strategy}: {after} bytes on dp after no_sync, {grad_bytes} of grads"
        norm = float(par.clip(1e9))
        dense = tiny_gpt(False)
        for h in halves:
            lm_loss(dense(x[h]), y[h]).backward()
        want = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e9))
        assert abs(norm - want) <= 1e-4 * want, (strategy, norm, want)
        assert par.step(opt)
        dist.barrier()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_no_sync_under_a_pipeline_accumulates_and_reduces_once(dist_pool, strategy):
    dist_pool.run(_no_sync_body, strategy, world_size=4, timeout=180)
