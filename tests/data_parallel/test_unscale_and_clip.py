"""unscale_grads_ and clip_grad_norm_ in one process, against torch written out by hand.

Every expectation is computed independently: ``p.grad * inv_scale``, the L2 norm of the
concatenated unscaled grads, ``torch.nn.utils.clip_grad_norm_`` on a copy. The collectives
over ``group`` (overflow, ``max``) and ``norm_group`` (Σg², ``sum``) are replaced by a fake
that plays the other rank, so which tensor goes to which group with which op is checked
without processes (the real all-reduces run in tests/data_parallel/test_data_parallel_trains_like_one_process.py).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from shardkit.parallel import clip_grad_norm_, unscale_grads_
from shardkit.parallel.grad_utils import UnscaledGrads, agree_and_clip_
from tolerances import FP32

BACKENDS = ["torch", "triton"]


def _params(seed: int = 0, dtypes=(torch.float32,)) -> list[tuple[str, torch.nn.Parameter]]:
    """Named params with grads of a few shapes (1, odd, 2-D), one set per dtype."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in dtypes:
        for i, shape in enumerate([(1,), (7,), (5, 3), (33,)]):
            p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
            p.grad = (torch.randn(shape, generator=g) * 100).to(dtype)
            out.append((f"{dtype}.p{i}", p))
    return out


def _norm(tensors) -> float:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]).norm().item()


