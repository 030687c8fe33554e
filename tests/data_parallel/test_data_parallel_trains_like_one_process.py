"""DataParallel, distributed loss scaling and clipping vs single-process references.

Every distributed body rebuilds the unsharded reference itself (same seed, concatenated batch)
and returns the max deviation, so each rank checks its own replica.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel, DynamicLossScaler, clip_grad_norm_, unscale_grads_
from data_parallel_cases import GLOBAL_BATCH, WithUnusedParam, batches, make_model, max_dev

STEPS = 10


def make_opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "fused":
        return FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_params(kind: str, micro: int = 1) -> list[torch.Tensor]:
    model = make_model(0)
    opt = make_opt(kind, model.parameters())
    for step in range(STEPS):
        x, y = batches(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ---- bodies run on every rank -----------------------------------------------------------------
def _train_ddp(kind: str, backend: str, bucket_mb: float, as_view: bool = False, set_to_none: bool = True) -> dict:
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    # different init per rank: DataParallel must broadcast rank 0's parameters
    model = DataParallel(make_model(rank), ctx, bucket_mb=bucket_mb, backend=backend, gradient_as_bucket_view=as_view)
    opt = make_opt(kind, model.parameters())
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = batches(step)
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad(set_to_none=set_to_none)
        model.comm_stats.reset()
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    ref = reference_params(kind)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = dict(
        dev=max_dev([p.detach() for p in model.parameters()], ref),
        all_reduce_calls=model.comm_stats.calls("all_reduce"),
        all_reduce_bytes=model.comm_stats.bytes("all_reduce"),
        param_bytes=param_bytes,
        n_buckets=len(model.buckets),
        bucket_bytes=sum(model.bucket_bytes),
        grads_in_buckets=all(
            any(b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.nbytes for b in model.buckets)
            for p in model.parameters()
        ),
    )
    ctx.destroy()
    return out


def _train_no_sync(micro: int, as_view: bool = False) -> float:
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    model = DataParallel(make_model(0), ctx, bucket_mb=0.001, gradient_as_bucket_view=as_view)
    opt = make_opt("fused", model.parameters())
    per_rank = GLOBAL_BATCH // world
    per_micro = per_rank // micro
    for step in range(STEPS):
        x, y = batches(step)
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        for k in range(micro):
            chunk = slice(k * per_micro, (k + 1) * per_micro)
            loss = nn.functional.mse_loss(model(xs[chunk]), ys[chunk]) / micro
            if k < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    dev = max_dev([p.detach() for p in model.parameters()], reference_params("fused"))
    ctx.destroy()
    return dev


def _unused_param(as_view: bool, find_unused: bool) -> dict:
    """DataParallel vs single-process training, with or without find_unused_parameters (it changes
    nothing): ``unused`` (no rank uses it) keeps ``grad=None``, so AdamW's weight decay must not
    move it; ``extra`` is used by rank 0's rows only, so its grad is rank 0's grad averaged with
    zeros from the others."""
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    per = GLOBAL_BATCH // world
    mask = (torch.arange(GLOBAL_BATCH) < per).float()  # the rows that use `extra`: rank 0's
    rows = slice(rank * per, (rank + 1) * per)
    model = DataParallel(
        WithUnusedParam(), ctx, bucket_mb=0.001, gradient_as_bucket_view=as_view, find_unused_parameters=find_unused
    )
    ref = WithUnusedParam()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    unused_grads: list[torch.Tensor | None] = []
    local_extra_grads: list[int] = []  # backwards in which autograd produced a grad for extra here
    model.module.extra.weight.register_post_accumulate_grad_hook(lambda p: local_extra_grads.append(1))
    for step in range(STEPS):
        x, y = batches(step)
        opt.zero_grad()
        model.comm_stats.reset()
        nn.functional.mse_loss(model(x[rows], mask[rows]), y[rows]).backward()
        unused_grads += [p.grad for p in model.module.unused.parameters()]
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x, mask), y).backward()
        ref_opt.step()
    names = [n for n, _ in ref.named_parameters()]
    out = dict(
        names=names,
        devs=[(a - b).abs().max().item() for a, b in zip(model.module.parameters(), ref.parameters())],
        unused_grads_none=all(g is None for g in unused_grads),
        extra_used_here=len(local_extra_grads),
        extra_grad_is_set=model.module.extra.weight.grad is not None,
        all_reduce_calls=model.comm_stats.calls("all_reduce"),
        all_reduce_bytes=model.comm_stats.bytes("all_reduce"),
        n_buckets=len(model.buckets),
        bucket_bytes=sum(model.bucket_bytes),
        n_params=len(names),
        param_bytes=sum(p.numel() * 4 for p in ref.parameters()),
    )
    ctx.destroy()
    return out


def _one_rank_overflows() -> tuple[bool, list[str], float]:
    ctx = ParallelContext.from_world()
    model = make_model(0)
    x, y = batches(0)
    scaler = DynamicLossScaler(initial_scale_power=4)
    scaler.scale_loss(nn.functional.mse_loss(model(x), y)).backward()
    if ctx.rank("dp") == 1:
        model[2].weight.grad[3, 4] = float("inf")
    report = scaler.unscale_(list(model.named_parameters()), group=ctx.group("dp"), report_nonfinite=True)
    scaler.update(report.overflow)
    ctx.destroy()
    return report.overflow, report.nonfinite, scaler.scale


def _clip_sharded(backend: str) -> float:
    """Each rank holds half of the parameters' grads (as ZeRO would): the clip must use the
    norm over both halves."""
    ctx = ParallelContext.from_world()
    ref = make_model(0)
    x, y = batches(0)
    nn.functional.mse_loss(ref(x), y).backward()
    mine = [p for i, p in enumerate(ref.parameters()) if i % 2 == ctx.rank("dp")]
    expected = [p.grad.clone() for p in ref.parameters()]
    torch.nn.utils.clip_grad_norm_([_Holder(g) for g in expected], 0.1)
    clip_grad_norm_(mine, 0.1, norm_group=ctx.group("dp"), backend=backend)
    got = [p.grad for p in mine]
    want = [g for i, g in enumerate(expected) if i % 2 == ctx.rank("dp")]
    ctx.destroy()
    return max_dev(got, want)


def _fp16_fused_unscale(backend: str, as_view: bool) -> dict:
    """fp16 + DynamicLossScaler, world size 2: ``DataParallel(loss_scaler=)`` (unscale fused
    into the copy back) vs the unfused path (average in backward, then ``scaler.unscale_``) vs an
    exact single-process reference: each shard's scaled fp16 grads, summed in fp16 (what the
    all-reduce of two ranks computes), times 1/(2S) in fp32, rounded once to fp16."""
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    per = GLOBAL_BATCH // world
    x, y = batches(0)
    x, y = x.half(), y.half()

    def shard_grads(r: int, scale: float) -> list[torch.Tensor]:
        m = make_model(0).half()
        rows = slice(r * per, (r + 1) * per)
        (nn.functional.mse_loss(m(x[rows]), y[rows]) * scale).backward()
        return [p.grad for p in m.parameters()]

    def step(fused: bool, *, poison: bool = False, max_norm: float | None = None, touch: bool = False):
        scaler = DynamicLossScaler(initial_scale_power=10, hysteresis=1)
        model = DataParallel(
            make_model(0).half(),
            ctx,
            bucket_mb=0.001,
            backend=backend,
            gradient_as_bucket_view=as_view,
            loss_scaler=scaler if fused else None,
        )
        if poison and rank == 1:  # an inf in one rank's local grad, before DataParallel sees it
            model.module[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf")))
        rows = slice(rank * per, (rank + 1) * per)
        scaler.scale_loss(nn.functional.mse_loss(model(x[rows]), y[rows])).backward()
        after_backward = [p.grad.clone() for p in model.parameters()]
        if touch:
            model.module[0].bias.grad.mul_(2.0)
        report = scaler.unscale_(
            list(model.module.named_parameters()), group=ctx.group("dp"), max_norm=max_norm, report_nonfinite=True
        )
        scaler.update(report.overflow)
        return [p.grad.clone() for p in model.parameters()], after_backward, report, scaler.scale

    S = 1024.0
    shards = [shard_grads(r, S) for r in range(world)]
    expected = [((a + b).float() * (1.0 / (2 * S))).half() for a, b in zip(*shards)]
    want_norm = torch.stack([g.float().norm() for g in expected]).norm().item()
    fused, fused_bw, fused_rep, _ = step(True)
    unfused, unfused_bw, unfused_rep, _ = step(False)
    clipped, _, _, _ = step(True, max_norm=0.01)
    clipped_ref, _, _, _ = step(False, max_norm=0.01)
    bad_fused = step(True, poison=True)
    bad_unfused = step(False, poison=True)
    try:
        step(True, touch=True)
        touched_error = ""
    except RuntimeError as exc:
        touched_error = str(exc)
    out = dict(
        fused_exact=all(torch.equal(a, b) for a, b in zip(fused, expected)),
        fused_unscaled_in_backward=all(torch.equal(a, b) for a, b in zip(fused_bw, fused)),
        unfused_dev=max(
            ((a.float() - b.float()).abs() / (b.float().abs() + 1e-3)).max().item() for a, b in zip(unfused, expected)
        ),
        unfused_scaled_in_backward=max((a.float() / S - b.float()).abs().max().item() for a, b in zip(unfused_bw, unfused)),
        norms=(fused_rep.grad_norm, unfused_rep.grad_norm, want_norm),
        overflow=(fused_rep.overflow, unfused_rep.overflow),
        clip_dev=max((a.float() - b.float()).abs().max().item() for a, b in zip(clipped, clipped_ref)),
        clipped_norm=torch.stack([g.float().norm() for g in clipped]).norm().item(),
        poisoned=[(r.overflow, r.nonfinite, scale) for _, _, r, scale in (bad_fused, bad_unfused)],
        touched_error=touched_error,
    )
    ctx.destroy()
    return out


class _Holder(torch.Tensor):
    """A tensor whose ``.grad`` is the given gradient (for torch's clip on bare grads)."""

    @staticmethod
    def __new__(cls, grad: torch.Tensor):  # noqa: D102
        t = torch.Tensor._make_subclass(cls, torch.empty_like(grad))
        t.grad = grad
        return t


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["fused", "torch"])
def test_ddp_equals_single_process_big_batch(dist_pool, world_size: int, kind: str) -> None:
    results = dist_pool.run(_train_ddp, kind, "auto", 0.001, world_size=world_size, timeout=120)
    for r in results:
        assert r["dev"] < 2e-5, r  # fp32, 10 steps of AdamW: only summation-order rounding


