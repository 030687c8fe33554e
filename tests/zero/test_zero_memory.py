"""ZeRO-1/2 bytes and traffic per rank against the written-out formulas; precision; frozen and tied params.

Formulas: docs/reference.md, "ZeRO memory and communication". Ψ = parameter count; the test
model's tensors are multiples of 64 elements, so the flat buckets carry no padding and the
formulas hold to within the optimizer's scalar ``step`` tensors (well inside 2%).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer, paper_comm_bytes
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

D = 64


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).to(dtype)


def _one_step(sdp: nn.Module, opt, ctx: ParallelContext, dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(ctx.rank("dp"))
    x = torch.randn(4, D, generator=g).to(dtype)
    opt.zero_grad()
    sdp(x).float().square().mean().backward()
    opt.step()


# (stage, param dtype, grad dtype) -> bytes per rank as a function of (Ψ, N), Adam (m, v fp32)
FORMULAS = {
    (1, torch.float32, torch.float32): lambda P, N: 8 * P + 8 * P / N,
    (2, torch.float32, torch.float32): lambda P, N: 4 * P + 12 * P / N,
    (1, torch.bfloat16, torch.bfloat16): lambda P, N: 2 * P + 2 * P + 12 * P / N,  # K = 12: master, m, v
    (2, torch.bfloat16, torch.bfloat16): lambda P, N: 2 * P + (2 + 12) * P / N,
}


def _memory_matches_formula(stage: int, dtype: torch.dtype, grad_dtype: torch.dtype) -> dict:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(dtype), ctx, stage, bucket_mb=0.01, grad_dtype=grad_dtype)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-3)
    _one_step(sdp, opt, ctx, dtype)
    report = sdp.memory_report()
    psi = sum(p.numel() for p in sdp.module.parameters())
    expected = FORMULAS[(stage, dtype, grad_dtype)](psi, ctx.size("dp"))
    assert report["unit"] == "bytes"
    assert report["model_state"] == pytest.approx(expected, rel=0.02), (report, expected)
    # the categories themselves, not only their sum
    assert report["params"] == psi * dtype.itemsize
    full_grads = psi * grad_dtype.itemsize
    assert report["grads"] == (full_grads if stage == 1 else full_grads // ctx.size("dp"))
    assert report["peak_transient"] > 0
    ctx.destroy()
    return report


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp32_model_state_bytes_match_formula(dist_pool, world_size: int, stage: int) -> None:
    dist_pool.run(_memory_matches_formula, stage, torch.float32, torch.float32, world_size=world_size, timeout=60)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_mixed_precision_bytes_match_paper_formula(dist_pool, stage: int) -> None:
    """bf16 params and grads, fp32 master + Adam state: the paper's 2Ψ + 2Ψ + KΨ/N (K = 12)."""
    dist_pool.run(_memory_matches_formula, stage, torch.bfloat16, torch.bfloat16, world_size=4, timeout=60)


def _comm_per_step(stage: int) -> tuple[int, int]:
    ctx = ParallelContext.from_world()
    psi_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.01)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-3)
    sdp.comm_stats.reset()  # drop the wrap-time checks and broadcast
    _one_step(sdp, opt, ctx)
    summary = sdp.comm_stats.summary()
    # one reduce-scatter (payload Ψ) and one all-gather (payload Ψ) per bucket, and one fp32
    # flag per param: which params got a gradient on some rank ([Note: params without a gradient
    # are not stepped] in zero/flat_shards.py; folded into the norm all-reduce when clipping)
    assert set(summary) == {"reduce_scatter", "all_gather", "all_reduce"}, summary
    flags = summary.pop("all_reduce")
    assert (flags["calls"], flags["bytes"]) == (1, 4 * len(list(sdp.module.parameters()))), flags
    assert summary["reduce_scatter"]["calls"] == summary["all_gather"]["calls"] == len(sdp.sharded_buckets)
    assert summary["reduce_scatter"]["bytes"] == summary["all_gather"]["bytes"] == psi_bytes
    zero = paper_comm_bytes(summary)
    # DDP on the same model: CommStats records the all-reduce as Ψ, the paper counts it 2Ψ; its
    # buckets also carry one fp32 used flag per param (DataParallel's [Note: used flags ride in
    # the buckets]), as ZeRO's norm all-reduce does
    ddp = DataParallel(_model(), ctx, bucket_mb=0.01)
    ddp.comm_stats.reset()
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _one_step(ddp, ddp_opt, ctx)
    assert ddp.comm_stats.bytes() == psi_bytes + 4 * len(list(ddp.module.parameters()))
    ddp_paper = paper_comm_bytes(ddp.comm_stats.summary())
    ctx.destroy()
    return zero // psi_bytes, ddp_paper // psi_bytes


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_comm_per_step_is_two_psi_like_ddp(dist_pool, world_size: int, stage: int) -> None:
    """ZeRO paper units: stages 1-2 move 2Ψ per step, the same as DDP's all-reduce."""
    results = dist_pool.run(_comm_per_step, stage, world_size=world_size, timeout=60)
    assert results == [(2, 2)] * world_size


