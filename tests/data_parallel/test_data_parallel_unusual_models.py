"""DataParallel edge cases vs single-process references: unused params in the default mode, a
failed backward, fp32 grads of bf16 params (``grad_dtype``), channels_last grads, dp = 1, ranks
that built different models, and errors that must name the parameter.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from data_parallel_cases import GLOBAL_BATCH, WithUnusedParam, batches, make_model, max_dev
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel import DataParallel

mse = nn.functional.mse_loss


def my_rows(ctx: ParallelContext) -> slice:
    per = GLOBAL_BATCH // ctx.size("dp")
    return slice(ctx.rank("dp") * per, (ctx.rank("dp") + 1) * per)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)


# ---- unused params without find_unused_parameters, and under no_sync ---------------------------
def _unused_with_no_sync() -> float:
    """No find_unused_parameters: ``extra`` (used on rank 0 only) is averaged with zeros from the
    other ranks; ``unused`` keeps grad=None (no rank used it). In a second round, ``unused`` gets a
    grad only in a no_sync micro-batch on rank 0: it counts as used at the next reduction (torch
    DDP's no_sync rule), so every rank gets rank 0's accumulated grad over the dp size."""
    ctx = ParallelContext.from_world()
    per = GLOBAL_BATCH // ctx.size("dp")
    mask = (torch.arange(GLOBAL_BATCH) < per).float()
    base = WithUnusedParam()
    model = DataParallel(base, ctx, bucket_mb=0.001)
    x, y = batches(0)
    rows = my_rows(ctx)
    mse(model(x[rows], mask[rows]), y[rows]).backward()
    ref = WithUnusedParam()
    mse(ref(x, mask), y).backward()
    used = [p.grad for n, p in base.named_parameters() if not n.startswith("unused")]
    want = [p.grad for n, p in ref.named_parameters() if not n.startswith("unused")]
    dev = max_dev(used, want)
    assert all(p.grad is None for p in base.unused.parameters()), [p.grad for p in base.unused.parameters()]
    # round 2: `unused` is touched by rank 0's no_sync micro-batch only
    z = torch.randn(per, 5, generator=torch.Generator().manual_seed(7))
    model.zero_grad()
    with model.no_sync():
        if ctx.rank("dp") == 0:
            (base.unused(z).sum() * 0.5).backward()
    mse(model(x[rows], mask[rows]), y[rows]).backward()
    ref.zero_grad()
    (ref.unused(z).sum() * 0.5 / ctx.size("dp")).backward()
    got = [p.grad for p in base.unused.parameters()]
    want = [p.grad for p in ref.unused.parameters()]
    assert all(g is not None for g in got)
    ctx.destroy()
    return max(dev, max_dev(got, want))


@pytest.mark.parametrize("world_size", [2, 4])
def test_unused_params_keep_none_and_no_sync_use_counts(dist_pool, world_size: int) -> None:
    assert max(dist_pool.run(_unused_with_no_sync, world_size=world_size, timeout=60)) < 1e-6


# ---- a backward that raises ----------------------------------------------------------------------
class _FailIf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fail: bool) -> torch.Tensor:  # noqa: D102
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        if ctx.fail:
            raise RuntimeError("boom in backward")
        return grad, None


class _Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailIf.apply(x, self.fail)


def _with_boom() -> tuple[nn.Module, _Boom]:
    """make_model(0) (same parameters, same order) with a layer whose backward can raise midway:
    the last layers' grads (and their buckets' all-reduces) are out before it raises."""
    m, boom = make_model(0), _Boom()
    return nn.Sequential(m[0], m[1], boom, m[2], m[3], m[4]), boom


def _failed_backward(as_view: bool) -> float:
    ctx = ParallelContext.from_world()
    rows = my_rows(ctx)
    net, boom = _with_boom()
    model = DataParallel(net, ctx, bucket_mb=0.001, gradient_as_bucket_view=as_view)
    ref = make_model(0)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    for step in range(4):
        x, y = batches(step)
        opt.zero_grad()
        boom.fail = step == 1  # on every rank, at the same point of backward
        loss = mse(model(x[rows]), y[rows])
        if boom.fail:
            with pytest.raises(RuntimeError, match="boom"):
                loss.backward()
            continue  # skip this step, as a training loop catching the error would
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
    dev = max_dev([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])
    ctx.destroy()
    return dev


@pytest.mark.reduction_order
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_failed_backward_does_not_wedge_the_reducer(dist_pool, as_view: bool) -> None:
    assert max(dist_pool.run(_failed_backward, as_view, world_size=2, timeout=60)) < 2e-5


# ---- fp32 grads for bf16 params (p.grad_dtype) ---------------------------------------------------
def _bf16_with_fp32_grads() -> nn.Module:
    m = make_model(0).to(torch.bfloat16)
    for p in m.parameters():
        p.grad_dtype = torch.float32  # autograd accumulates fp32 grads for these bf16 params
    return m


def _grad_dtype(as_view: bool) -> float:
    ctx = ParallelContext.from_world()
    world = ctx.size("dp")
    model = DataParallel(_bf16_with_fp32_grads(), ctx, bucket_mb=0.001, gradient_as_bucket_view=as_view)
    x, y = batches(0)
    mse(model(x[my_rows(ctx)].bfloat16()).float(), y[my_rows(ctx)]).backward()
    got = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in got), [g.dtype for g in got]
    ref = _bf16_with_fp32_grads()  # the average of every rank's local fp32 grads
    per = GLOBAL_BATCH // world
    want = [torch.zeros_like(g) for g in got]
    for r in range(world):
        ref.zero_grad()
        mse(ref(x[r * per : (r + 1) * per].bfloat16()).float(), y[r * per : (r + 1) * per]).backward()
        for w, p in zip(want, ref.parameters()):
            w += p.grad / world
    # the test can fail: the fp32 average is not representable in bf16 (a bf16 bucket rounds it)
    assert any(bool((w != w.bfloat16().float()).any()) for w in want)
    torch.testing.assert_close(got, want, **FP32)
    ctx.destroy()
    return max_dev(got, want)


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_fp32_grads_of_bf16_params_are_reduced_in_fp32(dist_pool, as_view: bool) -> None:
    dist_pool.run(_grad_dtype, as_view, world_size=2, timeout=60)


def _grad_dtype_changed_after_wrap() -> str:
    ctx = ParallelContext.from_world()
    model = DataParallel(make_model(0).to(torch.bfloat16), ctx, bucket_mb=0.001)
    model.module[2].weight.grad_dtype = torch.float32  # its bucket was built for bf16 grads
    x, y = batches(0)
    with pytest.raises(ValueError, match=r"2\.weight") as err:
        mse(model(x[my_rows(ctx)].bfloat16()).float(), y[my_rows(ctx)]).backward()
    ctx.destroy()
    return str(err.value)


def test_grad_of_unexpected_dtype_names_the_parameter(dist_pool) -> None:
    messages = dist_pool.run(_grad_dtype_changed_after_wrap, world_size=2, timeout=60)
    assert all("float32" in m and "bfloat16" in m for m in messages), messages


# ---- channels_last --------------------------------------------------------------------------------
def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))
    return model.to(memory_format=torch.channels_last)


def _conv_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=g)


def _channels_last(as_view: bool) -> dict:
    ctx = ParallelContext.from_world()
    rows = my_rows(ctx)
    model = DataParallel(_conv_model(), ctx, bucket_mb=0.001, gradient_as_bucket_view=as_view)
    ref = _conv_model()
    assert not model.module[0].weight.is_contiguous()  # the path under test: dense, not contiguous
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    for step in range(4):
        x, y = _conv_batches(step)
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=step % 2 == 0)  # fresh autograd grads, then accumulate into them
        mse(model(x[rows]), y[rows]).backward()
        layouts = [p.grad.stride() == p.stride() for p in model.parameters()]
        opt.step()
        mse(ref(x), y).backward()
        ref_opt.step()
    out = dict(
        dev=max_dev([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]),
        grads_keep_param_layout=all(layouts),
        grads_in_buckets=all(
            any(b.buffer.data_ptr() <= p.grad.data_ptr() < b.buffer.data_ptr() + b.nbytes for b in model.buckets)
            for p in model.parameters()
        ),
    )
    ctx.destroy()
    return out


@pytest.mark.reduction_order
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_channels_last_grads(dist_pool, as_view: bool) -> None:
    for r in dist_pool.run(_channels_last, as_view, world_size=2, timeout=60):
        assert r["dev"] < 2e-5, r
        assert r["grads_keep_param_layout"], r  # autograd's layout contract holds in both modes
        assert r["grads_in_buckets"] == as_view, r


# ---- dp = 1 ---------------------------------------------------------------------------------------
def _dp1() -> dict:
    ctx = ParallelContext.from_world(dp=1, tp=2)
    model = DataParallel(make_model(0), ctx, bucket_mb=0.001)
    ref = make_model(0)
    x, y = batches(0)
    no_copy = mock.patch.multiple(
        "shardkit.parallel.data_parallel",
        flatten_into=mock.DEFAULT,
        unflatten_from=mock.DEFAULT,
        all_reduce=mock.DEFAULT,
    )
    with no_copy as patched, mock.patch("torch.distributed.all_reduce") as dist_all_reduce:
        with model.no_sync():
            mse(model(x[:4]), y[:4]).backward()
        mse(model(x[4:]), y[4:]).backward()
    mse(ref(x[:4]), y[:4]).backward()
    mse(ref(x[4:]), y[4:]).backward()
    exact = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    calls = sum(m.call_count for m in patched.values()) + dist_all_reduce.call_count
    out = dict(exact=exact, calls=calls, buckets=len(model.buckets), bucket_bytes=model.bucket_bytes)
    ctx.destroy()
    return out


def test_dp1_takes_the_local_path(dist_pool) -> None:
    for r in dist_pool.run(_dp1, world_size=2, timeout=60):
        assert r == dict(exact=True, calls=0, buckets=0, bucket_bytes=[]), r


# ---- ranks that built different models ------------------------------------------------------------
def _different_models(case: str) -> str:
    ctx = ParallelContext.from_world()
    first = ctx.rank("dp") == 0
    if case == "shapes":  # same count and numel: before the check, broadcast silently succeeded
        module = nn.Linear(4, 6, bias=False) if first else nn.Linear(6, 4, bias=False)
    else:
        module = nn.Linear(4, 6) if first else nn.Linear(4, 6, bias=False)
    with pytest.raises(ValueError, match="different models") as err:
        DataParallel(module, ctx)
    ctx.destroy()
    return str(err.value)


@pytest.mark.parametrize("case", ["shapes", "count"])
def test_different_models_raise_on_every_rank(dist_pool, case: str) -> None:
    messages = dist_pool.run(_different_models, case, world_size=2, timeout=30)
    assert messages[0] == messages[1]
    assert ("number of parameters" in messages[0]) == (case == "count"), messages[0]
    assert "shapes" in messages[0], messages[0]


def _eager_copy_body() -> list[tuple[int, int]]:
    """At each bucket's all-reduce on the CPU (torch) path: (params already copied, params in bucket)."""
    import shardkit.parallel.data_parallel as dp_module

    with ParallelContext.from_world() as ctx:
        model = DataParallel(make_model(0), ctx, bucket_mb=0.001)
        seen: list[tuple[int, int]] = []
        real = dp_module.all_reduce

        def spy(tensor, *args, **kwargs):
            for b in model.buckets:
                if b.buffer.data_ptr() == tensor.data_ptr():
                    seen.append((len(b.copied), len(b.params)))
            return real(tensor, *args, **kwargs)

        with mock.patch.object(dp_module, "all_reduce", spy):
            x, y = batches(0)
            nn.functional.mse_loss(model(x), y).backward()
        assert len(seen) == len(model.buckets)
        return seen


def test_cpu_path_copies_each_grad_into_its_bucket_as_it_arrives(dist_pool) -> None:
    # [Note: eager vs batched grad copies]: on the torch path every grad is copied while cache-hot,
    # before its bucket launches; a bucket launched with uncopied grads packs them in a second pass.
    for seen in dist_pool.run(_eager_copy_body, world_size=2, timeout=60):
        assert seen and all(copied == n for copied, n in seen), seen
