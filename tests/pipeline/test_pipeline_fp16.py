"""fp16 dynamic loss scaling through the pipeline (``parallelize(pp=..., loss_scaler=...)`` and
``shardkit.initialize`` with ``fp16`` + ``pipeline``).

References are single-process plain torch loops on the global batch: ``(loss * S).backward()``,
the gradients checked for inf/nan and divided by ``S`` by hand, ``clip_grad_norm_``, the
optimizer, and a :class:`DynamicLossScaler` driven by hand with the overflow each step had (the
scaler's rule itself is checked against DeepSpeed in test_loss_scaler_deepspeed.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks, lm_loss
from shardkit.parallel import DynamicLossScaler, parallelize
from parallelize_cases import B, CLIP, lm_batches, tiny_gpt
from distributed import forbid_collectives
from tolerances import FP32, LOWP_NO_MASTER

#: dynamic scaling from 2^8; hysteresis 2 and a window of 2 so that 6 steps see a kept scale,
#: a halving and a doubling
SCALER = dict(initial_scale_power=8, hysteresis=2, loss_scale_window=2)
OVERFLOW_AT = (1, 2)
#: the scale after each step under DeepSpeed's rule (docs/reference.md, "fp16 dynamic loss
#: scaling") with overflows at steps 1 and 2, written out: step 1 spends the hysteresis, step 2
#: halves; clean steps 3, 4 (1 and 2 clean steps before them since the overflow), step 5
#: doubles (2 clean steps before it, a multiple of the window)
SCALES = [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]


def _target(model):
    """A parameter of the first pipeline stage that is not tied to another stage: an inf in its
    gradient reaches no other rank through the pipeline (the first stage sends no gradient), so
    only the overflow agreement can make the other stages skip."""
    return model.blocks[0].attn.qkv.weight


def _reference() -> tuple[dict, list[float], list[float], list[bool], list[float]]:
    model = tiny_gpt(tie=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scaler = DynamicLossScaler(**SCALER)
    losses, norms, applied, scales = [], [], [], []
    for step, (x, y) in enumerate(lm_batches()):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        hook = _target(model).register_hook(lambda g: torch.full_like(g, float("inf"))) if step in OVERFLOW_AT else None
        (loss * scaler.scale).backward()
        if hook is not None:
            hook.remove()
        overflow = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        norm = float("inf")
        if not overflow:
            for p in model.parameters():
                p.grad.div_(scaler.scale)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
            opt.step()
        scaler.update(overflow)
        losses.append(float(loss.detach()))
        norms.append(norm)
        applied.append(not overflow)
        scales.append(scaler.scale)
    return torch.nn.Sequential(*gpt_blocks(model)).state_dict(), losses, norms, applied, scales


def train_parallelized(strategy: str, schedule: str) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    with ParallelContext.from_world(dp=world // 2, pp=2) as ctx:
        ref, ref_losses, ref_norms, ref_applied, ref_scales = _reference()
        assert ref_scales == SCALES and ref_applied == [s not in OVERFLOW_AT for s in range(len(SCALES))]
        model = tiny_gpt(tie=False)
        scaler = DynamicLossScaler(**SCALER)
        par = parallelize(
            model, ctx, dp=strategy, pp={"microbatches": 2, "schedule": schedule}, blocks=gpt_blocks, loss_scaler=scaler
        )
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
        dp, r = ctx.size("dp"), ctx.rank("dp")
        rows = slice(r * B // dp, (r + 1) * B // dp)
        injector = ctx.rank("pp") == 0 and r == 0  # ONE rank of the world, one micro-batch
        losses, norms, applied, scales = [], [], [], []
        for step, (x, y) in enumerate(lm_batches()):
            before = par.pipeline.full_state_dict()
            opt.zero_grad(set_to_none=True)
            hook, fired = None, []
            if step in OVERFLOW_AT and injector:

                def once(g: torch.Tensor) -> torch.Tensor:
                    fired.append(1)
                    return torch.full_like(g, float("inf")) if len(fired) == 1 else g

                hook = _target(model).register_hook(once)
            loss = par.forward_backward(x[rows], y[rows])
            if hook is not None:
                hook.remove()
                assert len(fired) == 2  # a hook per micro-batch: the inf went into the first only
            norms.append(float(par.clip(CLIP)))
            applied.append(par.step(opt))
            scales.append(scaler.scale)
            mean = loss.clone().reshape(1)
            dist.all_reduce(mean, group=ctx.group("dp"))
            losses.append(float(mean) / dp)
            after = par.pipeline.full_state_dict()
            unchanged = all(torch.equal(before[k], after[k]) for k in after)
            assert unchanged == (not applied[-1]), f"step {step}: unchanged={unchanged}, applied={applied[-1]}"
        assert applied == ref_applied, (applied, ref_applied)
        assert scales == ref_scales, (scales, ref_scales)
        assert par.report(opt).skipped_steps == len(OVERFLOW_AT) and par.report(opt).loss_scale == SCALES[-1]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        for step, (got, want) in enumerate(zip(norms, ref_norms, strict=True)):
            assert got == want == float("inf") or abs(got - want) <= 1e-4 * want, (step, got, want)
        full = par.pipeline.full_state_dict()
        for k, want in ref.items():
            torch.testing.assert_close(full[k], want, **FP32, msg=lambda m, k=k: f"{k}: {m}")
        par.close()
        return {"applied": applied, "scales": scales, "losses": losses}


@pytest.mark.parametrize(
    "strategy, schedule, world_size",
    [("ddp", "1f1b", 2), ("zero1", "1f1b", 4)],
    ids=["pp2-ddp", "dp2xpp2-zero1"],
)
def test_loss_scaled_pipeline_trains_like_one_process_and_skips_an_overflow_on_every_rank(
    dist_pool, strategy, schedule, world_size
):
    """(1) the same losses, norms and parameters as one process with the same scaler; (2) an inf
    in one micro-batch's gradient on ONE rank (first stage, dp rank 0) skips the step on every
    stage and dp rank, parameters untouched, the scale updated alike (halved at the second
    overflow, hysteresis 2, doubled after the window)."""
    out = dist_pool.run(train_parallelized, strategy, schedule, world_size=world_size, timeout=120)
    assert all(o == out[0] for o in out)


# ---- the engine: a seed-002-style fp16 config with a pipeline section ----------------------------
P_MICRO, P_GAS, P_IN, P_CLASSES, STEPS, LR = 4, 4, 8, 5, 5, 0.1
FP16 = {
    "enabled": "true",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 15,
    "hysteresis": 2,
    "min_loss_scale": 1,
}  # fmt: skip  (shardkit/examples/zero2_config_accelerate.json's fp16 section)


def _mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(P_IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, P_CLASSES)
    )  # fmt: skip


def _config(stage: int) -> dict:
    return {
        "fp16": dict(FP16),
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": P_MICRO,
        "gradient_accumulation_steps": P_GAS,
        "gradient_clipping": 0.5,
        # SGD, not Adam: Adam turns the rounding noise of near-zero fp16 gradients into lr-sized
        # steps (see test_engine_parallel)
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "pipeline": {"stages": 2, "schedule": "1f1b"},
    }


def _micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [
        (torch.randn(P_MICRO, P_IN, generator=g).half(), torch.randint(P_CLASSES, (P_MICRO,), generator=g)) for _ in range(P_GAS)
    ]


def _engine_reference() -> tuple[dict, list[float], list[float]]:
    """DeepSpeed's fp16 mode by hand: an fp16 model, fp32 masters stepped by torch's SGD,
    ``(loss * S).backward()`` per micro-batch with the loss divided over the accumulation, the
    micro-batches' fp16 gradients summed in fp32 and unscaled, clipped, a scaler driven by hand."""
    model = _mlp().half()
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    scaler = DynamicLossScaler(**{k: v for k, v in FP16.items() if k != "enabled"})
    losses, scales = [], []
    for step in range(STEPS):
        total, sums = 0.0, [torch.zeros_like(m) for m in masters]
        for x, y in _micro_batches(step):
            loss = F.cross_entropy(model(x).float(), y)
            (scaler.scale_loss(loss) / P_GAS).backward()
            total += float(loss.detach()) / P_GAS
            for acc, p in zip(sums, model.parameters(), strict=True):  # fp32 accumulation
                acc += p.grad.float()
            model.zero_grad(set_to_none=True)
        # the gradient is kept in the params' dtype, fp16 (as DeepSpeed's fp16 mode), unscaled in fp32
        grads = [acc.half().float() / scaler.scale for acc in sums]
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not overflow:
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
            torch.nn.utils.clip_grad_norm_(masters, 0.5)
            opt.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
        model.zero_grad(set_to_none=True)
        scaler.update(overflow)
        losses.append(total)
        scales.append(scaler.scale)
    return {k: v.float() for k, v in model.state_dict().items()}, losses, scales