def _bf16_master_vs_fp32(stage: int) -> float:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(torch.bfloat16), ctx, stage, bucket_mb=0.01)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)
    sb = sdp.sharded_buckets[0]
    assert sb.master is not None and sb.master.dtype == torch.float32  # fp32 master by default
    assert sb.reduced_shard.dtype == torch.float32 or sb.grad_full.dtype == torch.float32  # fp32 reduction
    ref = _model(torch.bfloat16).float()  # the same (bf16-representable) initial weights, in fp32
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)
    rows = slice(ctx.rank("dp") * 8 // ctx.size("dp"), (ctx.rank("dp") + 1) * 8 // ctx.size("dp"))
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[rows].bfloat16()).float(), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    diffs = [(p.float() - q).abs() for p, q in zip(sdp.module.parameters(), ref.parameters())]
    worst = max(d.max().item() for d in diffs)
    mean = sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs)
    # bf16 forward/backward perturb each gradient by ~2^-8 relative; Adam's normalized update
    # amplifies that for tiny, sign-flipping gradients, up to lr (1e-2) per step, so single
    # elements drift by ~2e-2 in 10 steps whatever the optimizer precision (measured 2.1e-2, the
    # same without a master): the max bounds only gross errors. The mean absolute drift is what
    # the fp32 master buys: measured ~3e-4 with it, 6.7e-4 when Adam steps the bf16 params
    # directly (single process, same set-up), so 4.5e-4 fails a dropped master.
    assert worst < 3e-2, worst
    assert mean < 4.5e-4, mean
    ctx.destroy()
    return worst


@pytest.mark.reduction_order
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_params_fp32_master_tracks_fp32_training(dist_pool, stage: int) -> None:
    worst = dist_pool.run(_bf16_master_vs_fp32, stage, world_size=2, timeout=60)
    assert len(set(worst)) == 1  # replicas stay bitwise in sync


def _frozen_params(stage: int) -> None:
    ctx = ParallelContext.from_world()
    model = _model()
    model[0].requires_grad_(False)
    sdp = ShardedDataParallel(model, ctx, stage, bucket_mb=0.01)
    ref = _model()
    ref[0].requires_grad_(False)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, eps=ADAM_EPS_ACROSS_ORDERS)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=ADAM_EPS_ACROSS_ORDERS)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, D, generator=g)
        rows = slice(ctx.rank("dp") * 8 // ctx.size("dp"), (ctx.rank("dp") + 1) * 8 // ctx.size("dp"))
        opt.zero_grad()
        sdp(x[rows]).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
    for p, q in zip(sdp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **FP32)
    assert model[0].weight.grad is None and model[0].bias.grad is None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    report = sdp.memory_report()
    n = ctx.size("dp")
    assert report["grads"] == (4 * trainable if stage == 1 else 4 * trainable // n)
    assert report["params"] == 4 * (trainable + frozen)  # frozen params are model state too
    state_elems = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    assert state_elems == 2 * trainable // n  # m and v of this rank's shard of the trainable ones only
    ctx.destroy()


@pytest.mark.reduction_order
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_frozen_params_get_no_grad_or_optimizer_memory(dist_pool, stage: int) -> None:
    dist_pool.run(_frozen_params, stage, world_size=2, timeout=60)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, 32, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, used twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def _tied_weights(stage: int) -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_TiedLM(), ctx, stage, bucket_mb=0.004)
    ref = _TiedLM()
    assert sdp.module.head.weight is sdp.module.emb.weight
    held = sum(q is sdp.module.emb.weight for sb in sdp.sharded_buckets for q in sb.grad_bucket.params)
    assert held == 1  # held once
    assert sdp.memory_report()["params"] == 4 * sum(p.numel() for p in ref.parameters())  # parameters() dedups
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        idx, tgt = torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g)
        rows = slice(ctx.rank("dp") * 8 // ctx.size("dp"), (ctx.rank("dp") + 1) * 8 // ctx.size("dp"))
        opt.zero_grad()
        nn.functional.cross_entropy(sdp(idx[rows]).flatten(0, 1), tgt[rows].flatten()).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten()).backward()  # grads of both uses summed
        ref_opt.step()
        for p, q in zip(sdp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32)
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_tied_weights_held_once_with_summed_grads(dist_pool, stage: int) -> None:
    dist_pool.run(_tied_weights, stage, world_size=2, timeout=60)