def test_ddp_interpreted_triton_buckets(dist_pool) -> None:
    """The flatten/unflatten Triton kernels themselves (interpreter) inside DDP."""
    results = dist_pool.run(_train_ddp, "fused", "triton", 0.001, world_size=2, timeout=180)
    assert all(r["dev"] < 2e-5 for r in results), results


# All-reduces per step of make_model's plan, worked out by hand (not the object's own bucket
# count, which would accept any plan). fp32 grads, visited last to first: b2 12 B, w2 288,
# b1 96, w1 2304, b0 96, w0 1248 (4044 B in all).
#   0.001 MiB -> cap int(1048.576) = 1048 B (first cap the same): [b2 w2 b1] 396 (+w1 > cap),
#     [w1] 2304 alone (over the cap), [b0] 96 (+w0 = 1344 > cap), [w0] 1248 -> 4 all-reduces.
#   25 MiB -> first cap 1 MiB > 4044 B -> 1 all-reduce.
_EXPECTED_ALL_REDUCES = {0.001: 4, 25.0: 1}


@pytest.mark.parametrize("bucket_mb", [0.001, 25.0])
def test_comm_volume_is_one_all_reduce_of_every_grad(dist_pool, bucket_mb: float) -> None:
    results = dist_pool.run(_train_ddp, "fused", "auto", bucket_mb, world_size=2, timeout=120)
    for r in results:
        assert r["param_bytes"] == 4044  # the hand count above
        # Ψ payload per step + one 4-byte used flag per parameter (6), nothing else
        assert r["all_reduce_bytes"] == r["param_bytes"] + 6 * 4
        assert r["all_reduce_calls"] == _EXPECTED_ALL_REDUCES[bucket_mb]


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulation_equals_big_batch(dist_pool, world_size: int) -> None:
    devs = dist_pool.run(_train_no_sync, 2, world_size=world_size, timeout=120)
    assert max(devs) < 2e-5


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view(dist_pool, set_to_none: bool) -> None:
    results = dist_pool.run(_train_ddp, "fused", "auto", 0.001, True, set_to_none, world_size=2, timeout=120)
    for r in results:
        assert r["dev"] < 2e-5, r
        assert r["grads_in_buckets"]  # p.grad IS the bucket slot: no second copy of the grads
        # 16-element slot alignment: at most 15 padding elements (4 B each) per parameter, + 6 flags
        flags = 6 * 4
        assert r["param_bytes"] + flags <= r["all_reduce_bytes"] == r["bucket_bytes"] <= r["param_bytes"] + flags + 6 * 15 * 4


