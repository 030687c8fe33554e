"""ZeRO-1/2 cases users hit: bad arguments, fp16 overflow, global-norm clipping, accumulation,
optimizer state round trip. Each body compares against a single-process reference or a
written-out expectation."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from distributed import forbid_collectives
from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW, FusedLAMB
from shardkit.parallel import DynamicLossScaler
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
from tolerances import FP32

D = 32
GLOBAL_BATCH = 8


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, D, generator=g)


def _rows(ctx: ParallelContext, parts: int = 1, part: int = 0) -> slice:
    per = GLOBAL_BATCH // ctx.size("dp")
    lo = ctx.rank("dp") * per + part * per // parts
    return slice(lo, lo + per // parts)


def _bad_arguments() -> None:
    ctx = ParallelContext.from_world()
    cases = [
        (dict(stage=4), ValueError, "stage"),
        (dict(stage=0), ValueError, "stage"),
        (dict(stage=True), ValueError, "stage"),
        (dict(stage=2, offload="gpu"), ValueError, "offload"),
        (dict(stage=2, offload="nvme"), ValueError, "nvme_dir"),
        (dict(stage=2, nvme_dir="/tmp/x"), ValueError, "nvme_dir"),
        (dict(stage=2, check_sync="yes"), ValueError, "check_sync"),
        (dict(stage=2, forward_prefetch=True), ValueError, "forward_prefetch"),  # stages 1-2 gather nothing
        (dict(stage=2, wrap={nn.Linear}), ValueError, "wrap"),
        (dict(stage=1, reshard_after_forward=False), ValueError, "reshard_after_forward"),
        (dict(stage=2, bucket_mb=0), ValueError, "bucket_mb"),
        (dict(stage=2, grad_dtype=torch.int32), ValueError, "grad_dtype"),
        (dict(stage=3, wrap="blocks"), TypeError, "wrap"),
        (dict(stage=3, wrap={nn.Linear, 3}), TypeError, "wrap"),
        (dict(stage=3, reshard_after_forward="yes"), TypeError, "reshard_after_forward"),
    ]
    # (an nvme_dir missing on this machine is agreed in the first collective instead, so a rank
    # whose node lacks it cannot strand the others: test_zero_offload / test_zero_user_state)
    patch = forbid_collectives()
    try:
        for kwargs, exc, word in cases:
            with pytest.raises(exc, match=word):
                ShardedDataParallel(_model(), ctx, **kwargs)
        with pytest.raises(TypeError, match="module"):
            ShardedDataParallel("not a module", ctx, 2)
    finally:
        patch.stop()
    sub = ParallelContext.from_world(dp=1, pp=ctx.world_size)  # a pipeline axis: not composable yet
    patch = forbid_collectives()
    try:
        with pytest.raises(ValueError, match="ctx"):
            ShardedDataParallel(_model(), sub, 2)
    finally:
        patch.stop()
    sdp = ShardedDataParallel(_model(), ctx, 2)  # collectives here are fine
    patch = forbid_collectives()
    try:
        with pytest.raises(ValueError, match="not a parameter"):
            ZeroOptimizer(sdp, FusedAdamW, [nn.Parameter(torch.zeros(3))], lr=1e-3)
        with pytest.raises(ValueError, match="names 'nope'"):
            ZeroOptimizer(sdp, FusedAdamW, [{"params": ["0.weight", "nope"]}], lr=1e-3)
        with pytest.raises(ValueError, match="more than one group"):
            ZeroOptimizer(sdp, FusedAdamW, [{"params": ["0.weight"]}, {"params": ["0.weight"]}], lr=1e-3)
        with pytest.raises(ValueError, match="optimizer_class FusedLAMB"):
            ZeroOptimizer(sdp, FusedLAMB, lr=1e-3)
        with pytest.raises(TypeError, match="optimizer_class"):
            ZeroOptimizer(sdp, "adam", lr=1e-3)
        ZeroOptimizer(sdp, FusedAdamW, [{"params": ["0.weight", "0.bias"]}, {"params": ["2.weight"]}], lr=1e-3)
    finally:
        patch.stop()
    sub.destroy()
    ctx.destroy()


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_bad_arguments_raise_before_any_collective(dist_pool, world_size: int) -> None:
    dist_pool.run(_bad_arguments, world_size=world_size, timeout=60)


def _fp16_overflow_on_one_rank(stage: int) -> tuple[bool, float]:
    ctx = ParallelContext.from_world()
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    sdp = ShardedDataParallel(_model(torch.float16), ctx, stage, loss_scaler=scaler)
    opt = ZeroOptimizer(sdp, FusedAdamW, lr=1e-2)
    before = [p.detach().clone() for p in sdp.module.parameters()]
    x, y = _batch(0)
    opt.zero_grad()
    bias = sdp.module[0].bias
    if ctx.rank("dp") == ctx.size("dp") - 1:
        # one element of this rank's gradient overflows: after the reduce-scatter only the rank
        # that owns that element sees it in its shard, so the others skip only if they agree
        hook = bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    loss = nn.functional.mse_loss(sdp(x[_rows(ctx)].half()).float(), y[_rows(ctx)])
    scaler.scale_loss(loss).backward()
    if ctx.rank("dp") == ctx.size("dp") - 1:
        hook.remove()
    norm = sdp.clip_grad_norm_(1.0)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1  # on EVERY rank
    assert torch.isinf(norm)
    for p, q in zip(sdp.module.parameters(), before):
        assert torch.equal(p, q)  # nothing stepped
    assert scaler.scale == 2.0**7  # halved once, everywhere
    opt.zero_grad()  # the next clean step steps on every rank
    scaler.scale_loss(nn.functional.mse_loss(sdp(x[_rows(ctx)].half()).float(), y[_rows(ctx)])).backward()
    opt.step()
    assert not opt.last_step_skipped
    assert any(not torch.equal(p, q) for p, q in zip(sdp.module.parameters(), before))
    ctx.destroy()
    return opt.last_step_skipped, scaler.scale


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp16_overflow_on_one_rank_skips_the_step_everywhere(dist_pool, stage: int) -> None:
    results = dist_pool.run(_fp16_overflow_on_one_rank, stage, world_size=2, timeout=60)
    assert len(set(results)) == 1


def _clip_by_global_norm(stage: int) -> float:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.002)
    ref = _model()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(4):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
        norm = sdp.clip_grad_norm_(0.05)  # small: every step clips
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        # the GLOBAL norm: this rank's shard alone has a smaller one
        torch.testing.assert_close(norm, ref_norm, **FP32)
        for p, q in zip(sdp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32)
    ctx.destroy()
    return float(norm)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clip_uses_the_global_norm(dist_pool, world_size: int, stage: int) -> None:
    norms = dist_pool.run(_clip_by_global_norm, stage, world_size=world_size, timeout=60)
    assert len(set(norms)) == 1


def _accumulation(stage: int) -> tuple[int, int]:
    """Two micro-batches per step (the first under no_sync) equal one step on the whole batch."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.002)
    ref = _model()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    calls = []
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        sdp.comm_stats.reset()
        with sdp.no_sync():
            nn.functional.mse_loss(sdp(x[_rows(ctx, 2, 0)]), y[_rows(ctx, 2, 0)]).div(2).backward()
        calls.append(sdp.comm_stats.calls("reduce_scatter"))
        nn.functional.mse_loss(sdp(x[_rows(ctx, 2, 1)]), y[_rows(ctx, 2, 1)]).div(2).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(sdp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32)
    ctx.destroy()
    return calls[-1], len(sdp.sharded_buckets)


