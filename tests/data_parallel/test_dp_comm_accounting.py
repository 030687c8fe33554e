"""Communication accounting of DataParallel and CommStats, against hand-computed expectations.

* ``no_sync`` issues *no* collective: zero calls and bytes in ``CommStats`` and zero calls of any
  ``torch.distributed`` collective (patched), and the grads accumulated under it then reduce to
  the single-process gradient of the whole global batch.
* The all-reduces per step are the buckets of a plan worked out by hand from the parameter sizes
  (not ``len(model.buckets)``, which would accept any plan), with each bucket's bytes.
* ``CommStats.summary()`` totals over an op recorded on several groups.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, group_label
from shardkit.parallel import DataParallel
from tolerances import FP32

GLOBAL_BATCH = 8

# torch.distributed entry points a collective could go through (those this torch has)
_DIST_OPS = (
    "all_reduce",
    "broadcast",
    "reduce_scatter_single",
    "all_gather_single",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter",
    "reduce",
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "barrier",
    "all_to_all_single",
    "all_reduce_coalesced",
)


@contextlib.contextmanager
def _count_dist_calls():
    """Count every call of a ``torch.distributed`` collective inside the block (calls still run)."""
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name in _DIST_OPS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue

            def wrapper(*a, _fn=fn, _name=name, **k):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*a, **k)

            stack.enter_context(mock.patch.object(dist, name, wrapper))
        yield counts


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


# Hand-worked plan of _small_model with a 2048-byte cap (first cap = min(1 MiB, cap) = 2048),
# fp32 grads, params visited last to first:
#   b2 12 B, w2 288 (300), b1 96 (396); w1 2304 would make 2700 > 2048 -> close [b2, w2, b1]
#   w1 2304 alone (larger than the cap); b0 96 -> 2400 > 2048 -> close [w1]
#   b0 96, w0 1248 (1344) -> [b0, w0]
# Each bucket's buffer then ends with one fp32 used flag per param (DataParallel's [Note: used flags
# ride in the buckets]): + 3, 1 and 2 flags of 4 B.
SMALL_CAP_MB = 2048 / 2**20
SMALL_BUCKET_BYTES = [396 + 12, 2304 + 4, 1344 + 8]
# Same plan with gradient_as_bucket_view: each slot starts at a multiple of 16 elements, and the
# all-reduce carries the padding: [b2 3 el @0, w2 72 @16, b1 24 @96] = 120 el; [w1 576];
# [b0 24 @0, w0 312 @32] = 344 el.
SMALL_BUCKET_BYTES_AS_VIEW = [480 + 12, 2304 + 4, 1376 + 8]


class _Big(nn.Module):
    """Params big enough for DataParallel's 1 MiB first-bucket cap to matter at 25 MiB buckets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(256, 512)  # w 512 KiB, b 2 KiB
        self.b = nn.Linear(512, 512)  # w 1 MiB, b 2 KiB
        self.c = nn.Linear(512, 4)  # w 8 KiB, b 16 B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


# Hand-worked plan of _Big at bucket_mb=25: first cap 1 MiB = 1048576 B.
#   c.b 16, c.w 8192 (8208), b.b 2048 (10256); b.w 1048576 -> 1058832 > 1 MiB -> close
#   then the 25 MiB cap: b.w, a.b, a.w = 1048576 + 2048 + 524288 = 1574912 -> one bucket
#   + the flags: 3 params in each bucket, 4 B each
BIG_BUCKET_BYTES = [10256 + 12, 1574912 + 12]


def _data(step: int, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, n_in, generator=g), torch.randn(GLOBAL_BATCH, n_out, generator=g)