def test_gradient_as_bucket_view_no_sync(dist_pool) -> None:
    assert max(dist_pool.run(_train_no_sync, 2, True, world_size=2, timeout=120)) < 2e-5


# Hand-worked plan of WithUnusedParam at bucket_mb=0.001 (cap int(0.001 * 2**20) = 1048 B, first cap the
# same), grad bytes from last registered to first: unused.b 20, unused.w 100, extra.b 12, extra.w 156,
# net.4.b 12, net.4.w 288, net.2.b 96 -> 684; net.2.w 2304 would exceed -> close (7 params);
# net.2.w alone (2304 > cap); net.0.b 96 + net.0.w 1248 = 1344 > 1048 -> [net.0.b], [net.0.w].
_UNUSED_MODEL_BUCKETS = 4


@pytest.mark.parametrize(
    "world_size, as_view, find_unused", [(2, False, False), (4, True, False), (2, True, True), (4, False, True)]
)
def test_unused_params_match_single_process(dist_pool, world_size: int, as_view: bool, find_unused: bool) -> None:
    results = dist_pool.run(_unused_param, as_view, find_unused, world_size=world_size, timeout=120)
    for rank, r in enumerate(results):
        bad = {n: d for n, d in zip(r["names"], r["devs"]) if not d < 2e-5}
        assert not bad, (rank, bad)  # every param, the unused ones included (they must not move)
        assert r["unused_grads_none"], rank  # as torch DDP: no rank used them, grad stays None
        assert r["extra_used_here"] == (STEPS if rank == 0 else 0)  # partial use really is partial
        assert r["extra_grad_is_set"]  # ... yet every rank gets the averaged grad
        # no extra collective: the used flags (one fp32 element per parameter) ride in the buckets
        assert r["n_buckets"] == _UNUSED_MODEL_BUCKETS
        assert r["all_reduce_calls"] == _UNUSED_MODEL_BUCKETS
        assert r["all_reduce_bytes"] == r["bucket_bytes"]
        padding = 15 * 4 * r["n_params"] if as_view else 0  # 16-element slot alignment
        assert r["param_bytes"] + 4 * r["n_params"] <= r["bucket_bytes"] <= r["param_bytes"] + 4 * r["n_params"] + padding


