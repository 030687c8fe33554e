"""ZeRO offload: the device-to-host gradient copies overlap backward, the epilogue runs on the host.

[Note: gradient copies overlapped with backward] in parallel/zero/offload.py. Each test trains
the same model with ``offload=None`` (the device epilogue, itself checked against one process in
tests/zero/test_zero12_trains_like_one_process.py) and with offload, on the same 2 gloo ranks, and requires:

* the order of events: bucket k's host copy is issued after its reduce-scatter and before the
  LAST bucket's reduce-scatter is launched (≥ 3 buckets), every copy before backward returns;
* results bitwise those of ``offload=None`` over 5 steps, each of 2 micro-batches (``no_sync``
  accumulation) and a clip by the global norm that is active: the returned norm is bitwise the
  device path's (fp32 also within FP32 of one process), fp32 / bf16 params / bf16 gradients,
  stages 1-3, ``"cpu"`` and ``"nvme"``, a backward that raised in between, tp-replicated params;
* fp16: an inf on one rank skips the step on every rank and halves the scale;
* the host epilogue's memory: no device fp32 gradient copy (bf16 grads), the bf16 staging on
  the host, as ``plan_memory`` plans them.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DynamicLossScaler
from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer, flat_shards, plan_memory
from shardkit.parallel.zero.offload import HostGradients
from tolerances import FP32

GLOBAL_BATCH, MICRO = 8, 2  # 4 rows per rank, 2 micro-batches of 2 rows
WIDTHS = (16, 40, 40, 40, 16)  # 4 Linear layers; with BUCKET_MB every layer is a bucket (or more)
BUCKET_MB = 0.004
MAX_NORM = 0.05  # below the gradient norm of every step: the clip scales


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(GLOBAL_BATCH, WIDTHS[0], generator=g), torch.randn(GLOBAL_BATCH, WIDTHS[-1], generator=g)


def _micro_batches(ctx: ParallelContext, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _batch(step)
    per = GLOBAL_BATCH // ctx.size("dp")
    rows = range(ctx.rank("dp") * per, (ctx.rank("dp") + 1) * per, per // MICRO)
    return [(x[r : r + per // MICRO], y[r : r + per // MICRO]) for r in rows]


def _build(ctx, stage, offload, dtype, grad_dtype=None, nvme_dir=None, scaler=None):
    sdp = ShardedDataParallel(
        _model(dtype),
        ctx,
        stage,
        bucket_mb=BUCKET_MB,
        offload=offload,
        nvme_dir=nvme_dir if offload == "nvme" else None,
        grad_dtype=grad_dtype,
        loss_scaler=scaler,
    )
    return sdp, ZeroOptimizer(sdp, FusedAdamW, lr=1e-2, weight_decay=0.1)


def _backward(sdp, ctx, step, dtype, scaler=None) -> None:
    """One optimizer step's gradients: MICRO micro-batches, the earlier ones under no_sync; each
    loss scaled by 1/MICRO so the sum is the gradient of the full batch's mean loss."""
    batches = _micro_batches(ctx, step)
    for m, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(sdp(x.to(dtype)).float(), y) / MICRO
        if scaler is not None:
            loss = scaler.scale_loss(loss)
        if m < MICRO - 1:
            with sdp.no_sync():
                loss.backward()
        else:
            loss.backward()


