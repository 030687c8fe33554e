"""DeepSpeed LR schedules: against the written-out formulas and against DeepSpeed itself.

The ``ref_*`` functions below are docs/reference.md, "DeepSpeed LR schedules", typed out again
independently of shardkit/engine/schedulers.py (no shared helper), one iteration at a time. The
differential tests drive DeepSpeed 0.19.8's classes with the same arguments (skipped without
deepspeed); the formula tests always run.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.engine.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    make_scheduler,
)
from shardkit.kernels import FusedAdamW, FusedSGD
from shardkit.parallel import ZeroOptimizer

# total_num_steps < W is legal (DeepSpeed warns too); the curves past it are what the tests check
pytestmark = pytest.mark.filterwarnings("ignore:total_num_steps .* is less than warmup_num_steps:UserWarning")

REL = 1e-12  # same formulas, possibly another association order (1/ln W · ln(it+1) vs ln(it+1)/ln W)


# ---- the formulas, written out ---------------------------------------------------------------
def ref_gamma(it: int, n: int, kind: str) -> float:
    w = max(2, n)
    return math.log(it + 1) / math.log(w) if kind == "log" else it / w


def ref_warmup_lr(it: int, lo: float, hi: float, n: int, kind: str) -> float:
    if it < 0:
        return lo
    return lo + (hi - lo) * (ref_gamma(it, n, kind) if it < max(2, n) else 1.0)


def ref_warmup_decay_lr(it: int, lo: float, hi: float, n: int, total: int, kind: str) -> float:
    w = max(2, n)
    if it < 0:
        return lo
    g = ref_gamma(it, n, kind) if it < w else max(0.0, (total - it) / max(1, total - w))
    return lo + (hi - lo) * g


def ref_cosine_lr(it: int, base: float, r0: float, n: int, total: int, c: float, kind: str) -> float:
    w = max(2, n)
    if it < 0:
        return 0.0
    if it < w:
        return base * (r0 + (1 - r0) * ref_gamma(it, n, kind))
    q = min(1.0, (it - w + 1) / max(1, total - w))
    return base * max(0.0, c + (1 - c) * (1 + math.cos(math.pi * q)) / 2)


def ref_one_cycle(it: int, *, lo, hi, f, f2=None, k1=0, k2=None, d=0, lr_rate=0.0, mlo=0.8, mhi=0.9, mom_rate=0.0):
    """(lr, beta1) at iteration ``it`` >= 0."""
    f2 = f if f2 is None else f2
    k2 = k1 if k2 is None else k2
    s_total, rho, n = f + f2, f / (f + f2), it + 1
    if it < s_total:
        x = n / s_total - math.floor(n / s_total)
        s = x / rho if x <= rho else (x - 1) / (rho - 1)
        k = k1 if x <= rho else k2
        if k > 0:
            m = n % s_total
            s = math.floor(k * m / f) / k if m <= f else math.floor(k * (s_total - m) / f2) / k
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    steps = (it - s_total + 1) / d if d else 0.0
    lr = lo if (d == 0 or lr_rate == 0) else lo / (1 + lr_rate * steps)
    mom = mhi if (d == 0 or mom_rate == 0) else mhi * (1 + mom_rate * steps)
    return lr, mom


def ref_lr_range_test(it: int, lo: float, step_size: int, rate: float, staircase: bool) -> float:
    """lr = min_lr · (1 + rate · i), i = (it + 1) / step_size, floored for the staircase."""
    i = (it + 1) / step_size
    return lo * (1 + rate * (math.floor(i) if staircase else i))


def _params(n_groups: int = 1) -> list[dict]:
    return [{"params": [torch.nn.Parameter(torch.zeros(3))]} for _ in range(n_groups)]


def _lrs(opt) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


# ---- formula tests (always run) ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_warmup_lr_follows_formula(kind: str, n: int) -> None:
    opt = torch.optim.SGD(_params(), lr=0.5)
    s = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.3, warmup_num_steps=n, warmup_type=kind)
    assert s.last_batch_iteration == -1 and _lrs(opt) == [0.01]  # the constructor wrote it = -1
    for it in range(n + 6):
        s.step()
        assert s.last_batch_iteration == it
        assert math.isclose(_lrs(opt)[0], ref_warmup_lr(it, 0.01, 0.3, n, kind), rel_tol=REL), (it, kind, n)
        assert s.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_warmup_of_one_step_uses_w_equal_two() -> None:
    """W = max(2, warmup_num_steps): with 1 warmup step, it = 1 is still warming up (γ = 1/2)."""
    opt = torch.optim.SGD(_params(), lr=0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    got = []
    for _ in range(3):
        s.step()
        got.append(_lrs(opt)[0])
    assert got == [0.0, 0.5, 1.0]  # W = 1 would give [0, 1, 1]
    s = WarmupDecayLR(opt, total_num_steps=4, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="log")
    s.step(), s.step()
    assert math.isclose(_lrs(opt)[0], math.log(2) / math.log(2))  # it = 1 < W = 2: log warmup, γ = 1
    s.step()  # it = 2: decay, (4 - 2) / (4 - 2)
    assert _lrs(opt) == [1.0]
    s.step()
    assert _lrs(opt) == [0.5]


def test_warmup_lr_default_max_is_the_groups_lr() -> None:
    opt = torch.optim.SGD(_params(2), lr=0.5)
    opt.param_groups[1]["lr"] = 0.25
    s = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    for _ in range(3):
        s.step()
    assert _lrs(opt) == [0.5, 0.25]


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("n", "total"), [(1, 1), (1, 2), (5, 3), (5, 5), (5, 6), (4, 20), (10, 1000)])
def test_warmup_decay_lr_follows_formula(kind: str, n: int, total: int) -> None:
    opt = torch.optim.SGD(_params(), lr=0.5)
    s = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.02, warmup_max_lr=0.4, warmup_num_steps=n, warmup_type=kind)
    assert _lrs(opt) == [0.02]
    for it in range(max(n, total) + 5):
        s.step()
        assert math.isclose(_lrs(opt)[0], ref_warmup_decay_lr(it, 0.02, 0.4, n, total, kind), rel_tol=REL), (it, n, total)
    assert _lrs(opt) == [0.02]  # past total_num_steps: back at warmup_min_lr, never below


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("n", "total", "r0", "c"), [(1, 1, 0.0, 0.0), (3, 3, 0.1, 0.5), (4, 12, 0.0, 1e-4), (5, 2, 0.2, 0.3)])
def test_warmup_cosine_lr_follows_formula(kind: str, n: int, total: int, r0: float, c: float) -> None:
    opt = FusedAdamW(_params(2), lr=0.3)
    opt.param_groups[1]["lr"] = 0.1
    s = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=r0, warmup_num_steps=n, cos_min_ratio=c, warmup_type=kind)
    assert _lrs(opt) == [0.0, 0.0]
    for it in range(max(n, total) + 6):
        s.step()
        for got, base in zip(_lrs(opt), (0.3, 0.1)):
            assert math.isclose(got, ref_cosine_lr(it, base, r0, n, total, c, kind), rel_tol=REL), (it, base)
    assert math.isclose(_lrs(opt)[0], 0.3 * c, rel_tol=REL)  # clamped at the floor after T


ONE_CYCLE_CASES = [
    dict(lo=0.01, hi=0.1, f=3),
    dict(lo=0.01, hi=0.1, f=4, f2=2),
    dict(lo=0.01, hi=0.1, f=5, f2=0),
    dict(lo=0.01, hi=0.1, f=6, f2=3, k1=3, k2=2),
    dict(lo=0.01, hi=0.1, f=4, k1=2),
    dict(lo=0.02, hi=0.2, f=2, f2=3, d=2, lr_rate=0.5, mom_rate=0.1),
    dict(lo=0.02, hi=0.2, f=2, d=3, lr_rate=0.0, mom_rate=0.2, mlo=0.85, mhi=0.95),
]


@pytest.mark.parametrize("case", ONE_CYCLE_CASES)
def test_one_cycle_follows_formula(case: dict) -> None:
    opt = FusedAdamW(_params(), lr=1.0, betas=(0.9, 0.999))
    s = OneCycle(
        opt,
        cycle_min_lr=case["lo"],
        cycle_max_lr=case["hi"],
        decay_lr_rate=case.get("lr_rate", 0.0),
        cycle_first_step_size=case["f"],
        cycle_second_step_size=case.get("f2"),
        cycle_first_stair_count=case.get("k1", 0),
        cycle_second_stair_count=case.get("k2"),
        decay_step_size=case.get("d", 0),
        cycle_min_mom=case.get("mlo", 0.8),
        cycle_max_mom=case.get("mhi", 0.9),
        decay_mom_rate=case.get("mom_rate", 0.0),
    )
    g = opt.param_groups[0]
    assert g["lr"] == case["lo"] and g["betas"] == (case.get("mlo", 0.8), 0.99)  # constructor: min lr, min mom
    s_total = case["f"] + (case["f"] if case.get("f2") is None else case["f2"])
    for it in range(2 * s_total + 5):
        s.step()
        lr, mom = ref_one_cycle(it, **case)
        assert math.isclose(g["lr"], lr, rel_tol=REL, abs_tol=1e-15), (it, case)
        assert math.isclose(g["betas"][0], mom, rel_tol=REL) and g["betas"][1] == 0.99, (it, case)


@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize(("step_size", "rate"), [(1, 1.0), (3, 0.5), (4, 2.0), (10, 0.0)])
def test_lr_range_test_follows_formula(staircase: bool, step_size: int, rate: float) -> None:
    opt = FusedAdamW(_params(2), lr=0.5)
    s = LRRangeTest(
        opt,
        lr_range_test_min_lr=[1e-3, 2e-4],
        lr_range_test_step_size=step_size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=staircase,
    )
    assert s.last_batch_iteration == -1 and _lrs(opt) == [1e-3, 2e-4]  # the constructor wrote min_lr
    assert s.get_last_lr() == [1e-3, 2e-4]
    for it in range(3 * step_size + 4):
        s.step()
        for got, lo in zip(_lrs(opt), (1e-3, 2e-4)):
            assert math.isclose(got, ref_lr_range_test(it, lo, step_size, rate, staircase), rel_tol=REL), (it, lo)
        assert s.get_last_lr() == _lrs(opt) and s.get_lr() == _lrs(opt)
    if staircase and step_size == 3 and rate == 0.5:  # the stairs: flat for 3 steps, then +50 % of min_lr
        s = LRRangeTest(torch.optim.SGD(_params(), lr=1.0), 0.1, 3, 0.5, True)
        seen = []
        for _ in range(7):
            s.step()
            seen.append(round(s.get_last_lr()[0], 6))
        assert seen == [0.1, 0.1, 0.15, 0.15, 0.15, 0.2, 0.2]


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_lr_range_test_step_size_is_validated(bad) -> None:
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer"):
        LRRangeTest(torch.optim.SGD(_params(), lr=0.1), lr_range_test_step_size=bad)
    with pytest.raises(ValueError, match="lr_range_test_min_lr: expected 2 values"):
        LRRangeTest(torch.optim.SGD(_params(2), lr=0.1), lr_range_test_min_lr=[0.1])


def test_one_cycle_peaks_at_the_end_of_the_first_half() -> None:
    opt = FusedAdamW(_params(), lr=1.0)
    s = OneCycle(opt, 0.1, 1.0, cycle_first_step_size=4, cycle_second_step_size=4)
    seen = []
    for _ in range(9):
        s.step()
        seen.append(round(opt.param_groups[0]["lr"], 6))
    assert seen == [0.325, 0.55, 0.775, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]


def test_one_cycle_without_betas_warns_and_cycles_lr_only() -> None:
    opt = FusedSGD(_params(), lr=1.0, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        s = OneCycle(opt, 0.1, 1.0, cycle_first_step_size=2)
    s.step()
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    assert math.isclose(opt.param_groups[0]["lr"], 0.55)


def test_per_group_values_and_tensor_lrs() -> None:
    """A list gives each group its own bound; a tensor lr is filled in place (same object)."""

    class ParamGroupsOnly:  # the surface ZeroOptimizer exposes: param_groups + defaults, no torch.optim.Optimizer
        def __init__(self) -> None:
            self.param_groups = [{"params": [], "lr": torch.tensor(0.5)}, {"params": [], "lr": 0.5}]
            self.defaults = {"lr": 0.5}

    opt = ParamGroupsOnly()
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.3], warmup_num_steps=4, warmup_type="linear")
    s.step(), s.step(), s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert math.isclose(float(lr_tensor), 0.5) and math.isclose(opt.param_groups[1]["lr"], 0.1 + 0.2 * 0.5)
    with pytest.raises(ValueError, match="warmup_max_lr: expected 2 values"):
        WarmupLR(opt, warmup_max_lr=[1.0])
    # ZeroOptimizer is not a torch Optimizer; what the schedulers use of it is this surface
    assert isinstance(ZeroOptimizer.param_groups, property) and isinstance(ZeroOptimizer.defaults, property)
    assert not issubclass(ZeroOptimizer, torch.optim.Optimizer)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(warmup_num_steps=0), "warmup_num_steps must be a positive integer"),
        (dict(warmup_num_steps=10.0), "warmup_num_steps must be a positive integer"),
        (dict(warmup_type="cosine"), "warmup_type must be one of"),
    ],
)
def test_warmup_arguments_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WarmupLR(torch.optim.SGD(_params(), lr=0.1), **kwargs)


def test_one_cycle_step_sizes_are_validated() -> None:
    opt = FusedAdamW(_params(), lr=1.0)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(opt, 0.1, 1.0, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_second_step_size"):
        OneCycle(opt, 0.1, 1.0, cycle_second_step_size=-1)
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_state_dict_round_trip_resumes_the_same_curve(name: str) -> None:
    params = {
        "WarmupLR": dict(warmup_max_lr=0.1, warmup_num_steps=5),
        "WarmupDecayLR": dict(total_num_steps=12, warmup_max_lr=0.1, warmup_num_steps=5),
        "WarmupCosineLR": dict(total_num_steps=12, warmup_num_steps=5),
        "OneCycle": dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, decay_step_size=2, decay_lr_rate=0.3),
        "LRRangeTest": dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=3, lr_range_test_step_rate=0.5),
    }[name]
    opt_a = FusedAdamW(_params(), lr=0.2)
    a = make_scheduler(name, opt_a, params)
    for _ in range(7):
        a.step()
    state = copy.deepcopy(a.state_dict())
    assert state == {"last_batch_iteration": 6}
    opt_b = FusedAdamW(_params(), lr=0.2)
    b = make_scheduler(name, opt_b, params)
    b.load_state_dict(state)
    for _ in range(10):
        a.step(), b.step()
        assert _lrs(opt_a) == _lrs(opt_b) and opt_a.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]
    with pytest.raises(ValueError, match="scheduler.type must be one of"):
        make_scheduler("CosineAnnealing", opt_a, {})


# ---- differential: DeepSpeed's own classes -----------------------------------------------------
def _ds():
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


def _drive(ours, theirs, opt_ours, opt_theirs, steps: int, momentum: bool = False) -> None:
    assert _lrs(opt_ours) == pytest.approx(_lrs(opt_theirs), rel=REL, abs=1e-15)  # constructor's it = -1 write
    for _ in range(steps):
        ours.step(), theirs.step()
        assert ours.last_batch_iteration == theirs.last_batch_iteration
        assert _lrs(opt_ours) == pytest.approx(_lrs(opt_theirs), rel=REL, abs=1e-15), ours.last_batch_iteration
        if momentum:
            for g_o, g_t in zip(opt_ours.param_groups, opt_theirs.param_groups):
                assert g_o["betas"] == pytest.approx(g_t["betas"], rel=REL), ours.last_batch_iteration
    assert ours.state_dict() == theirs.state_dict()
    state = theirs.state_dict()
    ours.load_state_dict(state)
    ours.step(), theirs.step()
    assert _lrs(opt_ours) == pytest.approx(_lrs(opt_theirs), rel=REL, abs=1e-15)


def _pair(n_groups: int, lr: float = 0.3):
    a, b = torch.optim.AdamW(_params(n_groups), lr=lr), torch.optim.AdamW(_params(n_groups), lr=lr)
    for i, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        ga["lr"] = gb["lr"] = lr / (i + 1)
    return a, b


LRS = st.floats(0.0, 1.0, allow_nan=False)
QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@QUICK
@given(
    kind=st.sampled_from(["log", "linear"]),
    n=st.integers(1, 12),
    total=st.integers(1, 30),
    lo=LRS,
    hi=LRS,
    decay=st.booleans(),
    default_max=st.booleans(),
)
def test_warmup_and_decay_equal_deepspeed(kind, n, total, lo, hi, decay, default_max) -> None:
    ds = _ds()
    a, b = _pair(2)
    hi_arg = None if default_max and not decay else hi
    if decay:
        ours = WarmupDecayLR(a, total, lo, hi_arg, n, kind)
        theirs = ds.WarmupDecayLR(b, total, lo, hi_arg, n, kind)
    else:
        ours = WarmupLR(a, lo, hi_arg, n, kind)
        theirs = ds.WarmupLR(b, lo, hi_arg, n, kind)
    _drive(ours, theirs, a, b, max(n, total) + 4)


@QUICK
@given(
    kind=st.sampled_from(["log", "linear"]),
    n=st.integers(1, 12),
    total=st.integers(1, 30),
    r0=LRS,
    c=LRS,
)
def test_warmup_cosine_equals_deepspeed(kind, n, total, r0, c) -> None:
    ds = _ds()
    a, b = _pair(2)
    _drive(WarmupCosineLR(a, total, r0, n, c, kind), ds.WarmupCosineLR(b, total, r0, n, c, kind), a, b, max(n, total) + 4)


@QUICK
@given(
    lo=LRS,
    hi=LRS,
    f=st.integers(1, 8),
    f2=st.one_of(st.none(), st.integers(0, 8)),
    k1=st.integers(0, 4),
    k2=st.one_of(st.none(), st.integers(0, 4)),
    d=st.integers(0, 4),
    lr_rate=st.sampled_from([0.0, 0.1, 0.5]),
    mom_rate=st.sampled_from([0.0, 0.05, 1.0]),  # 1.0: the 'no decay' test must compare with 0, not 1
    cycle_momentum=st.booleans(),
    mlo=st.floats(0.5, 0.9),
)
def test_one_cycle_equals_deepspeed(lo, hi, f, f2, k1, k2, d, lr_rate, mom_rate, cycle_momentum, mlo) -> None:
    ds = _ds()
    a, b = _pair(2)
    kw = dict(
        cycle_min_lr=lo,
        cycle_max_lr=hi,
        decay_lr_rate=lr_rate,
        cycle_first_step_size=f,
        cycle_second_step_size=f2,
        cycle_first_stair_count=k1,
        cycle_second_stair_count=k2,
        decay_step_size=d,
        cycle_momentum=cycle_momentum,
        cycle_min_mom=mlo,
        cycle_max_mom=0.95,
        decay_mom_rate=mom_rate,
    )
    ours, theirs = OneCycle(a, **kw), ds.OneCycle(b, **kw)
    assert [g.get("betas") for g in a.param_groups] == [g.get("betas") for g in b.param_groups]
    _drive(ours, theirs, a, b, 2 * (f + (f if f2 is None else f2)) + 6, momentum=cycle_momentum)


@QUICK
@given(
    lo=st.one_of(LRS, st.lists(LRS, min_size=2, max_size=2)),
    step_size=st.integers(1, 7),
    rate=st.floats(0.0, 10.0, allow_nan=False),
    staircase=st.booleans(),
)
def test_lr_range_test_equals_deepspeed(lo, step_size, rate, staircase) -> None:
    ds = _ds()
    a, b = _pair(2)
    kw = dict(
        lr_range_test_min_lr=lo,
        lr_range_test_step_size=step_size,
        lr_range_test_step_rate=rate,
        lr_range_test_staircase=staircase,
    )
    ours, theirs = LRRangeTest(a, **kw), ds.LRRangeTest(b, **kw)
    assert ours.get_last_lr() == theirs.get_last_lr()  # what the constructor wrote: min_lr
    _drive(ours, theirs, a, b, 3 * step_size + 5)
    assert ours.get_lr() == pytest.approx(theirs.get_lr(), rel=REL, abs=1e-15)
    assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=REL, abs=1e-15)
    ours.step(40), theirs.step(40)  # an explicit iteration, as a resumed run passes it
    assert _lrs(a) == pytest.approx(_lrs(b), rel=REL, abs=1e-15) and ours.state_dict() == theirs.state_dict()


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_constructor_defaults_equal_deepspeeds(name: str) -> None:
    """A config that leaves a key out gets DeepSpeed's default (e.g. OneCycle's
    cycle_first_step_size=2000, decay_step_size=0), not a near miss."""
    import inspect

    ds = _ds()
    ours = inspect.signature(SCHEDULERS[name]).parameters
    theirs = inspect.signature(getattr(ds, name)).parameters
    shared = [k for k in ours if k in theirs and k != "optimizer"]
    assert len(shared) >= 4, shared
    for k in shared:
        assert ours[k].default == theirs[k].default, (name, k, ours[k].default, theirs[k].default)


def test_warmup_cosine_ratio_before_the_first_step_equals_deepspeeds() -> None:
    ds = _ds()
    a, b = _pair(1)
    kw = dict(total_num_steps=10, warmup_num_steps=3)
    ours, theirs = WarmupCosineLR(a, **kw), ds.WarmupCosineLR(b, **kw)
    assert ours.get_lr_ratio() == theirs.get_lr_ratio() == 0.0
