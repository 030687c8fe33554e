"""Training with context parallelism equals the single-process model on the full sequences.

TinyGPT (learned positions, tied head) through ``parallelize(..., cp={...})`` with every dp
strategy, with tp 2, and with activation checkpointing: losses, clipped global norms, the
evaluation loss and every final parameter against ``dense_run`` (one process, the whole batch,
the same seed and SGD steps) from ``parallelize_cases``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.context import gpt_cp_plan
from shardkit.parallel.tensor import gpt_plan, shard_state_dict
from distributed import forbid_collectives
from parallelize_cases import B, CLIP, T, VOCAB, _dense_slice_eval, dense_run, lm_batches, tiny_gpt
from tolerances import FP32


def _right_padded(batches):
    """Every row's last 5 targets ignored: with T=16 and zigzag over cp 2, rank 0 (positions 0-3,
    12-15) keeps 4 valid targets per row and rank 1 (4-11) 7, so a mean of the cp ranks' means
    would be wrong; each dp replica keeps the same count, so the dp average of replica means is
    the dense mean."""
    out = []
    for x, y in batches:
        y = y.clone()
        y[:, -5:] = -100
        out.append((x, y))
    return out


def _train_with_cp(
    cp: int,
    tp: int,
    strategy: str,
    mode: str,
    layout: str,
    checkpointing: bool = False,
    pp: int = 1,
    padded: bool = False,
    ulysses_size: int | None = None,
    fused: bool = False,
) -> list[float]:
    world = dist.get_world_size()
    batches = _right_padded(lm_batches()) if padded else lm_batches()
    with ParallelContext.from_world(cp=cp, tp=tp, pp=pp) as ctx:
        dense, ref_losses, ref_norms = dense_run(True, batches)
        kwargs = {"tp_plan": gpt_plan()} if tp > 1 else {}
        if checkpointing or pp > 1:
            kwargs.update(blocks=gpt_blocks, checkpointing=checkpointing)
        if pp > 1:
            kwargs.update(pp={"microbatches": 2, "schedule": "1f1b"})
        cp_opts = {"plan": gpt_cp_plan(), "mode": mode, "layout": layout, "ulysses_size": ulysses_size}
        if fused:  # the head's loss formed from its input, never as logits
            kwargs.update(fused_cross_entropy=True)
        par = parallelize(tiny_gpt(True), ctx, dp=strategy, cp=cp_opts, **kwargs)
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
        dp, r = ctx.size("dp"), ctx.rank("dp")
        assert dp == world // (cp * tp * pp)
        rows = slice(r * B // dp, (r + 1) * B // dp)
        losses = []
        for step, (x, y) in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            loss = par.forward_backward(x[rows], y[rows])  # full sequences: each cp rank keeps its tokens
            norm = par.clip(CLIP)
            par.step(opt)
            mean = loss.clone().reshape(1)
            if dp > 1:
                dist.all_reduce(mean, group=ctx.group("dp"))
                mean /= dp
            losses.append(float(mean))
            assert abs(float(norm) - ref_norms[step]) <= 1e-4 * ref_norms[step], (step, float(norm), ref_norms[step])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        gen = torch.Generator().manual_seed(99)
        xv, yv = torch.randint(VOCAB, (B, T), generator=gen), torch.randint(VOCAB, (B, T), generator=gen)
        if padded:
            ((xv, yv),) = _right_padded([(xv, yv)])
        assert abs(par.evaluate(xv[rows], yv[rows]) - _dense_slice_eval(dense, xv[rows], yv[rows])) < 1e-5
        if pp > 1:  # this rank's blocks, keyed by block index (the unsplit nn.Sequential(*blocks)'s keys)
            dense_blocks = torch.nn.Sequential(*gpt_blocks(dense)).state_dict()
            for key, value in par.pipeline.full_state_dict().items():
                torch.testing.assert_close(value, dense_blocks[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
            return losses
        want = shard_state_dict(dense.state_dict(), gpt_plan(), ctx) if tp > 1 else dense.state_dict()
        module = getattr(par.module, "module", par.module)
        state = par.module.full_state_dict() if strategy.startswith("zero") else module.state_dict()
        for key, value in state.items():
            torch.testing.assert_close(value, want[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
        return losses


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp2_trains_like_the_dense_model(dist_pool, mode):
    dist_pool.run(_train_with_cp, 2, 1, "ddp", mode, "zigzag", world_size=2, timeout=120)


def test_right_padded_batches_weigh_tokens_over_the_replica(dist_pool):
    """dp 2 x cp 2, ZeRO-2: the cp ranks hold 4 and 7 valid targets per row (see _right_padded)."""
    dist_pool.run(_train_with_cp, 2, 1, "zero2", "ring", "zigzag", False, 1, True, world_size=4, timeout=180)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_cp2_with_zero_trains_like_the_dense_model(dist_pool, strategy):
    """dp 2 x cp 2: ZeRO shards over the 4 replicas of each parameter (the dp_cp group)."""
    dist_pool.run(_train_with_cp, 2, 1, strategy, "ring", "zigzag", world_size=4, timeout=180)


def test_cp4_contiguous_layout(dist_pool):
    dist_pool.run(_train_with_cp, 4, 1, "ddp", "ring", "contiguous", world_size=4, timeout=180)


def test_cp4_hybrid_trains_like_the_dense_model(dist_pool):
    """cp 4 as 2 all-to-all groups of 2 ranks x rings of 2 (Megatron's a2a+p2p), ZeRO-3."""
    dist_pool.run(_train_with_cp, 4, 1, "zero3", "hybrid", "zigzag", ulysses_size=2, world_size=4, timeout=180)


def test_cp2_with_tp2(dist_pool):
    """cp 2 x tp 2 (tp innermost): the TP layers' heads, then attention over the cp shards."""
    dist_pool.run(_train_with_cp, 2, 2, "zero2", "ulysses", "zigzag", world_size=4, timeout=180)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_cp2_with_pp2_trains_like_the_dense_model(dist_pool, strategy):
    """cp 2 x pp 2 (1f1b, 2 micro-batches): each stage runs this rank's tokens; the pipeline
    normalizes by the token count over dp x cp, the replica's loss sums the cp ranks' shares."""
    dist_pool.run(_train_with_cp, 2, 1, strategy, "ring", "zigzag", False, 2, True, world_size=4, timeout=240)


@pytest.mark.parametrize(
    "strategy, mode, pp",
    [("ddp", "ring", 1), ("zero3", "ulysses", 1), ("zero1", "ring", 2)],
    ids=["ddp-ring", "zero3-ulysses", "pp2-zero1-ring"],
)
def test_cp2_with_the_fused_cross_entropy_trains_like_the_dense_model(dist_pool, strategy, mode, pp):
    """The fused head forms the sum of this rank's token losses (ZeRO-3: inside its forward, while
    its weight is gathered; a pipeline: from the hidden states its last stage hands on), divided by
    the replica's count of valid targets: right-padded rows, where the cp ranks hold 4 and 7 valid
    targets per row, so a per-rank mean would be wrong."""
    world = 2 if strategy == "ddp" else 4
    dist_pool.run(_train_with_cp, 2, 1, strategy, mode, "zigzag", False, pp, True, fused=True, world_size=world, timeout=240)


def test_cp2_with_activation_checkpointing(dist_pool):
    dist_pool.run(_train_with_cp, 2, 1, "ddp", "ring", "zigzag", True, world_size=2, timeout=120)


def _refusals_body():
    with ParallelContext.from_world(cp=2) as ctx:
        model = tiny_gpt(True)
        cases = [
            ({"cp": {"mode": "ring"}}, ValueError, "'plan' is required"),
            ({"cp": {"plan": gpt_cp_plan(), "mode": "p2p"}}, ValueError, "mode must be one of"),
            ({"cp": {"plan": gpt_cp_plan(), "chunks": 2}}, ValueError, r"unknown option\(s\) \['chunks'\]"),
            ({"cp": {"plan": {"blocks.*.attn": "heads"}}}, ValueError, "styles must be one of"),
            ({"cp": {"plan": {"encoder.*": "attention"}}}, ValueError, "names no module"),
            ({"cp": {"plan": gpt_cp_plan()}, "dp": "none"}, ValueError, "dp='none' with cp > 1"),
            ({"cp": {"plan": gpt_cp_plan()}, "loss_fn": lambda o, t: o.sum()}, ValueError, "custom loss_fn"),
            ({"cp": "ring"}, TypeError, "ContextParallelOptions or a dict"),
            ({"cp": {"plan": gpt_cp_plan(), "mode": "hybrid"}}, TypeError, "needs ulysses_size"),
            ({"cp": {"plan": gpt_cp_plan(), "mode": "hybrid", "ulysses_size": 4}}, ValueError, "divisor of the cp size 2"),
            ({"cp": {"plan": gpt_cp_plan(), "ulysses_size": 2}}, ValueError, "applies to mode='hybrid' only"),
        ]
        patch = forbid_collectives()
        try:
            for kwargs, error, match in cases:
                with pytest.raises(error, match=match):
                    parallelize(model, ctx, **kwargs)
        finally:
            patch.stop()
        par = parallelize(model, ctx, cp={"plan": gpt_cp_plan()})
        with pytest.raises(ValueError, match="must be a multiple of 4; pad it to 12 tokens"):
            par.forward_backward(torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, dtype=torch.long))
        # shapes that differ between the cp ranks: the same error on both, no exchange of odd blocks
        n = 16 if ctx.rank("cp") == 0 else 8
        with pytest.raises(ValueError, match="must get the same full batch"):
            par.forward_backward(torch.zeros(2, n, dtype=torch.long), torch.zeros(2, n, dtype=torch.long))
        # a model without a plan on the cp context runs the whole batch on every cp rank
        plain = parallelize(tiny_gpt(True), ctx)
        assert plain.sequence is None and float(plain.forward_backward(*lm_batches()[0])) > 0
    with ParallelContext.from_world() as ctx:  # no cp axis: the options are checked, then nothing to do
        par = parallelize(tiny_gpt(True), ctx, cp={"plan": gpt_cp_plan()})
        assert par.sequence is None
        with pytest.raises(ValueError, match="names no module"):
            parallelize(tiny_gpt(True), ctx, cp={"plan": {"encoder.*": "attention"}})
    return True