# ---- the order of events ------------------------------------------------------------------------
def _order(stage: int) -> list[tuple[str, int]]:
    ctx = ParallelContext.from_world()
    sdp, opt = _build(ctx, stage, "cpu", torch.float32)
    n = len(sdp.sharded_buckets)
    assert n >= 3, n
    events: list[tuple[str, int]] = []
    real_rs, real_issue = flat_shards.reduce_scatter, HostGradients.issue
    launched = [0]

    def reduce_scatter(*args, **kwargs):  # buckets launch in index order (the reducer's Note)
        events.append(("reduce-scatter", launched[0] % n))
        launched[0] += 1
        return real_rs(*args, **kwargs)

    def issue(self, i, src):
        events.append(("copy", i))
        return real_issue(self, i, src)

    with mock.patch.object(flat_shards, "reduce_scatter", reduce_scatter), mock.patch.object(HostGradients, "issue", issue):
        for step in range(2):
            events.clear()
            opt.zero_grad()
            x, y = _micro_batches(ctx, step)[0]
            nn.functional.mse_loss(sdp(x), y).backward()
            events.append(("backward returned", -1))
            seen = list(events)
            opt.step()  # the epilogue issues no copy of its own: every bucket was copied
            assert events == seen, events[len(seen) :]
            last_rs = seen.index(("reduce-scatter", n - 1))
            for k in range(n):
                copy = seen.index(("copy", k))
                assert seen.index(("reduce-scatter", k)) < copy < seen.index(("backward returned", -1)), (k, seen)
                if k < n - 1:  # issued while backward still runs, before the last bucket is launched
                    assert copy < last_rs, (k, seen)
                assert seen.count(("copy", k)) == 1, seen
    ctx.destroy()
    return events


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_copies_are_issued_during_backward(dist_pool, stage) -> None:
    dist_pool.run(_order, stage, world_size=2, timeout=60)


# ---- bitwise equal to the device epilogue ---------------------------------------------------------
def _equal(stage: int, offload: str, dtype: torch.dtype, grad_dtype: torch.dtype | None, nvme_dir: str, tp: int = 1) -> None:
    """``tp`` 2: every param is tp-replicated (plain layers), so the host epilogue's Σg² takes
    the replicated pieces' squares at weight 1/tp before the all-reduce over tp."""
    ctx = ParallelContext.from_world(dp=2, tp=tp)
    base, base_opt = _build(ctx, stage, None, dtype, grad_dtype)
    sdp, opt = _build(ctx, stage, offload, dtype, grad_dtype, nvme_dir)
    assert len(sdp.sharded_buckets) >= 3
    ref = _model().float()
    for step in range(5):
        norms = []
        for s, o in ((base, base_opt), (sdp, opt)):
            o.zero_grad()
            if step == 2:  # a backward that raised mid-way (same point on every rank), then the step's
                hook = s.module[2].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
                x, y = _micro_batches(ctx, step)[0]
                with pytest.raises(RuntimeError, match="boom"):
                    nn.functional.mse_loss(s(x.to(dtype)).float(), y).backward()
                hook.remove()
                o.zero_grad()
            _backward(s, ctx, step, dtype)
            norms.append(s.clip_grad_norm_(MAX_NORM))
            o.step()
        assert torch.equal(norms[0], norms[1]), f"step {step}: norm {norms[1]} vs device epilogue {norms[0]}"
        assert norms[0] > MAX_NORM, "the clip must scale for the comparison to mean something"
        if step == 0 and dtype == torch.float32 and grad_dtype is None:  # one process, full batch
            x, y = _batch(0)
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            expect = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
            torch.testing.assert_close(norms[1], expect, **FP32)
        full, base_full = sdp.full_state_dict(), base.full_state_dict()
        for name, t in base_full.items():
            assert torch.equal(full[name], t), f"{name} differs from offload=None at step {step}"
    ctx.destroy()


CASES = [
    (1, "cpu", torch.float32, None),
    (2, "cpu", torch.float32, None),
    (3, "cpu", torch.float32, None),
    (1, "cpu", torch.bfloat16, None),
    (2, "cpu", torch.bfloat16, torch.bfloat16),
    (3, "cpu", torch.bfloat16, torch.bfloat16),
    (2, "nvme", torch.bfloat16, torch.bfloat16),
    (3, "nvme", torch.float32, None),
]


@pytest.mark.parametrize(
    "stage,offload,dtype,grad_dtype", CASES, ids=[f"zero{c[0]}-{c[1]}-{str(c[2])[6:]}-grad-{c[3] or 'fp32'}" for c in CASES]
)
def test_bitwise_equal_to_device_epilogue(dist_pool, tmp_path, stage, offload, dtype, grad_dtype) -> None:
    dist_pool.run(_equal, stage, offload, dtype, grad_dtype, str(tmp_path), world_size=2, timeout=90)