def test_zero_no_sync_accumulation(dist_pool) -> None:
    """Stage 1 communicates nothing inside no_sync; stage 2 still reduce-scatters (documented)."""
    calls, buckets = dist_pool.run(_accumulation, 1, world_size=2, timeout=60)[0]
    assert calls == 0
    calls, buckets = dist_pool.run(_accumulation, 2, world_size=2, timeout=60)[0]
    assert calls == buckets


def _stage1_second_reducing_backward_raises() -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, 1)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    x, y = _batch(0)
    sdp(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        sdp(x).sum().backward()
    opt.zero_grad()
    sdp(x).sum().backward()  # forward discarded the failed reduction; this one works
    opt.step()
    with pytest.raises(RuntimeError, match="zero_grad"):
        sdp(x).sum().backward()  # backward after step without zero_grad
    ctx.destroy()


def test_zero_stage1_reduces_once_per_step(dist_pool) -> None:
    dist_pool.run(_stage1_second_reducing_backward_raises, world_size=2, timeout=60)


def _round_trip(stage: int, dtype: torch.dtype) -> None:
    ctx = ParallelContext.from_world()

    def build() -> tuple[ShardedDataParallel, ZeroOptimizer]:
        sdp = ShardedDataParallel(_model(dtype), ctx, stage, bucket_mb=0.002)
        return sdp, ZeroOptimizer(sdp, FusedAdamW, lr=1e-2, weight_decay=0.1)

    def train(sdp: ShardedDataParallel, opt: ZeroOptimizer, steps: range) -> None:
        for step in steps:
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(sdp(x[_rows(ctx)].to(dtype)).float(), y[_rows(ctx)]).backward()
            opt.step()

    sdp, opt = build()
    train(sdp, opt, range(3))
    model_state = sdp.full_state_dict()
    opt_state = copy.deepcopy(opt.state_dict())
    assert set(model_state) == set(_model().state_dict())  # the unwrapped module's keys
    only0 = sdp.full_state_dict(rank0_only=True)
    assert (only0 == {}) if ctx.rank("dp") else all(torch.equal(only0[k], v) for k, v in model_state.items())
    train(sdp, opt, range(3, 7))
    sdp2, opt2 = build()
    sdp2.load_full_state_dict(model_state)
    opt2.load_state_dict(opt_state)
    train(sdp2, opt2, range(3, 7))
    for p, q in zip(sdp.module.parameters(), sdp2.module.parameters()):
        assert torch.equal(p, q)  # continues identically
    bad = copy.deepcopy(opt_state)
    bad["zero"]["dp_size"] = 99
    with pytest.raises(ValueError, match="dp_size"):
        opt2.load_state_dict(bad)
    ctx.destroy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_optimizer_state_dict_round_trip_continues_identically(dist_pool, stage: int, dtype) -> None:
    dist_pool.run(_round_trip, stage, dtype, world_size=2, timeout=60)


def _backward_that_raised(stage: int) -> None:
    """Every rank's backward raises mid-way (some buckets already launched); the next forward
    discards that reduction and training continues exactly like one process that never saw it."""
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.002)
    assert len(sdp.sharded_buckets) > 2
    ref = _model()
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("deterministic failure in backward")

    for step in range(4):
        x, y = _batch(step)
        if step == 1:
            hook = sdp.module[0].weight.register_hook(fail)  # the first layer: late in backward
            opt.zero_grad()
            with pytest.raises(RuntimeError, match="deterministic failure"):
                nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
            hook.remove()
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        full = sdp.full_state_dict()  # stage 3 holds shards only
        for name, q in ref.named_parameters():
            torch.testing.assert_close(full[name], q.detach(), **FP32)
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_recovers_from_a_backward_that_raised(dist_pool, stage: int) -> None:
    dist_pool.run(_backward_that_raised, stage, world_size=2, timeout=60)