def _engine_body(stage: int) -> dict:
    import shardkit

    with ParallelContext.from_world(pp=2) as ctx:
        engine, *_ = shardkit.initialize(model=_mlp(), config=_config(stage), ctx=ctx)
        assert engine.fp16_enabled() and all(p.dtype == torch.float16 for p in engine.module.parameters())
        losses, scales = [], []
        for step in range(STEPS):
            losses.append(float(engine.train_batch(iter(_micro_batches(step)))))
            scales.append(engine.get_loss_scale())
        ref, ref_losses, ref_scales = _engine_reference()
        assert scales == ref_scales and engine.skipped_steps == 0, (scales, ref_scales, engine.skipped_steps)
        # The pipeline sums its micro-batches' fp16 gradients in fp32 and rounds once; the
        # reference accumulates them in fp16 (autograd into p.grad): the gradients differ by
        # fp16 roundings, the fp32 masters by far less than an fp16 ulp, and an fp16 param may
        # round to the neighbouring value: one worst-case fp16 ulp (LOWP_NO_MASTER's bound).
        tol = LOWP_NO_MASTER[torch.float16]
        full = engine.full_state_dict()
        assert sorted(full) == sorted(ref)
        for k, want in ref.items():
            torch.testing.assert_close(full[k].float(), want, **tol, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
        engine.close()
        return {"losses": losses, "scales": scales}


@pytest.mark.parametrize("stage", [0, 2], ids=["stage0", "zero2"])
def test_engine_fp16_pipeline_config_trains_like_one_process(dist_pool, stage):
    out = dist_pool.run(_engine_body, stage, world_size=2, timeout=120)
    assert out[0] == out[1]


def _refusals_body() -> None:
    import shardkit

    with ParallelContext.from_world(pp=2) as ctx:
        cases = [
            (_config(3), "zero_optimization.stage"),  # ZeRO-3 with a pipeline stays refused, fp16 or not
        ]
        for config, key in cases:
            stack = forbid_collectives()
            try:
                with pytest.raises(ValueError, match=key.replace(".", r"\.")):
                    shardkit.initialize(model=_mlp(), config=copy.deepcopy(config), ctx=ctx)
            finally:
                stack.stop()
        # parallelize: fp16 autocast inside the stages is not applied; zero3 with pp refused
        stack = forbid_collectives()
        try:
            with pytest.raises(ValueError, match="autocast"):
                parallelize(tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, loss_scaler=DynamicLossScaler(),
                            autocast=lambda: torch.autocast("cpu", dtype=torch.float16))  # fmt: skip
            with pytest.raises(ValueError, match="zero3"):
                parallelize(
                    tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, dp="zero3", loss_scaler=DynamicLossScaler()
                )
            with pytest.raises(TypeError, match="loss_scaler"):
                parallelize(tiny_gpt(), ctx, pp={"microbatches": 2}, blocks=gpt_blocks, loss_scaler=2.0**16)
        finally:
            stack.stop()


def test_what_stays_unsupported_raises_before_any_collective(dist_pool):
    dist_pool.run(_refusals_body, world_size=2, timeout=60)