def test_parallelize_refuses_bad_cp_options_before_any_collective(dist_pool):
    assert all(dist_pool.run(_refusals_body, world_size=2))


def _checkpoint_body(path: str):
    """dp 2 x cp 2 ZeRO-2: save after 3 steps; resuming at dp 2 x cp 2 gives the uninterrupted
    run's parameters bitwise, and at dp 4 (no cp) within the fp32 tolerance (the checkpoint's dp is
    the dp_cp group's 4 replicas, so it reshards like any dp 4 one)."""
    from shardkit.parallel import load_checkpoint, save_checkpoint

    batches = lm_batches()

    def run(cp, steps, load=False, save=False):
        with ParallelContext.from_world(cp=cp) as ctx:
            kwargs = {"cp": {"plan": gpt_cp_plan()}} if cp > 1 else {}
            par = parallelize(tiny_gpt(True), ctx, dp="zero2", **kwargs)
            opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
            if load:
                load_checkpoint(path, par, opt)
            dp, r = ctx.size("dp"), ctx.rank("dp")
            rows = slice(r * B // dp, (r + 1) * B // dp)
            for x, y in steps:
                opt.zero_grad(set_to_none=True)
                par.forward_backward(x[rows], y[rows])
                par.clip(CLIP)
                par.step(opt)
            if save:
                save_checkpoint(path, par, opt)
            return {k: v.clone() for k, v in par.module.full_state_dict().items()}

    run(2, batches[:3], save=True)
    whole = run(2, batches)
    resumed = run(2, batches[3:], load=True)
    resharded = run(1, batches[3:], load=True)
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key
        torch.testing.assert_close(resharded[key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
    return True


def test_cp_checkpoint_resumes_and_reshards(dist_pool, tmp_path):
    assert all(dist_pool.run(_checkpoint_body, str(tmp_path / "ckpt"), world_size=4, timeout=240))