def _stage2_transient_memory_is_bounded(accumulate: bool) -> tuple[int, int]:
    """Stage 2 never holds a full gradient: at most two buckets are in flight during backward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(8)])
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(model, ctx, 2, bucket_mb=0.0045)  # one Linear (4.2 KB of fp32 grads) per bucket
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    n, biggest = ctx.size("dp"), max(sb.total for sb in sdp.sharded_buckets)
    full_grad_bytes = 4 * sum(sb.total for sb in sdp.sharded_buckets)
    x = torch.randn(4, D)
    opt.zero_grad()
    for _ in range(3 if accumulate else 1):
        with sdp.no_sync():  # stage 2: still reduces each backward, never accumulates a full copy
            sdp(x).square().mean().backward()
    opt.step()
    peak = sdp.memory_report()["peak_transient"]
    # 2 buckets in flight (the bucket + a reduce-scatter output of 1/N of it, when accumulating),
    # then the step's all-gather inputs (one shard per bucket, all issued together)
    bound = max(2 * 4 * biggest * (1 + 1 / n), 4 * sum(sb.shard for sb in sdp.sharded_buckets))
    assert len(sdp.sharded_buckets) == 8
    assert peak <= bound < full_grad_bytes, (peak, bound, full_grad_bytes)
    ctx.destroy()
    return peak, full_grad_bytes


@pytest.mark.parametrize("accumulate", [False, True])
def test_zero_stage2_transient_buffers_stay_below_a_full_gradient(dist_pool, accumulate: bool) -> None:
    dist_pool.run(_stage2_transient_memory_is_bounded, accumulate, world_size=2, timeout=60)


def _different_models() -> None:
    ctx = ParallelContext.from_world()
    model = _model() if ctx.rank("dp") == 0 else nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 2 * D))
    with pytest.raises(ValueError, match="ShardedDataParallel: the ranks of the dp group built different models"):
        ShardedDataParallel(model, ctx, 2)  # on EVERY rank, not a hang in a mismatched collective
    ctx.destroy()


def test_zero_ranks_that_built_different_models_fail_everywhere(dist_pool) -> None:
    dist_pool.run(_different_models, world_size=2, timeout=60)


class _SometimesUsed(nn.Module):
    """``a`` on every row; ``b`` only on rows whose first feature is positive, so a rank whose rows
    all miss it gives ``b`` no grad in that backward (its slot of the bucket must read as zeros)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = x[:, :1] > 0
        return self.a(x) + (self.b(x) * use if bool(use.any()) else 0.0)