def test_bitwise_equal_with_tp_replicated_params(dist_pool, tmp_path) -> None:
    dist_pool.run(_equal, 2, "cpu", torch.float32, None, str(tmp_path), tp=2, world_size=4, timeout=90)


# ---- fp16 overflow on one rank --------------------------------------------------------------------
def _overflow(stage: int) -> None:
    ctx = ParallelContext.from_world()
    runs = []
    for offload in (None, "cpu"):
        scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
        runs.append((*_build(ctx, stage, offload, torch.float16, scaler=scaler), scaler))
    before = [p.clone() for p in runs[1][0].full_state_dict().values()]
    for step in range(3):
        for s, o, sc in runs:
            o.zero_grad()
            if step == 0 and ctx.rank("dp") == 1:  # only rank 1's gradient overflows
                hook = s.module[0].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            _backward(s, ctx, step, torch.float16, sc)
            if step == 0 and ctx.rank("dp") == 1:
                hook.remove()
            o.step()
            assert o.last_step_skipped == (step == 0), "every rank skips the step, and only that one"
            assert sc.scale == 2.0**7
        if step == 0:
            assert all(torch.equal(p, q) for p, q in zip(runs[1][0].full_state_dict().values(), before))
        for (name, t), u in zip(runs[0][0].full_state_dict().items(), runs[1][0].full_state_dict().values()):
            assert torch.equal(t, u), f"{name} differs from offload=None at step {step}"
    ctx.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_every_rank(dist_pool, stage) -> None:
    dist_pool.run(_overflow, stage, world_size=2, timeout=60)


# ---- memory -------------------------------------------------------------------------------------
def _memory(stage: int) -> list[dict]:
    ctx = ParallelContext.from_world()
    reports = []
    for offload in (None, "cpu"):
        sdp, opt = _build(ctx, stage, offload, torch.bfloat16, torch.bfloat16)
        opt.zero_grad()
        x, y = _micro_batches(ctx, 0)[0]  # one backward per step, as the planner plans
        nn.functional.mse_loss(sdp(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()
        reports.append(sdp.memory_report())
        shard = sum(sb.shard for sb in sdp.sharded_buckets)
    device, off = reports
    assert off["offloaded"]["cpu_buffers"] == (4 + 2) * shard  # fp32 buffer + the bf16 staging
    ctx.destroy()
    return reports


@pytest.mark.parametrize("stage", [2, 3])
def test_host_epilogue_memory_as_planned(dist_pool, stage) -> None:
    """bf16 grads: the device run holds an fp32 copy of every shard at the step, the offloaded one
    none; ``plan_memory`` plans both transients and the host bytes (within 5%, the issue's bound)."""
    reports = dist_pool.run(_memory, stage, world_size=2, timeout=60)
    with torch.device("meta"):
        meta = _model(torch.bfloat16)
    for offload, index in ((None, 0), ("cpu", 1)):
        plan = plan_memory(meta, dp=2, stage=stage, precision="bf16", offload=offload, bucket_mb=BUCKET_MB, grad_dtype_bytes=2)
        for rank, rep in enumerate(r[index] for r in reports):
            pairs = {"peak_transient": (rep["peak_transient"], plan.transient)}
            if offload:
                pairs["host"] = (rep["offloaded"]["cpu"] + rep["offloaded"]["cpu_buffers"], plan.cpu)
            bad = {k: v for k, v in pairs.items() if abs(v[1] - v[0]) > 0.05 * max(v[0], 1)}
            assert not bad, f"offload={offload}, rank {rank}: (measured, planned) outside 5%: {bad}"
    for device, off in reports:  # stage 3: the gathered units are the peak either way
        assert off["peak_transient"] < device["peak_transient"] or stage == 3, (off, device)
        assert off["peak_transient"] <= device["peak_transient"], (off, device)
