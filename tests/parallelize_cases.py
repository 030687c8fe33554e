"""The TinyGPT, batches, dense reference and distributed training body shared by the parallelize() tests (dp x tp x pp)."""

from __future__ import annotations

import torch
from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, gpt_blocks, lm_loss
from shardkit.parallel import parallelize
from shardkit.parallel.tensor import gpt_plan, shard_state_dict
from tolerances import FP32


VOCAB, B, T, STEPS, CLIP = 59, 8, 16, 6, 0.3


def tiny_gpt(tie: bool = True) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=32, n_layers=4, n_heads=4, seq_len=T, tie_embeddings=tie)


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(VOCAB, (B, T), generator=gen), torch.randint(VOCAB, (B, T), generator=gen)) for _ in range(STEPS)]


def dense_run(
    tie: bool, batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> tuple[TinyGPT, list[float], list[float]]:
    """The reference: one process, the whole batch, torch's clip, SGD with momentum (Adam would turn
    rounding noise in near-zero gradients into ±lr steps and hide real differences in a loose bound).
    ``batches``: other ``(x, y)`` batches than :func:`lm_batches`' (e.g. padded targets)."""
    model = tiny_gpt(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    losses, norms = [], []
    for x, y in lm_batches() if batches is None else batches:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses, norms


def _dense_slice_eval(dense: TinyGPT, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(lm_loss(dense(x), y))


def train_parallelized(
    tp: int,
    pp: int,
    tie: bool,
    schedule: str,
    checkpointing: bool | str = False,
    strategy: str = "ddp",
    sp: bool = False,
    fused: bool = False,
) -> list[float]:
    import torch.distributed as dist

    world = dist.get_world_size()
    with ParallelContext.from_world(dp=world // (tp * pp), tp=tp, pp=pp) as ctx:
        dense, ref_losses, ref_norms = dense_run(tie)
        plan = gpt_plan(tie_embeddings=tie, sequence_parallel=sp)
        kwargs = {"tp_plan": plan} if tp > 1 else {}
        if pp > 1 or checkpointing:
            kwargs.update(blocks=gpt_blocks, checkpointing=checkpointing)
        if pp > 1:
            kwargs.update(pp={"microbatches": 2, "schedule": schedule})
        if fused:  # the loss from the head's input, chunk by chunk; the reference stays unfused
            kwargs.update(fused_cross_entropy=True)
        par = parallelize(tiny_gpt(tie), ctx, dp=strategy, **kwargs)
        if fused:  # small chunks: every micro-batch is several
            par.fused_heads[0].chunk_tokens = 24
        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
        dp, r = ctx.size("dp"), ctx.rank("dp")
        rows = slice(r * B // dp, (r + 1) * B // dp)
        losses = []
        for step, (x, y) in enumerate(lm_batches()):
            opt.zero_grad(set_to_none=True)
            loss = par.forward_backward(x[rows], y[rows])
            norm = par.clip(CLIP)
            par.step(opt)
            # the loss of this dp slice; its dp average is the global batch's mean
            mean = loss.clone().reshape(1)
            if dp > 1:
                dist.all_reduce(mean, group=ctx.group("dp"))
                mean /= dp
            losses.append(float(mean))
            assert abs(float(norm) - ref_norms[step]) <= 1e-4 * ref_norms[step], (step, float(norm), ref_norms[step])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        # evaluation (no grad, eval mode) equals the dense model's on a held-out batch
        gen = torch.Generator().manual_seed(99)
        xv, yv = torch.randint(VOCAB, (B, T), generator=gen), torch.randint(VOCAB, (B, T), generator=gen)
        assert abs(par.evaluate(xv[rows], yv[rows]) - _dense_slice_eval(dense, xv[rows], yv[rows])) < 1e-5
        if pp == 1:  # every parameter, sharded as the plan shards it
            want = shard_state_dict(dense.state_dict(), plan, ctx) if tp > 1 else dense.state_dict()
            module = getattr(par.module, "module", par.module)
            state = par.module.full_state_dict() if strategy.startswith("zero") else module.state_dict()
            for key, value in state.items():
                torch.testing.assert_close(value, want[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
        return losses