class _FakeOtherRank:
    """Stands in for ``all_reduce`` over a 2-rank group: combines with the other rank's values.

    The other rank holds ``[found_inf, Σg²]``: a 2-element all-reduce (flag and squares packed,
    as over a group that partitions the grads) combines with both, a 1-element ``max`` with the
    flag, a 1-element ``sum`` with the squares."""

    def __init__(self, other_found_inf: float = 0.0, other_sumsq: float = 0.0) -> None:
        self.other_found_inf, self.other_sumsq = other_found_inf, other_sumsq
        self.calls: list[tuple[object, str]] = []

    def __call__(self, t: torch.Tensor, *, group, op: str = "sum", stats=None) -> None:
        self.calls.append((group, op))
        if t.numel() == 2:
            other = torch.tensor([self.other_found_inf, self.other_sumsq])
        else:
            other = torch.full_like(t, self.other_found_inf if op == "max" else self.other_sumsq)
        t.copy_(torch.maximum(t, other) if op == "max" else t + other)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_multiplies_by_inv_scale_and_measures_the_norm(backend):
    named = _params(dtypes=(torch.float32, torch.bfloat16))  # one launch per dtype, one norm
    want = [p.grad * 0.125 for _, p in named]  # a power of two: exact in bf16 too
    report = unscale_grads_(named, inv_scale=0.125, backend=backend)
    torch.testing.assert_close([p.grad for _, p in named], want, rtol=0, atol=0)
    assert report.grad_norm == pytest.approx(_norm(want), rel=1e-6)
    assert not report.overflow and report.nonfinite == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscale_with_inv_scale_one_only_reads_the_grads(backend):
    named = _params()
    before = [p.grad.clone() for _, p in named]
    versions = [p.grad._version for _, p in named]
    report = unscale_grads_(named, backend=backend)
    assert all(torch.equal(p.grad, b) for (_, p), b in zip(named, before))
    # a norm-only pass: no write (torch's in-place multiply would bump the version counter)
    assert [p.grad._version for _, p in named] == versions
    assert report.grad_norm == pytest.approx(_norm(before), rel=1e-6)
    # any other factor is applied, 2.0 (a static loss scale of 0.5) included
    unscale_grads_(named, inv_scale=2.0, backend=backend)
    torch.testing.assert_close([p.grad for _, p in named], [b * 2.0 for b in before], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_grad_is_an_overflow_named_only_when_asked(backend, bad):
    named = _params()
    named[2][1].grad[1, 2] = bad
    report = unscale_grads_(named, inv_scale=0.5, backend=backend)
    assert report.overflow and report.grad_norm == float("inf") and report.nonfinite == []
    named[2][1].grad[1, 2] = bad
    report = unscale_grads_(named, inv_scale=0.5, report_nonfinite=True, backend=backend)
    assert report.overflow and report.nonfinite == [named[2][0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_norm_clips_like_torch_and_not_on_overflow(backend):
    named, ref = _params(), _params()
    for _, p in ref:
        p.grad.mul_(0.25)
    want_norm = torch.nn.utils.clip_grad_norm_([p for _, p in ref], 3.0).item()
    report = unscale_grads_(named, inv_scale=0.25, max_norm=3.0, backend=backend)
    assert report.grad_norm == pytest.approx(want_norm, rel=1e-6)  # the norm before clipping
    torch.testing.assert_close([p.grad for _, p in named], [p.grad for _, p in ref], **FP32)
    assert _norm([p.grad for _, p in named]) == pytest.approx(3.0, rel=1e-5)
    # a norm already below max_norm: nothing changes
    before = [p.grad.clone() for _, p in named]
    unscale_grads_(named, max_norm=1e6, backend=backend)
    torch.testing.assert_close([p.grad for _, p in named], before, rtol=0, atol=0)
    # overflow: the grads are unscaled but not clipped (the step is skipped anyway)
    named[0][1].grad[0] = float("inf")
    want = [p.grad * 0.5 for _, p in named]
    unscale_grads_(named, inv_scale=0.5, max_norm=1e-3, backend=backend)
    torch.testing.assert_close([p.grad for _, p in named][1:], want[1:], **FP32)


def test_bad_max_norm_params_without_grad_and_sparse():
    named = _params()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm"):
            unscale_grads_(named, max_norm=bad)
    no_grad = [("a", torch.nn.Parameter(torch.ones(3))), ("b", torch.nn.Parameter(torch.ones(2)))]
    assert unscale_grads_(no_grad, inv_scale=0.5) == unscale_grads_([], inv_scale=0.5)
    report = unscale_grads_(no_grad, inv_scale=0.5)
    assert (report.overflow, report.grad_norm, report.nonfinite) == (False, 0.0, [])
    with_one = [*no_grad, named[1]]
    assert unscale_grads_(with_one).grad_norm == pytest.approx(_norm([named[1][1].grad]), rel=1e-6)
    # another device and dtype (so no single kernel launch would see both): refused up front
    on_meta = torch.nn.Parameter(torch.ones(2, device="meta", dtype=torch.bfloat16))
    on_meta.grad = torch.ones(2, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be on one device per rank, found \['cpu', 'meta'\]"):
        unscale_grads_([named[0], ("m", on_meta)])
    with pytest.raises(ValueError, match=r"must be on one device per rank, found \['cpu', 'meta'\]"):
        clip_grad_norm_([named[0][1], on_meta], 1.0)
    sparse = torch.nn.Parameter(torch.ones(4))
    sparse.grad = torch.ones(4).to_sparse()
    with pytest.raises(TypeError, match="sparse.*sp"):
        unscale_grads_([("sp", sparse)])


def test_group_agrees_overflow_with_max_and_norm_group_sums_squares():
    """The other rank has an inf / a Σg² of 9: flag and Σg² are summed over ``norm_group`` in one
    call (the grads are partitioned there), then the flag alone is max-reduced over ``group``."""
    named = _params()
    local = [p.grad * 0.5 for _, p in named]
    fake = _FakeOtherRank(other_found_inf=1.0, other_sumsq=9.0)
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        report = unscale_grads_(named, inv_scale=0.5, group="G", max_norm=1.0)
    assert report.overflow and fake.calls == [("G", "max")]
    torch.testing.assert_close([p.grad for _, p in named], local, **FP32)  # not clipped
    fake = _FakeOtherRank(other_found_inf=0.0, other_sumsq=9.0)
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        report = unscale_grads_(named, group="G", norm_group="N")
    assert fake.calls == [("N", "sum"), ("G", "max")] and not report.overflow
    assert report.grad_norm == pytest.approx((_norm(local) ** 2 + 9.0) ** 0.5, rel=1e-6)
    fake = _FakeOtherRank(other_sumsq=9.0)
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        report = unscale_grads_(named)  # no group: no collective at all
    assert fake.calls == [] and report.grad_norm == pytest.approx(_norm(local), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_grads_keep_their_layout_or_become_contiguous(backend):
    dense = torch.nn.Parameter(torch.zeros(4, 6).t())  # transposed: dense, not contiguous
    dense.grad = torch.arange(24.0).reshape(4, 6).t()
    strided = torch.nn.Parameter(torch.zeros(5))
    strided.grad = torch.arange(10.0)[::2]  # every other element: not dense
    want = [dense.grad * 0.5, strided.grad * 0.5]
    dense_grad = dense.grad
    unscale_grads_([("d", dense), ("s", strided)], inv_scale=0.5, backend=backend)
    assert dense.grad is dense_grad and dense.grad.stride() == (1, 6)  # written in place
    assert strided.grad.is_contiguous()
    torch.testing.assert_close([dense.grad, strided.grad], want, rtol=0, atol=0)


def _record(named, *, loss_scale=8.0, found_inf=0.0, sumsq=None) -> UnscaledGrads:
    """What DataParallel(loss_scaler=) hands over: these grads already unscaled and measured."""
    grads = {id(p): (p, p.grad, p.grad._version) for _, p in named}
    total = _norm([p.grad for _, p in named]) ** 2 if sumsq is None else sumsq
    return UnscaledGrads(loss_scale, grads, torch.tensor([found_inf]), torch.tensor([total]))


def test_unscaled_record_grads_are_not_touched_again():
    named = _params()
    before = [p.grad.clone() for _, p in named]
    # the record's totals are used as they are: a sentinel Σg² of 4 and no inf
    report = unscale_grads_(named, inv_scale=0.125, unscaled=_record(named, sumsq=4.0), max_norm=1.0)
    assert report.grad_norm == 2.0 and not report.overflow
    # clipped to norm 1 from the record's norm 2: halved, never multiplied by inv_scale
    torch.testing.assert_close([p.grad for _, p in named], [b * 0.5 for b in before], rtol=1e-6, atol=0)
    report = unscale_grads_(named, unscaled=_record(named, found_inf=1.0), report_nonfinite=True)
    assert report.overflow and report.nonfinite == []  # the flag is from another rank's grads
    named[1][1].grad[3] = float("nan")
    report = unscale_grads_(named, unscaled=_record(named, found_inf=1.0), report_nonfinite=True)
    assert report.overflow and report.nonfinite == [named[1][0]]
    report = unscale_grads_(named, unscaled=_record(named, found_inf=1.0))
    assert report.overflow and report.nonfinite == []  # names only when asked


def test_unscaled_record_subset_and_foreign_params():
    """Only some of the recorded params passed: their flag and norm are measured again (read
    only); params the record does not cover (or a different param with a recycled id) are
    unscaled as usual."""
    named = _params()
    record = _record(named[:3], sumsq=1e6)
    before = [p.grad.clone() for _, p in named]
    report = unscale_grads_(named[:2] + named[3:], inv_scale=0.5, unscaled=record)
    want = [before[0], before[1], before[3] * 0.5]
    assert report.grad_norm == pytest.approx(_norm(want), rel=1e-6)  # not the record's 1e6
    torch.testing.assert_close([named[i][1].grad for i in (0, 1, 3)], want, rtol=0, atol=0)
    # uncovered params before and after a covered one, one dtype: each is still unscaled
    named = _params(seed=1)
    before = [p.grad.clone() for _, p in named]
    unscale_grads_(named, inv_scale=0.5, unscaled=_record(named[1:2]))
    want = [before[0] * 0.5, before[1], *(b * 0.5 for b in before[2:])]
    torch.testing.assert_close([p.grad for _, p in named], want, rtol=0, atol=0)
    other = torch.nn.Parameter(torch.zeros(3))
    other.grad = torch.full((3,), 2.0)
    stale = UnscaledGrads(8.0, {id(other): (named[0][1], named[0][1].grad, 0)}, torch.zeros(1), torch.zeros(1))
    unscale_grads_([("o", other)], inv_scale=0.5, unscaled=stale)
    torch.testing.assert_close(other.grad, torch.ones(3), rtol=0, atol=0)


def test_unscaled_record_detects_a_changed_grad():
    named = _params()
    record = _record(named)
    named[2][1].grad.mul_(2.0)  # in place: the version moves
    with pytest.raises(RuntimeError, match=f"grad of {named[2][0]} changed"):
        unscale_grads_(named, unscaled=record)
    record = _record(named)
    named[0][1].grad = named[0][1].grad.clone()  # replaced
    with pytest.raises(RuntimeError, match=f"grad of {named[0][0]} changed"):
        unscale_grads_(named, unscaled=record)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_grad_norm_two_dtypes_and_norm_group(backend):
    # Reference written out in fp32: torch's own clip would take each bf16 grad's norm in bf16
    # (foreach_norm), 6e-4 off here; the fused pass accumulates Σg² in fp32.
    named = _params(dtypes=(torch.float32, torch.bfloat16))
    before = [p.grad.clone() for _, p in named]
    want_total = _norm(before)
    coef = min(1.0, 5.0 / (want_total + 1e-6))
    total = clip_grad_norm_([p for _, p in named], 5.0, backend=backend)
    assert total.shape == () and total.dtype == torch.float32
    assert total.item() == pytest.approx(want_total, rel=1e-6)
    # each grad is g * coef rounded once to its dtype (bf16: half an ulp, 2^-8 relative)
    want = [(b.float() * coef).to(b.dtype) for b in before]
    torch.testing.assert_close([p.grad for _, p in named], want, rtol=2**-8, atol=1e-7)
    assert _norm([p.grad for _, p in named]) == pytest.approx(5.0, rel=2**-8)
    # partitioned grads: the other rank's Σg² of 16 joins the norm (sum over norm_group)
    named = _params()
    local = _norm([p.grad for _, p in named])
    fake = _FakeOtherRank(other_sumsq=16.0)
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        total = clip_grad_norm_([p for _, p in named], 1.0, norm_group="N", backend=backend)
    assert fake.calls == [("N", "sum")]
    assert total.item() == pytest.approx((local**2 + 16.0) ** 0.5, rel=1e-6)
    assert _norm([p.grad for _, p in named]) == pytest.approx(local / total.item(), rel=1e-5)


def test_options_are_keyword_only():
    """torch's third positional argument is ``norm_type``: here it must not become norm_group."""
    named = _params()
    with pytest.raises(TypeError, match="positional argument"):
        clip_grad_norm_([p for _, p in named], 1.0, 2.0)  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional argument"):
        unscale_grads_(named, 0.5)  # type: ignore[misc]


def test_clip_grad_norm_without_grads_and_bad_max_norm():
    p = torch.nn.Parameter(torch.ones(3))
    total = clip_grad_norm_([p], 1.0)
    assert total.shape == () and total.item() == 0.0
    p.grad = torch.full((3,), 4.0)  # a single param: norm sqrt(48), clipped to 1
    total = clip_grad_norm_([p], 1.0)
    assert total.item() == pytest.approx(48**0.5, rel=1e-6)
    torch.testing.assert_close(p.grad, torch.full((3,), 4.0 / (48**0.5 + 1e-6)), rtol=1e-6, atol=0)
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm_([p], bad)


class _AddOne:
    """Stands in for ``all_reduce``: every other rank of the group contributes 1 per element."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, str, int]] = []

    def __call__(self, t: torch.Tensor, *, group, op: str = "sum", stats=None) -> None:
        self.calls.append((group, op, t.numel()))
        t.add_(1.0) if op == "sum" else t.clamp_(min=1.0)


def test_agree_and_clip_riders_travel_in_the_first_sum_group_only():
    """Riders (ZeRO's per-param gradient flags) are summed with flag and Σg² over the first
    partitioning group and written back; the later groups reduce only ``[flag, Σg²]``."""
    riders = torch.tensor([1.0, 0.0, 1.0])
    fake = _AddOne()
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        overflow, norm = agree_and_clip_(torch.tensor([3.0]), torch.zeros(1), sum_over=["A", None, "B"], riders=riders)
    assert fake.calls == [("A", "sum", 5), ("B", "sum", 2)]
    assert riders.tolist() == [2.0, 1.0, 2.0]
    assert overflow and norm.item() == float("inf")  # another rank's flag arrived


def test_agree_and_clip_without_a_flag_clips_by_the_agreed_norm():
    """No loss scaler: only Σg² travels, and the grads are clipped by the GLOBAL norm with torch's
    coefficient ``max_norm / (norm + 1e-6)``."""
    g = torch.tensor([3.0, 4.0])
    want = g * (1.0 / ((25.0 + 2.0) ** 0.5 + 1e-6))
    fake = _AddOne()
    with mock.patch("shardkit.parallel.grad_utils.all_reduce", fake):
        overflow, norm = agree_and_clip_(torch.tensor([25.0]), sum_over=["A", "B"], max_norm=1.0, grads=[[g]], backend="torch")
    assert fake.calls == [("A", "sum", 1), ("B", "sum", 1)] and not overflow
    assert norm.item() == pytest.approx(27.0**0.5, rel=1e-6)
    torch.testing.assert_close(g, want, **FP32)
