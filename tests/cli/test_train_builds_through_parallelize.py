"""``shardkit train`` and ``parallelize()`` train the same layout bitwise alike.

For each layout (ddp, ZeRO 1-3, ZeRO-2 with CPU offload, tp, tp × ZeRO-3, pp, pp × ZeRO-1 on 2
ranks; tp × pp and dp × pp on 4) the demo trainer's :func:`shardkit.train.train` runs inside the
test's ranks, and the same layout is then built with ``parallelize()`` and stepped by hand
(``forward_backward``, ``clip``, ``step``) on the same batches, learning rates and seed. Every
step's loss and the eval loss after the last step (which reads the final parameters) must be
equal bit for bit: the trainer adds no step logic of its own. ``clip=0.05`` keeps the global-norm
clip active on every step, so a trainer that clipped differently would fail here. That it trains
like one process is what tests/cli/test_train_parallel.py checks.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.comm import ParallelContext

pytestmark = pytest.mark.slow  # trains twice per layout

#: name -> (TrainConfig fields, world size)
LAYOUTS = {
    "ddp": (dict(strategy="ddp"), 2),
    "zero1": (dict(strategy="zero1"), 2),
    "zero2": (dict(strategy="zero2"), 2),
    "zero3": (dict(strategy="zero3"), 2),
    "zero2-offload-cpu": (dict(strategy="zero2", offload="cpu"), 2),
    "tp": (dict(tp=2), 2),
    "tp-zero3": (dict(tp=2, strategy="zero3"), 2),
    "pp": (dict(pp=2, microbatches=2), 2),
    "pp-zero1": (dict(pp=2, microbatches=2, strategy="zero1"), 2),
    "tp-pp": (dict(tp=2, pp=2, microbatches=2), 4),
    "dp-pp": (dict(pp=2, microbatches=2, strategy="ddp"), 4),
}
SIZE = dict(
    steps=3, eval_every=3, eval_iters=1, d_model=32, n_layers=2, n_heads=2, seq_len=16, batch_size=4, device="cpu", clip=0.05
)


def _config(layout: str):
    from shardkit.train.config import TrainConfig

    fields, world = LAYOUTS[layout]
    return TrainConfig(nproc=world, **SIZE, **fields)


def _by_hand(layout: str) -> tuple[list[float], float]:
    """The same layout through ``parallelize()``, stepped by hand: losses and the final eval loss."""
    from shardkit.data import get_batch, load_corpus
    from shardkit.kernels import FusedAdamW
    from shardkit.models import TinyGPT, gpt_blocks
    from shardkit.parallel import parallelize
    from shardkit.parallel.tensor import gpt_plan
    from shardkit.train.schedule import lr_at

    cfg = _config(layout)
    dp = cfg.strategy
    options = {"bucket_mb": 25.0, "grad_buckets": "copy"} if dp == "ddp" else {}
    if dp.startswith("zero"):
        options = {"bucket_mb": 25.0, "offload": cfg.offload, "nvme_dir": None}
    corpus = load_corpus()
    with ParallelContext.from_world(tp=cfg.tp, pp=cfg.pp) as ctx:
        torch.manual_seed(cfg.seed)
        model = TinyGPT(corpus.tokenizer.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)
        par = parallelize(
            model,
            ctx,
            dp=dp,
            tp_plan=gpt_plan() if cfg.tp > 1 else None,
            pp={"schedule": "1f1b", "microbatches": cfg.microbatches, "virtual_stages": 1} if cfg.pp > 1 else None,
            blocks=gpt_blocks,
            dp_options=options,
        )
        decay = [p for p in par.parameters() if p.dim() >= 2]
        no_decay = [p for p in par.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = par.make_optimizer(FusedAdamW, groups, lr=cfg.lr, betas=(0.9, 0.95))
        data = torch.Generator().manual_seed(cfg.seed)
        dp_rank, dp_size = ctx.rank("dp"), ctx.size("dp")
        losses = []
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
            x, y = get_batch("train", cfg.batch_size, cfg.seq_len, data, rank=dp_rank, world_size=dp_size, corpus=corpus)
            opt.zero_grad(set_to_none=True)
            losses.append(float(par.forward_backward(x, y)))
            par.clip(cfg.clip)
            par.step(opt)
        val = torch.Generator().manual_seed(cfg.seed + 12345)
        x, y = get_batch("val", cfg.batch_size * dp_size, cfg.seq_len, val, corpus=corpus)
        final_eval = par.evaluate(x, y)
        par.close()
    return losses, final_eval


def _both(layout: str) -> dict:
    from shardkit.train import train

    result = train(_config(layout))
    losses, final_eval = _by_hand(layout)
    assert result.train_losses == losses, (result.train_losses, losses)
    assert result.evals[-1] == (3, final_eval), (result.evals, final_eval)
    return {"losses": losses}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_steps_bitwise_like_parallelize(dist_pool, layout: str) -> None:
    out = dist_pool.run(_both, layout, world_size=LAYOUTS[layout][1], timeout=240)
    assert all(len(o["losses"]) == 3 for o in out)
