"""``shardkit.initialize`` and ``parallelize()`` train the same layout bitwise alike.

For each layout (ddp, ZeRO 1-3, ZeRO-2 with CPU offload, tp, tp × ZeRO-1, pp, pp × ZeRO-1 on 2
ranks; tp × pp and dp × pp on 4) the same dense model (TinyGPT) is trained twice on the same ranks and batches: once through the DeepSpeed
engine (``engine(x)``, ``engine.backward``, ``engine.step``; ``train_batch`` with a pipeline)
and once through ``parallelize()``'s ParallelModel driven by hand (``par.backward`` or
``forward_backward``, ``clip``, ``step``). The losses and every tensor the optimizer updates
(the fp32 shards under ZeRO) must be equal bit for bit: the engine adds no step logic of its
own. That they train like one process is what tests/engine/ and the usage matrix check.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext

VOCAB, SEQ, STEPS, CLIP, LR = 64, 8, 3, 0.5, 1e-2
BUCKET_ELEMENTS = 1 << 18  # reduce_bucket_size: 1 MiB of fp32 in both builds
ROWS, P_MICRO = 4, 2  # rows per dp rank and step; pipeline micro-batches (= accumulation steps)

#: name -> (zero stage, tp, pp, offload, world size)
LAYOUTS = {
    "ddp": (0, 1, 1, None, 2),
    "zero1": (1, 1, 1, None, 2),
    "zero2": (2, 1, 1, None, 2),
    "zero3": (3, 1, 1, None, 2),
    "zero2-offload-cpu": (2, 1, 1, "cpu", 2),
    "tp": (0, 2, 1, None, 2),
    "tp-zero1": (1, 2, 1, None, 2),
    "pp": (0, 1, 2, None, 2),
    "pp-zero1": (1, 1, 2, None, 2),
    "tp-pp": (0, 2, 2, None, 4),
    "dp-pp": (0, 1, 2, None, 4),
}


def _model() -> nn.Module:
    from shardkit.models import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=32, n_layers=2, n_heads=2, seq_len=SEQ)


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _config(stage: int, tp: int, pp: int, offload: str | None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    cfg: dict = {
        "train_micro_batch_size_per_gpu": ROWS // P_MICRO if pp > 1 else ROWS,
        "gradient_accumulation_steps": P_MICRO if pp > 1 else 1,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "gather_logits": False}
    if pp > 1:
        cfg["pipeline"] = {"stages": pp, "microbatches": P_MICRO, "schedule": "1f1b"}
    return cfg


def _optimized(opt) -> list[torch.Tensor]:
    """Every tensor the optimizer updates (ZeRO: this rank's fp32 shards)."""
    from shardkit.parallel import ZeroOptimizer

    inner = opt.optimizer if isinstance(opt, ZeroOptimizer) else opt
    tensors = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    # the engine lists a pipeline rank's params in the model's order, par.parameters() in the
    # stages' order: compare them as a set of tensors
    return sorted(tensors, key=lambda t: (tuple(t.shape), t.flatten().tolist()))


def _engine_run(layout: str) -> tuple[list[float], list[torch.Tensor]]:
    import shardkit
    from shardkit.kernels import FusedAdamW
    from shardkit.parallel.tensor import gpt_plan

    stage, tp, pp, offload, _ = LAYOUTS[layout]
    with ParallelContext.from_world(tp=tp, pp=pp) as ctx:
        engine, opt, _, _ = shardkit.initialize(
            model=_model(),
            config=_config(stage, tp, pp, offload),
            ctx=ctx,
            optimizer=functools.partial(FusedAdamW, lr=LR),
            tp_plan=gpt_plan() if tp > 1 else None,
        )
        dp_rank, losses = ctx.rank("dp"), []
        for step in range(STEPS):
            x, y = _batch(step, dp_rank)
            if pp > 1:
                micro = list(zip(x.chunk(P_MICRO), y.chunk(P_MICRO)))
                losses.append(float(engine.train_batch(iter(micro))))
            else:
                loss = engine.parallel.loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
        out = _optimized(opt)
        if pp > 1:
            engine.close()
        return losses, out


def _parallelize_run(layout: str) -> tuple[list[float], list[torch.Tensor]]:
    from shardkit.kernels import FusedAdamW
    from shardkit.models import gpt_blocks
    from shardkit.parallel import parallelize
    from shardkit.parallel.tensor import gpt_plan

    stage, tp, pp, offload, _ = LAYOUTS[layout]
    dp = "ddp" if stage == 0 else f"zero{stage}"
    options: dict = {"bucket_mb": BUCKET_ELEMENTS * 4 / 2**20}
    if offload:
        options["offload"] = offload
    if stage == 3:
        options["forward_prefetch"] = True  # DeepSpeed's default stage3_prefetch_bucket_size > 0
    with ParallelContext.from_world(tp=tp, pp=pp) as ctx:
        model = _model()
        par = parallelize(
            model,
            ctx,
            tp_plan=gpt_plan() if tp > 1 else None,
            pp={"microbatches": P_MICRO, "schedule": "1f1b"} if pp > 1 else None,
            dp=dp,
            blocks=gpt_blocks if pp > 1 else None,
            dp_options=options,
        )
        params = par.parameters() if pp > 1 else [p for p in model.parameters() if p.requires_grad]
        opt = par.make_optimizer(FusedAdamW, params, lr=LR)
        dp_rank, losses = ctx.rank("dp"), []
        for step in range(STEPS):
            x, y = _batch(step, dp_rank)
            if pp > 1:
                losses.append(float(par.forward_backward(x, y)))
            else:
                loss = par.loss_fn(par.module(x), y)
                par.backward(loss)
                losses.append(float(loss))
            par.clip(CLIP)
            par.step(opt)
            opt.zero_grad(set_to_none=True)
        out = _optimized(opt)
        par.close()
        return losses, out


def _both(layout: str) -> dict:
    engine_losses, engine_state = _engine_run(layout)
    par_losses, par_state = _parallelize_run(layout)
    assert engine_losses == par_losses, (engine_losses, par_losses)
    assert len(engine_state) == len(par_state) > 0
    for i, (a, b) in enumerate(zip(engine_state, par_state)):
        assert a.shape == b.shape and torch.equal(a, b), f"{layout}: optimized tensor {i} differs"
    return {"losses": engine_losses}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_initialize_trains_bitwise_like_parallelize(dist_pool, layout: str) -> None:
    out = dist_pool.run(_both, layout, world_size=LAYOUTS[layout][-1], timeout=240)
    assert all(len(o["losses"]) == STEPS for o in out)
