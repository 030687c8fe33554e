"""DynamicLossScaler vs DeepSpeed's own, update by update (skipped without ``deepspeed``).

Both scalers are driven with the same overflow sequence from the same config — DeepSpeed's
built the way its engine builds it from an ``"fp16"`` section (``init_scale =
2 ** initial_scale_power``, ``delayed_shift = hysteresis``) — and after every update the scale
and the hysteresis left must be equal, and an overflow at the minimum must raise in both.
DeepSpeed's unit-test sequences (tests/unit/runtime/half_precision in its repository) are
replayed with their expected scales.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.parallel.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError

ds_loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")


@pytest.fixture(autouse=True, scope="module")
def _no_process_group():
    # DeepSpeed's update_scale calls dist.get_rank() only to choose which rank logs; without an
    # initialized backend that asserts. Answer rank 0 instead of starting a process group.
    saved = ds_loss_scaler.dist
    ds_loss_scaler.dist = types.SimpleNamespace(get_rank=lambda group=None: 0)
    yield
    ds_loss_scaler.dist = saved


def make_pair(
    *,
    power: int,
    window: int,
    hysteresis: int = 2,
    consecutive: bool = False,
    min_scale: float = 1.0,
    raise_at_min: bool = True,
):
    cfg = {
        "loss_scale": 0,
        "initial_scale_power": power,
        "loss_scale_window": window,
        "hysteresis": hysteresis,
        "consecutive_hysteresis": consecutive,
        "min_loss_scale": min_scale,
    }
    ours = DynamicLossScaler.from_config(cfg)
    ours.raise_error_at_min_scale = raise_at_min
    theirs = ds_loss_scaler.DynamicLossScaler(
        init_scale=2**power,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=raise_at_min,
    )
    return ours, theirs


def drive(ours: DynamicLossScaler, theirs, overflows: list[bool]) -> list[float]:
    """Apply each update to both; assert equal state after each; return the scales."""
    scales = []
    for step, overflow in enumerate(overflows):
        try:
            theirs.update_scale(overflow)
        except Exception as exc:  # DeepSpeed raises a bare Exception at the minimum
            assert "Current loss scale already at minimum" in str(exc)
            with pytest.raises(LossScaleAtMinimumError, match="Current loss scale already at minimum"):
                ours.update(overflow)
            assert ours.scale == theirs.cur_scale, f"step {step}: state changed by the failed update"
            return scales
        ours.update(overflow)
        state = (ours.scale, ours.cur_hysteresis, ours.cur_iter, ours.last_overflow_iter)
        expected = (theirs.cur_scale, theirs.cur_hysteresis, theirs.cur_iter, theirs.last_overflow_iter)
        assert state == expected, f"step {step} ({'overflow' if overflow else 'clean'}): ours {state}, DeepSpeed {expected}"
        scales.append(ours.scale)
    return scales


@settings(max_examples=400, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=80),
    power=st.integers(-3, 16),
    window=st.integers(1, 8),
    hysteresis=st.integers(1, 5),
    consecutive=st.booleans(),
    # Includes minimums above the initial scale (2**-3 .. 2**16) and ones that are not powers
    # of two, where only exact equality with the scale raises.
    min_scale=st.sampled_from([0.125, 0.25, 1.0, 3.0, 16.0, 1000.0, 2.0**17]),
    raise_at_min=st.booleans(),
)
def test_random_sequences_match_deepspeed(
    overflows: list[bool],
    power: int,
    window: int,
    hysteresis: int,
    consecutive: bool,
    min_scale: float,
    raise_at_min: bool,
) -> None:
    ours, theirs = make_pair(
        power=power, window=window, hysteresis=hysteresis, consecutive=consecutive, min_scale=min_scale, raise_at_min=raise_at_min
    )
    drive(ours, theirs, overflows)


@settings(max_examples=200, deadline=None)
@given(
    # Long clean runs between rare overflows: the doubling schedule is what differs most often.
    runs=st.lists(st.tuples(st.integers(0, 25), st.integers(1, 3)), max_size=8),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
)
def test_long_clean_runs_match_deepspeed(runs: list[tuple[int, int]], window: int, hysteresis: int, consecutive: bool) -> None:
    overflows: list[bool] = []
    for clean, bad in runs:
        overflows += [False] * clean + [True] * bad
    ours, theirs = make_pair(power=12, window=window, hysteresis=hysteresis, consecutive=consecutive)
    drive(ours, theirs, overflows)


# DeepSpeed's own unit-test sequences (window 2, hysteresis 1 unless noted).


def test_deepspeed_zero_no_overflow_sequence() -> None:
    # test_zero_optim_overflow / test_dynamic_loss_scale test_no_overflow: power 8, window 2,
    # 10 clean steps; the expected scale doubles after each even cur_iter, so it is 256 after
    # the first two clean steps and doubles on the 3rd, 5th, 7th and 9th.
    ours, theirs = make_pair(power=8, window=2)
    scales = drive(ours, theirs, [False] * 10)
    assert scales[:2] == [256, 256]
    assert scales == [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]


def test_deepspeed_all_overflow_sequence() -> None:
    # test_all_overflow: power 8 (ZeRO variant: power = 8 overflows), hysteresis 1, min 1:
    # every overflow halves, floored at 1, never raising (the scale reaches 1 on the last one).
    ours, theirs = make_pair(power=8, window=2, hysteresis=1)
    assert drive(ours, theirs, [True] * 8) == [128, 64, 32, 16, 8, 4, 2, 1]
    # Unfused variant: power 4, min 2 — the floor holds at 2 from the 3rd overflow on.
    ours, theirs = make_pair(power=4, window=2, hysteresis=1, min_scale=2.0)
    assert drive(ours, theirs, [True] * 3) == [8, 4, 2]


def test_deepspeed_some_overflow_sequence() -> None:
    # test_some_overflow: 2 overflows (256 -> 64), window+1 = 3 clean steps double once (128),
    # one overflow halves again (64).
    ours, theirs = make_pair(power=8, window=2, hysteresis=1)
    assert drive(ours, theirs, [True, True, False, False, False, True]) == [128, 64, 64, 64, 128, 64]


def test_deepspeed_hysteresis_sequences() -> None:
    # TestZeroStage0Hysteresis: hysteresis 3 absorbs two overflows, then each halves.
    ours, theirs = make_pair(power=8, window=1000, hysteresis=3)
    assert drive(ours, theirs, [True] * 4) == [256, 256, 128, 64]
    # consecutive_hysteresis 2: an isolated overflow never lowers the scale.
    ours, theirs = make_pair(power=8, window=1000, hysteresis=2, consecutive=True)
    assert drive(ours, theirs, [True, False] * 4)[-1] == 256


def test_raise_at_minimum_matches_deepspeed() -> None:
    ours, theirs = make_pair(power=2, window=2, hysteresis=1, min_scale=2.0)
    assert drive(ours, theirs, [True, True, True]) == [2]  # the 2nd overflow raises in both


def test_minimum_above_initial_scale_matches_deepspeed() -> None:
    # 2**1 < min 8: no error on the first overflow, lifted to 8; the next one raises.
    ours, theirs = make_pair(power=1, window=2, hysteresis=1, min_scale=8.0)
    assert drive(ours, theirs, [True, True]) == [8]


def test_constructor_defaults_are_deepspeeds() -> None:
    """An ``"fp16"`` section that leaves a key out means DeepSpeed's default for it."""
    import inspect

    from deepspeed.runtime import constants as c

    defaults = {k: p.default for k, p in inspect.signature(DynamicLossScaler).parameters.items()}
    assert defaults["loss_scale"] == c.FP16_LOSS_SCALE_DEFAULT
    assert defaults["initial_scale_power"] == c.FP16_INITIAL_SCALE_POWER_DEFAULT
    assert defaults["loss_scale_window"] == c.FP16_LOSS_SCALE_WINDOW_DEFAULT
    assert defaults["hysteresis"] == c.FP16_HYSTERESIS_DEFAULT
    assert defaults["consecutive_hysteresis"] == c.FP16_CONSECUTIVE_HYSTERESIS_DEFAULT
    assert defaults["min_loss_scale"] == c.FP16_MIN_LOSS_SCALE_DEFAULT
    s = DynamicLossScaler.from_config({"enabled": True})
    assert (
        s.scale,
        s.loss_scale_window,
        s.hysteresis,
        s.cur_hysteresis,
        s.consecutive_hysteresis,
        s.min_loss_scale,
        s.dynamic,
    ) == (2.0**16, 1000, 2, 2, False, 1.0, True)
