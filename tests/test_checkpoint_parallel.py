"""Checkpoints of dp × tp × pp layouts (``save_checkpoint(dir, par, opt)`` on a ParallelModel).

A source run trains TinyGPT (tied embedding, vocabulary 59: padded at tp 2) ``K`` steps, saves,
and trains ``K`` more; every target run loads that checkpoint in another layout and trains the
same ``K`` steps on the same global batches. The target's losses must equal the source's: bitwise
where only the ZeRO stage changes (the same reductions in the same order on CPU), to the
one-process tolerance where the dp/tp/pp split changes the reduction order. SGD with momentum
0.9: a loader that drops the momentum, a tp slice or a pipeline rank's blocks moves the next
losses far outside that tolerance (checked: a fresh optimizer state is off by ~1e-3 at step K+1).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, gpt_blocks
from shardkit.parallel import load_checkpoint, parallelize, save_checkpoint
from shardkit.parallel.tensor import gpt_plan
from test_parallelize import CLIP, B, _batches, _model
from tolerances import FP32

K = 3  # steps before the save; _batches() holds 2 K


def _build(strategy: str, tp: int, pp: int, *, sequential: bool = False, layers: int = 4):
    """``(par, opt, ctx)`` of ``strategy`` over dp × tp × pp on the world (dp = world / (tp pp)).
    ``sequential``: the unsplit ``nn.Sequential(*gpt_blocks(model))`` (keyed as a pipeline keys)."""
    import torch.distributed as dist

    ctx = ParallelContext.from_world(dp=dist.get_world_size() // (tp * pp), tp=tp, pp=pp)
    if layers == 4:
        model = _model(True)
    else:
        torch.manual_seed(0)
        model = TinyGPT(59, d_model=32, n_layers=layers, n_heads=4, seq_len=16, tie_embeddings=True)
    kwargs = {"tp_plan": gpt_plan(tie_embeddings=True)} if tp > 1 else {}
    if pp > 1:
        kwargs.update(pp={"microbatches": 2, "schedule": "1f1b"}, blocks=gpt_blocks)
    if sequential:
        model = nn.Sequential(*gpt_blocks(model))
    options = {"bucket_mb": 0.004} if strategy.startswith("zero") else None  # several buckets; pieces split params
    par = parallelize(model, ctx, dp=strategy, dp_options=options, **kwargs)
    opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9, weight_decay=0.01)
    return par, opt, ctx


def _train(par, opt, ctx, steps: range) -> list[float]:
    """The global batch's mean loss per step (the dp average of each rank's rows)."""
    import torch.distributed as dist

    dp, r = ctx.size("dp"), ctx.rank("dp")
    rows = slice(r * B // dp, (r + 1) * B // dp)
    batches, losses = _batches(), []
    for step in steps:
        x, y = batches[step]
        opt.zero_grad(set_to_none=True)
        loss = par.forward_backward(x[rows], y[rows]).reshape(1).clone()
        par.clip(CLIP)
        par.step(opt)
        if dp > 1:
            dist.all_reduce(loss, group=ctx.group("dp"))
        losses.append(float(loss) / dp)
    return losses


def _close(par, ctx) -> None:
    par.close()
    ctx.destroy()


def run_then_save(path: str, strategy: str, tp: int, pp: int) -> list[float]:
    """The uninterrupted source run: losses of steps K..2K-1 (saved at K)."""
    par, opt, ctx = _build(strategy, tp, pp)
    _train(par, opt, ctx, range(K))
    save_checkpoint(path, par, opt, extra={"step": K})
    losses = _train(par, opt, ctx, range(K, 2 * K))
    _close(par, ctx)
    return losses


def load_then_run(path: str, strategy: str, tp: int, pp: int, sequential: bool = False) -> list[float]:
    par, opt, ctx = _build(strategy, tp, pp, sequential=sequential)
    assert load_checkpoint(path, par, opt) == {"step": K}
    losses = _train(par, opt, ctx, range(K, 2 * K))
    _close(par, ctx)
    return losses


def _same(got: list[float], want: list[float], bitwise: bool) -> None:
    if bitwise:
        assert got == want, (got, want)
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **FP32)


@pytest.fixture(scope="module")
def dp2_pp2_zero1(dist_pool, tmp_path_factory) -> tuple[str, list[float]]:
    path = str(tmp_path_factory.mktemp("ckp") / "dp2pp2")
    out = dist_pool.run(run_then_save, path, "zero1", 1, 2, world_size=4, timeout=60)
    assert all(o == out[0] for o in out)
    return path, out[0]


@pytest.mark.parametrize(
    "strategy, pp, world_size, sequential, bitwise",
    [
        ("zero2", 2, 4, False, True),  # another stage, same dp x pp: the same reductions
        ("zero1", 2, 2, False, False),  # dp 1 x pp 2
        ("ddp", 2, 2, False, False),  # ddp under the pipeline (its stages keyed by block index)
        ("zero2", 1, 2, True, False),  # pp 2 -> pp 1 (dp 2): the tied head's copy is an alias there
    ],
)
def test_dp_pp_checkpoint_loads_into_other_layouts(dist_pool, dp2_pp2_zero1, strategy, pp, world_size, sequential, bitwise):
    path, want = dp2_pp2_zero1
    out = dist_pool.run(load_then_run, path, strategy, 1, pp, sequential, world_size=world_size, timeout=60)
    _same(out[0], want, bitwise)


def test_pp1_checkpoint_loads_into_pp2(dist_pool, tmp_path) -> None:
    """The other way: saved at pp 1 over the unsplit blocks (the head's weight an alias of the
    embedding's), loaded at dp 2 × pp 2, where the head's copy reads the embedding's key."""
    path = str(tmp_path / "pp1")
    want = dist_pool.run(_save_sequential, path, world_size=2, timeout=60)[0]
    out = dist_pool.run(load_then_run, path, "zero2", 1, 2, world_size=4, timeout=60)
    _same(out[0], want, False)


def _save_sequential(path: str) -> list[float]:
    par, opt, ctx = _build("zero1", 1, 1, sequential=True)
    _train(par, opt, ctx, range(K))
    save_checkpoint(path, par, opt, extra={"step": K})
    losses = _train(par, opt, ctx, range(K, 2 * K))
    _close(par, ctx)
    return losses


@pytest.fixture(scope="module")
def tp2_dp2_zero2(dist_pool, tmp_path_factory) -> tuple[str, list[float]]:
    path = str(tmp_path_factory.mktemp("ckt") / "tp2dp2")
    out = dist_pool.run(run_then_save, path, "zero2", 2, 1, world_size=4, timeout=60)
    assert all(o == out[0] for o in out)
    return path, out[0]


@pytest.mark.parametrize(
    "strategy, tp, world_size, bitwise",
    [
        ("zero1", 2, 4, True),  # another stage, same tp x dp
        ("zero3", 2, 2, False),  # tp 2, dp 1, ZeRO-3: each rank reads its pieces of its slices
        ("zero1", 1, 2, False),  # tp 2 -> tp 1 (dp 2): the slices (and the vocabulary padding) dropped
        ("ddp", 1, 1, False),  # tp 2 -> one rank
    ],
)
def test_tp_checkpoint_loads_into_other_layouts(dist_pool, tp2_dp2_zero2, strategy, tp, world_size, bitwise):
    path, want = tp2_dp2_zero2
    out = dist_pool.run(load_then_run, path, strategy, tp, 1, world_size=world_size, timeout=60)
    _same(out[0], want, bitwise)