def test_overflow_on_one_rank_is_agreed_by_all(dist_pool) -> None:
    results = dist_pool.run(_one_rank_overflows, world_size=2, timeout=60)
    assert [r[0] for r in results] == [True, True]  # both ranks skip
    assert results[0][1] == [] and results[1][1] == ["2.weight"]  # only rank 1 holds the inf
    assert results[0][2] == results[1][2] == 16.0  # hysteresis 2: first overflow keeps the scale


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_fp16_unscale_fused_into_copy_back(dist_pool, backend: str, as_view: bool) -> None:
    for rank, r in enumerate(dist_pool.run(_fp16_fused_unscale, backend, as_view, world_size=2, timeout=180)):
        assert r["fused_exact"], rank  # one rounding of sum/(dp*S): bitwise the reference
        assert r["fused_unscaled_in_backward"], rank  # unscale_ did not touch the grads again
        assert r["unfused_dev"] < 1e-3, (rank, r["unfused_dev"])  # two roundings: within an ulp
        assert r["unfused_scaled_in_backward"] < 1e-2, rank  # the unfused path does unscale in unscale_
        fused_norm, unfused_norm, want = r["norms"]
        assert fused_norm == pytest.approx(want, rel=1e-5) and unfused_norm == pytest.approx(want, rel=1e-3)
        assert r["overflow"] == (False, False)
        assert r["clipped_norm"] == pytest.approx(0.01, rel=2e-3) and r["clip_dev"] < 1e-5, rank
        # an inf on rank 1 only: after the all-reduce both ranks hold it; same decision and scale
        assert r["poisoned"][0] == r["poisoned"][1] == (True, ["2.weight"], 512.0), (rank, r["poisoned"])
        assert "changed after DataParallel" in r["touched_error"], rank


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_clip_across_sharded_grads(dist_pool, backend: str) -> None:
    assert max(dist_pool.run(_clip_sharded, backend, world_size=2, timeout=60)) < 1e-6


# ---- single process -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unscale_grads_single_process(backend: str) -> None:
    model = make_model(0)
    x, y = batches(0)
    (nn.functional.mse_loss(model(x), y) * 512.0).backward()
    expected = [p.grad / 512.0 for p in model.parameters()]
    report = unscale_grads_(list(model.named_parameters()), inv_scale=1 / 512.0, backend=backend)
    assert not report.overflow
    torch.testing.assert_close([p.grad for p in model.parameters()], expected)
    assert report.grad_norm == pytest.approx(torch.stack([g.norm() for g in expected]).norm().item(), rel=1e-5)
    model[0].bias.grad[1] = float("nan")
    report = unscale_grads_(list(model.named_parameters()), report_nonfinite=True, backend=backend)
    assert report.overflow and report.nonfinite == ["0.bias"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_clip_grad_norm_matches_torch(backend: str) -> None:
    a, b = make_model(0), make_model(0)
    x, y = batches(0)
    for m in (a, b):
        nn.functional.mse_loss(m(x), y).backward()
    total = clip_grad_norm_(a.parameters(), 0.05, backend=backend)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    torch.testing.assert_close(total, want)
    torch.testing.assert_close([p.grad for p in a.parameters()], [p.grad for p in b.parameters()])


def test_bad_arguments_raise_before_any_collective() -> None:
    with pytest.raises(TypeError, match="module"):
        DataParallel("not a module", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ctx"):
        DataParallel(make_model(0), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(make_model(0).parameters(), 0.0)