def _partially_used(stage: int) -> int:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_SometimesUsed(), ctx, stage, bucket_mb=0.002)
    ref = _SometimesUsed()
    opt, ref_opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    missed = 0
    for step in range(4):
        x, y = _batch(step)
        per = GLOBAL_BATCH // ctx.size("dp")
        for r in range(ctx.size("dp")):  # the same global batch on every rank (and the reference)
            if (step + r) % 2:
                x[r * per : (r + 1) * per, 0] = -x[r * per : (r + 1) * per, 0].abs()
        rows = _rows(ctx)
        missed += int(not bool((x[rows, :1] > 0).any()))
        opt.zero_grad()
        nn.functional.mse_loss(sdp(x[rows]), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(sdp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **FP32)
    ctx.destroy()
    return missed


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_param_without_grad_on_one_rank_contributes_zeros(dist_pool, stage: int) -> None:
    # the ranks' rows are made to miss ``b`` on alternate steps: the case must really occur
    assert sum(dist_pool.run(_partially_used, stage, world_size=2, timeout=60)) > 0


def _clip_without_scaler_has_no_host_sync(stage: int) -> None:
    ctx = ParallelContext.from_world()
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.002)
    opt = ZeroOptimizer(sdp, torch.optim.SGD, lr=0.1)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
    # a GPU step would block the host here: clipping alone never needs a value on the host
    with mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("host sync in clip")):
        sdp.clip_grad_norm_(1.0)
    opt.step()
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clip_without_a_loss_scaler_reads_nothing_on_the_host(dist_pool, stage: int) -> None:
    dist_pool.run(_clip_without_scaler_has_no_host_sync, stage, world_size=2, timeout=60)


def _step_without_backward(stage: int) -> None:
    """``opt.step()`` after ``zero_grad()`` with no backward in between: no param has a gradient,
    so nothing is stepped, as torch.optim does ([Note: params without a gradient
    are not stepped] in ``zero/flat_shards.py``), and the global norm reads zero — the reduced
    shards still hold the last step's sums (they are zeroed lazily, in the epilogue, not in
    ``zero_grad``), which must not leak into it."""
    ctx = ParallelContext.from_world()
    torch.manual_seed(0)
    sdp = ShardedDataParallel(_model(), ctx, stage, bucket_mb=0.001)
    opt = ZeroOptimizer(sdp, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    x, y = _batch(0)
    nn.functional.mse_loss(sdp(x[_rows(ctx)]), y[_rows(ctx)]).backward()
    opt.step()
    before = {k: v.clone() for k, v in sdp.full_state_dict().items()}
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    opt.zero_grad()
    assert float(sdp.clip_grad_norm_(1.0)) == 0.0
    opt.step()
    for k, v in sdp.full_state_dict().items():
        assert torch.equal(v, before[k]), k
    for s, was in zip(opt.state.values(), state, strict=True):
        assert all(torch.equal(s[k], v) for k, v in was.items())
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_without_backward_has_zero_norm_and_steps_nothing(dist_pool, stage: int) -> None:
    dist_pool.run(_step_without_backward, stage, world_size=2, timeout=60)
