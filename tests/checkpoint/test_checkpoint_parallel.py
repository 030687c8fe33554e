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
from parallelize_cases import B, CLIP, lm_batches, tiny_gpt
from tolerances import FP32

K = 3  # steps before the save; lm_batches() holds 2 K


def _build(strategy: str, tp: int, pp: int, *, sequential: bool = False, layers: int = 4):
    """``(par, opt, ctx)`` of ``strategy`` over dp × tp × pp on the world (dp = world / (tp pp)).
    ``sequential``: the unsplit ``nn.Sequential(*gpt_blocks(model))`` (keyed as a pipeline keys)."""
    import torch.distributed as dist

    ctx = ParallelContext.from_world(dp=dist.get_world_size() // (tp * pp), tp=tp, pp=pp)
    if layers == 4:
        model = tiny_gpt(True)
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
    batches, losses = lm_batches(), []
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


# ---- atomicity and mismatches --------------------------------------------------------------------
def _dense_state(par) -> dict[str, torch.Tensor]:
    return par.pipeline.full_state_dict()


def crash_mid_save(path: str) -> list[str]:
    """dp 2 × pp 2: save at K, one more step, a second save whose writer on rank 3 (pp rank 1)
    fails after writing part of its file: every rank raises, the step-K checkpoint loads."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    par, opt, ctx = _build("zero1", 1, 2)
    _train(par, opt, ctx, range(K))
    save_checkpoint(path, par, opt, extra={"step": K})
    at_k = _dense_state(par)
    _train(par, opt, ctx, range(K, K + 1))
    real = filesystem._write_files_from_queue
    if dist.get_rank() == 3:

        def broken(create_stream, file_queue, *args, **kwargs):  # type: ignore[no-untyped-def]
            file_name, _, _ = file_queue.get()
            with create_stream(file_name, "wb") as f:
                f.write(b"half a shard")
            raise OSError("No space left on device (simulated)")

        filesystem._write_files_from_queue = broken
    try:
        with pytest.raises(RuntimeError, match=r"writing failed on ranks \[3\]: OSError: No space left"):
            save_checkpoint(path, par, opt, extra={"step": K + 1})
    finally:
        filesystem._write_files_from_queue = real
    dist.barrier()
    leftovers = sorted(p.name for p in __import__("pathlib").Path(path).parent.iterdir())
    _close(par, ctx)
    par, opt, ctx = _build("zero2", 1, 2)
    assert load_checkpoint(path, par, opt) == {"step": K}
    got = _dense_state(par)
    assert got.keys() == at_k.keys()
    for k in got:
        assert torch.equal(got[k], at_k[k]), k
    _close(par, ctx)
    return leftovers


def test_crash_mid_save_keeps_previous_checkpoint(dist_pool, tmp_path) -> None:
    out = dist_pool.run(crash_mid_save, str(tmp_path / "ck"), world_size=4, timeout=60)
    assert out[0] == ["ck"], out[0]  # the failed save's temp dir is gone


def mismatches(good: str, pp1: str) -> None:
    """dp 1 × pp 2 (world 2): a checkpoint of other blocks, of another model naming, and a
    mismatched optimizer raise a ValueError/TypeError naming what differs, before any read,
    and leave the model as it was."""
    par, opt, ctx = _build("zero1", 1, 2, layers=3)  # one block fewer than the checkpoint
    _train(par, opt, ctx, range(1))  # some state of its own to protect
    before, momentum = _dense_state(par), [s["momentum_buffer"].clone() for s in opt.optimizer.state.values()]
    with pytest.raises(ValueError, match=r"checkpoint key 'model\.4\.ln1\.weight': the model has no such parameter"):
        load_checkpoint(good, par, opt)
    after = _dense_state(par)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(s["momentum_buffer"], m) for s, m in zip(opt.optimizer.state.values(), momentum, strict=True))
    _close(par, ctx)
    par, opt, ctx = _build("zero1", 1, 2)
    with pytest.raises(
        ValueError, match=r"pp: the checkpoint was saved at pp 1.*model key '0\.tok_emb\.weight': not in the checkpoint"
    ):
        load_checkpoint(pp1, par, opt)  # saved over TinyGPT's own keys, not the blocks'
    with pytest.raises(TypeError, match="optimizer: a ShardedDataParallel model needs its own ZeroOptimizer"):
        load_checkpoint(good, par, torch.optim.SGD(par.parameters(), lr=0.1))
    _close(par, ctx)


def _save_tinygpt_keys(path: str) -> None:
    par, opt, ctx = _build("zero1", 1, 1)
    save_checkpoint(path, par, opt)
    _close(par, ctx)


def test_mismatched_layouts_raise_naming_the_difference(dist_pool, dp2_pp2_zero1, tmp_path) -> None:
    path, _ = dp2_pp2_zero1
    pp1 = str(tmp_path / "tinygpt_keys")
    dist_pool.run(_save_tinygpt_keys, pp1, world_size=2, timeout=60)
    dist_pool.run(mismatches, path, pp1, world_size=2, timeout=60)


# ---- shardkit.initialize engines -----------------------------------------------------------------
def engine_roundtrip(root: str, kind: str, stages: tuple[int, int]) -> dict:
    """An engine (``kind`` "pp": pipeline.stages 2, AdamW on an MLP; "tp": tensor_parallel 2 on
    HF GPT-2) trains 2 steps, saves (ZeRO stage ``stages[0]``), trains 2 more; a fresh engine
    (stage ``stages[1]``) loads ``root/latest`` and trains the same 2 steps."""
    import shardkit
    from engine_cases import GAS, gpt2_batch, pp_config, pp_micro_batches, pp_mlp, tiny_gpt2, tp_config

    def build(stage: int):
        if kind == "pp":
            ctx = ParallelContext.from_world(pp=2)
            return shardkit.initialize(model=pp_mlp(), config=pp_config(stage), ctx=ctx)[0], ctx
        ctx = ParallelContext.from_world(tp=2)
        return shardkit.initialize(model=tiny_gpt2(), config=tp_config(stage, 2), ctx=ctx)[0], ctx

    def train(engine, steps: range) -> list[float]:
        if kind == "pp":
            return [float(engine.train_batch(iter(pp_micro_batches(step)))) for step in steps]
        losses = []
        for step in steps:
            for micro in range(GAS):
                out = engine(input_ids=gpt2_batch(step, micro), labels=gpt2_batch(step, micro))
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss))
        return losses

    engine, ctx = build(stages[0])
    train(engine, range(2))
    assert engine.save_checkpoint(root, client_state={"epoch": 1})
    want = train(engine, range(2, 4))
    if kind == "pp":
        engine.close()
    ctx.destroy()
    engine, ctx = build(stages[1])
    path, client = engine.load_checkpoint(root)
    assert path.endswith("global_step2") and client == {"epoch": 1} and engine.global_steps == 2
    got = train(engine, range(2, 4))
    if kind == "pp":
        engine.close()
    ctx.destroy()
    return {"want": want, "got": got}


@pytest.mark.parametrize("kind, stages", [("pp", (1, 2)), ("tp", (0, 1))])
def test_engine_checkpoints_with_tp_and_pp(dist_pool, tmp_path, kind, stages) -> None:
    """Engine.save_checkpoint/load_checkpoint under pipeline.stages 2 (ZeRO-1 -> ZeRO-2) and
    tensor_parallel 2 (stage 0 -> ZeRO-1): the resumed engine continues bitwise."""
    out = dist_pool.run(engine_roundtrip, str(tmp_path / "ckpt"), kind, stages, world_size=2, timeout=60)
    assert out[0]["got"] == out[0]["want"], out[0]


def test_tp_checkpoint_consolidates_to_the_dense_model(tp2_dp2_zero2, tmp_path) -> None:
    """``shardkit consolidate`` of the tp 2 × dp 2 checkpoint: dense shapes (vocabulary 59, the
    padding row dropped), loaded strictly into a plain TinyGPT whose loss on batch K is the
    source run's."""
    from shardkit.consolidate import consolidate
    from shardkit.models import lm_loss

    path, want = tp2_dp2_zero2
    model_pt, _ = consolidate(path, tmp_path / "export")
    model = tiny_gpt(True)
    model.load_state_dict(torch.load(model_pt, weights_only=True))
    x, y = lm_batches()[K]
    with torch.no_grad():
        torch.testing.assert_close(float(lm_loss(model(x), y)), want[0], **FP32)