def _reference_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Single process: the grads of sum over micro-batches of the mean loss over the global rows."""
    model.zero_grad()
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


# ---- bodies -------------------------------------------------------------------------------------
def _no_sync_body(micro: int, as_view: bool) -> dict:
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    stats = CommStats()
    model = DataParallel(_small_model(), ctx, bucket_mb=SMALL_CAP_MB, stats=stats, gradient_as_bucket_view=as_view)
    batches = [_data(k, 13, 3) for k in range(micro)]
    stats.reset()
    inside: list[dict] = []
    for x, y in batches[:-1]:
        with model.no_sync(), _count_dist_calls() as counts:
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        inside.append(dict(stats_calls=stats.calls(), stats_bytes=stats.bytes(), dist_calls=dict(counts)))
        assert stats.calls() == 0 and stats.bytes() == 0, stats.summary()
        assert counts == {}, counts
    x, y = batches[-1]
    with _count_dist_calls() as counts:
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    reducing = dict(counts)
    ref = _reference_grads(_small_model(), batches)
    for (name, p), g in zip(model.module.named_parameters(), ref):
        torch.testing.assert_close(p.grad, g, **FP32, msg=lambda m, n=name: f"grad {n}: {m}")
    out = dict(
        inside=inside,
        reducing_dist_calls=reducing,
        calls=stats.calls("all_reduce"),
        bytes=stats.bytes("all_reduce"),
        other_calls=stats.calls() - stats.calls("all_reduce"),
        bucket_bytes=model.bucket_bytes,
    )
    ctx.destroy()
    return out


def _plan_body(model_name: str, bucket_mb: float) -> dict:
    ctx = ParallelContext.from_world()
    rank, world = ctx.rank("dp"), ctx.size("dp")
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    make = _small_model if model_name == "small" else _Big
    n_in, n_out = (13, 3) if model_name == "small" else (256, 4)
    model = DataParallel(make(), ctx, bucket_mb=bucket_mb)
    per_step = []
    for step in range(2):
        x, y = _data(step, n_in, n_out)
        model.zero_grad()
        model.comm_stats.reset()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        s = model.comm_stats.summary()
        per_step.append(dict(ops=sorted(s), calls=s["all_reduce"]["calls"], bytes=s["all_reduce"]["bytes"]))
        ref = _reference_grads(make(), [(x, y)])
        for p, g in zip(model.module.parameters(), ref):
            torch.testing.assert_close(p.grad, g, **FP32)
    out = dict(per_step=per_step, bucket_bytes=model.bucket_bytes, label=group_label(ctx.group("dp")))
    ctx.destroy()
    return out


def _multi_group_stats_body() -> dict:
    """One op recorded on the dp, tp and world groups of a dp=2 x tp=2 mesh."""
    ctx = ParallelContext.from_world(dp=2, tp=2)
    stats = CommStats()
    all_reduce(torch.ones(8), group=ctx.group("dp"), stats=stats)  # 32 B
    all_reduce(torch.ones(8), group=ctx.group("dp"), stats=stats)  # 32 B
    all_reduce(torch.ones(3, dtype=torch.float64), group=ctx.group("tp"), stats=stats)  # 24 B
    all_reduce(torch.ones(5, dtype=torch.int32), group=dist.group.WORLD, stats=stats)  # 20 B
    out = dict(
        summary=stats.summary(),
        dp=group_label(ctx.group("dp")),
        tp=group_label(ctx.group("tp")),
        by_group=(stats.calls("all_reduce", group=ctx.group("tp")), stats.bytes(group=ctx.group("dp"))),
    )
    ctx.destroy()
    return out


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("micro, as_view", [(2, False), (3, False), (3, True)])
def test_no_sync_issues_no_collective_and_accumulates(dist_pool, world_size: int, micro: int, as_view: bool) -> None:
    results = dist_pool.run(_no_sync_body, micro, as_view, world_size=world_size, timeout=60)
    for r in results:
        assert r["inside"] == [dict(stats_calls=0, stats_bytes=0, dist_calls={})] * (micro - 1)
        # the reducing backward: one all-reduce per bucket of the hand-worked plan, nothing else
        expected = SMALL_BUCKET_BYTES_AS_VIEW if as_view else SMALL_BUCKET_BYTES
        assert r["bucket_bytes"] == expected
        assert r["calls"] == len(expected) and r["bytes"] == sum(expected)
        assert r["other_calls"] == 0
        assert r["reducing_dist_calls"] == {"all_reduce": len(expected)}


@pytest.mark.parametrize(
    "model_name, bucket_mb, expected",
    [("small", SMALL_CAP_MB, SMALL_BUCKET_BYTES), ("big", 25.0, BIG_BUCKET_BYTES), ("small", 25.0, [4044 + 6 * 4])],
)
def test_all_reduces_follow_the_hand_worked_bucket_plan(dist_pool, model_name, bucket_mb, expected) -> None:
    results = dist_pool.run(_plan_body, model_name, bucket_mb, world_size=2, timeout=60)
    for r in results:
        assert r["bucket_bytes"] == expected
        for step in r["per_step"]:
            assert step == dict(ops=["all_reduce"], calls=len(expected), bytes=sum(expected))


def test_summary_totals_over_several_groups_pure() -> None:
    stats = CommStats()
    stats.record("all_reduce", "g_dp[0, 1]", 100)
    stats.record("all_reduce", "g_tp[0, 2]", 10)
    stats.record("all_reduce", "g_dp[0, 1]", 1)
    stats.record("all_reduce", "g_pp[0, 4]", 1000)
    stats.record("broadcast", "g_dp[0, 1]", 7)
    assert stats.summary() == {
        "all_reduce": {
            "calls": 4,
            "bytes": 1111,
            "groups": {
                "g_dp[0, 1]": {"calls": 2, "bytes": 101},
                "g_pp[0, 4]": {"calls": 1, "bytes": 1000},
                "g_tp[0, 2]": {"calls": 1, "bytes": 10},
            },
        },
        "broadcast": {"calls": 1, "bytes": 7, "groups": {"g_dp[0, 1]": {"calls": 1, "bytes": 7}}},
    }
    assert (stats.calls(), stats.bytes()) == (5, 1118)
    assert (stats.calls("all_reduce"), stats.bytes("all_reduce")) == (4, 1111)
    assert (stats.calls(group="g_dp[0, 1]"), stats.bytes(group="g_dp[0, 1]")) == (3, 108)
    assert (stats.calls("all_reduce", group="g_tp[0, 2]"), stats.bytes("broadcast", group="g_tp[0, 2]")) == (1, 0)
    assert stats.calls("send") == 0 and stats.bytes("send") == 0
    assert repr(stats) == "CommStats(calls=5, bytes=1118)"
    stats.record("all_reduce", "g_dp[0, 1]", 0)  # a zero-byte call still counts as a call
    assert stats.summary()["all_reduce"]["calls"] == 5 and stats.summary()["all_reduce"]["bytes"] == 1111
    stats.reset()
    assert stats.summary() == {} and stats.calls() == 0 and stats.bytes() == 0
    with pytest.raises(ValueError, match="nbytes"):
        stats.record("all_reduce", "g", -1)


def test_summary_totals_over_real_groups(dist_pool) -> None:
    results = dist_pool.run(_multi_group_stats_body, world_size=4, timeout=60)
    # rank r of a pp=1 x dp=2 x tp=2 mesh: tp group = the pair {r, r^1}, dp group = {r, r^2}
    for rank, r in enumerate(results):
        dp = [rank % 2, rank % 2 + 2]
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["dp"] == f"shardkit_dp{dp}" and r["tp"] == f"shardkit_tp{tp}"
        s = r["summary"]
        assert sorted(s) == ["all_reduce"]
        assert (s["all_reduce"]["calls"], s["all_reduce"]["bytes"]) == (4, 32 + 32 + 24 + 20)
        groups = s["all_reduce"]["groups"]
        assert groups[r["dp"]] == {"calls": 2, "bytes": 64}
        assert groups[r["tp"]] == {"calls": 1, "bytes": 24}
        assert [v for k, v in groups.items() if k not in (r["dp"], r["tp"])] == [{"calls": 1, "bytes": 20}]
        assert r["by_group"] == (1, 64)
