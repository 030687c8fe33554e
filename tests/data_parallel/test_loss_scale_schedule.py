"""DynamicLossScaler's schedule vs the rules of docs/reference.md ("fp16 dynamic loss scaling").

Each scenario's expected scales were worked out by hand from the written rules, step by step,
in the comments — not read off the implementation. :func:`reference_scales` restates the rules
in a different form (a counter of clean steps in the current run instead of iteration numbers)
and a Hypothesis test compares the two on random overflow sequences. The rules are DeepSpeed's
(>= 0.17.1); tests/data_parallel/test_loss_scaler_deepspeed.py checks against DeepSpeed itself when installed.
"""

from __future__ import annotations

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.parallel.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError


def run(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """Feed 'o' (overflow) / '.' (clean) steps; return the scale after each."""
    out = []
    for c in pattern:
        scaler.update(c == "o")
        out.append(scaler.scale)
    return out


def test_initial_scale_is_two_to_the_power() -> None:
    assert DynamicLossScaler(initial_scale_power=5).scale == 32.0
    assert DynamicLossScaler().scale == 2.0**16  # default initial_scale_power=16


def reference_scales(
    pattern: str, *, scale: float, window: int, hysteresis: int, consecutive: bool, min_scale: float
) -> list[float | str]:
    """The written rules, step by step; 'raise' where an overflow at the minimum must raise.

    ``run`` counts the clean steps of the current run including this one; training starts as
    if the step before the first had overflowed. A clean step doubles when the steps before it
    in its run are a positive multiple of the window: run lengths W+1, 2W+1, ...
    """
    out: list[float | str] = []
    left, run_len = hysteresis, 0
    for c in pattern:
        if c == "o":
            run_len = 0
            if hysteresis == 1 or left == 1:
                if scale == min_scale:
                    out.append("raise")
                    return out
                scale = max(scale / 2, min_scale)
            else:
                left -= 1
        else:
            run_len += 1
            if consecutive:
                left = hysteresis
            if run_len - 1 >= window and (run_len - 1) % window == 0:
                left, scale = hysteresis, scale * 2
        out.append(scale)
    return out


def run_or_raise(scaler: DynamicLossScaler, pattern: str) -> list[float | str]:
    out: list[float | str] = []
    for c in pattern:
        try:
            scaler.update(c == "o")
        except LossScaleAtMinimumError:
            out.append("raise")
            return out
        out.append(scaler.scale)
    return out


def test_doubles_on_clean_steps_window_plus_one() -> None:
    # window 3: the 1st..3rd clean steps have 0, 1, 2 clean steps before them -> no change; the
    # 4th has 3 -> double (32); the 7th has 6 -> double again (64).
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3)
    assert run(s, ".......") == [16, 16, 16, 32, 32, 32, 64]


def test_window_one_doubles_from_the_second_clean_step() -> None:
    # window 1: the first clean step after an overflow has 0 clean steps before it -> no change.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=1, hysteresis=1)
    assert run(s, "...o..") == [16, 32, 64, 32, 32, 64]


def test_hysteresis_delays_the_halving() -> None:
    # hysteresis 2: first overflow only uses up hysteresis (16 stays), second halves (8).
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    assert run(s, "oo") == [16, 8]
    # hysteresis is now 1 (not refilled without a window doubling): the next overflow halves.
    assert run(s, "o") == [4]


def test_hysteresis_one_halves_immediately() -> None:
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=1)
    assert run(s, "ooo") == [8, 4, 2]


def test_window_counts_from_last_overflow_and_refills_hysteresis() -> None:
    # hysteresis 2, window 2. step0 'o': hyst 2->1, scale 16. steps 1-2 '.': 0 and 1 clean steps
    # before them -> no change. step3 '.': 2 before it -> double to 32, refill hysteresis to 2.
    # step4 'o': hyst 2->1, scale 32 (refilled, so no halving). step5 'o': halve to 16.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert run(s, "o...oo") == [16, 16, 16, 32, 32, 16]


def test_window_two_only_two_clean_steps_after_overflow_does_not_double() -> None:
    # The old (DeepSpeed < 0.17.1) rule doubled here, on the 2nd clean step after the overflow.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert run(s, "o..oo") == [16, 16, 16, 8, 4]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    # With consecutive_hysteresis a clean step between overflows refills hysteresis to 2, so
    # 'o.o.o' never halves; without it the second overflow halves.
    on = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert run(on, "o.o.o") == [16] * 5
    off = DynamicLossScaler(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    assert run(off, "o.o.o") == [16, 16, 8, 8, 4]


def test_min_loss_scale_floor_then_error() -> None:
    # min 4, start 8, hysteresis 1: overflow -> max(8/2, 4) = 4; next overflow at the minimum
    # must raise the error DeepSpeed raises.
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=4)
    assert run(s, "o") == [4]
    with pytest.raises(LossScaleAtMinimumError, match="already at minimum"):
        s.update(True)


def test_min_loss_scale_is_a_floor_not_a_power_of_two() -> None:
    # start 8, min 5: 8/2 = 4 < 5 -> 5.
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=5)
    assert run(s, "o") == [5]


def test_scale_below_minimum_is_raised_to_it_not_an_error() -> None:
    # start 2, min 4 (above the initial scale): 2 != 4 so no error; max(2/2, 4) = 4. Now at the
    # minimum exactly: the next overflow raises.
    s = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=4)
    assert run(s, "o") == [4]
    with pytest.raises(LossScaleAtMinimumError, match="already at minimum"):
        s.update(True)


def test_scale_below_minimum_may_grow_below_it() -> None:
    # start 1, min 8, window 1: clean steps double 1 -> 2 -> 4 (still below the minimum, which
    # only acts on an overflow); the overflow then lifts 4 to max(2, 8) = 8.
    s = DynamicLossScaler(initial_scale_power=0, loss_scale_window=1, hysteresis=1, min_loss_scale=8)
    assert run(s, "...o") == [1, 2, 4, 8]


def test_raise_error_at_min_scale_false_stays_at_minimum() -> None:
    s = DynamicLossScaler(initial_scale_power=3, hysteresis=1, min_loss_scale=4, raise_error_at_min_scale=False)
    assert run(s, "ooo") == [4, 4, 4]


def test_failed_update_leaves_state_unchanged() -> None:
    s = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=2)
    run(s, "o")
    before = s.state_dict()
    with pytest.raises(LossScaleAtMinimumError):
        s.update(True)
    assert s.state_dict() == before


@settings(max_examples=300, deadline=None)
@given(
    pattern=st.text(alphabet="o.", max_size=60),
    power=st.integers(-2, 10),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    min_scale=st.sampled_from([0.25, 1.0, 2.0, 3.0, 64.0, 4096.0]),
)
def test_matches_written_out_rules(
    pattern: str, power: int, window: int, hysteresis: int, consecutive: bool, min_scale: float
) -> None:
    s = DynamicLossScaler(
        initial_scale_power=power,
        loss_scale_window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=min_scale,
    )
    expected = reference_scales(
        pattern, scale=2.0**power, window=window, hysteresis=hysteresis, consecutive=consecutive, min_scale=min_scale
    )
    assert run_or_raise(s, pattern) == expected


def test_static_scale_never_changes() -> None:
    s = DynamicLossScaler(loss_scale=128.0, loss_scale_window=1, hysteresis=1)
    assert run(s, "o.o..oo") == [128.0] * 7
    assert s.state_dict()["cur_iter"] == 7  # steps are still counted (checkpoints record them)


def test_from_config_deepspeed_keys_and_typos() -> None:
    cfg = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 8,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "consecutive_hysteresis": True,
        "min_loss_scale": 2,
    }
    s = DynamicLossScaler.from_config(cfg)
    assert (s.scale, s.loss_scale_window, s.hysteresis, s.consecutive_hysteresis, s.min_loss_scale) == (256.0, 500, 3, True, 2.0)
    with pytest.raises(ValueError, match="loss_scale_windw"):
        DynamicLossScaler.from_config({"loss_scale_windw": 10})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale_window": 0}, "loss_scale_window"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_loss_scale": 0.0}, "min_loss_scale"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


def test_state_dict_round_trip_continues_identically() -> None:
    a = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    run(a, "o..o.")
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert run(a, "...o.oo") == run(b, "...o.oo")


def test_grad_utils_does_not_import_loss_scaler() -> None:
    # One direction only: loss_scaler -> grad_utils (OverflowReport lives in grad_utils).
    import ast
    import importlib.util

    path = importlib.util.find_spec("shardkit.parallel.grad_utils").origin
    tree = ast.parse(open(path).read())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("loss_scaler" in m for m in imported), imported


# ---- scale_loss / unscale_ / expect_unscaled (single process) --------------------------------
def _named_grads(scale: float) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, shape in enumerate([(4,), (3, 5)]):
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        p.grad = torch.randn(shape, generator=g) * scale
        out.append((f"w{i}", p))
    return out


def test_scale_loss_multiplies_by_the_scale_and_backward_sees_it() -> None:
    s = DynamicLossScaler(initial_scale_power=5)
    w = torch.tensor(3.0, requires_grad=True)
    loss = s.scale_loss(w * w)
    assert loss.item() == 9.0 * 32.0
    loss.backward()
    assert w.grad.item() == 6.0 * 32.0  # d(S w²)/dw = 2 S w
    assert DynamicLossScaler(loss_scale=0.5).scale_loss(torch.tensor(4.0)).item() == 2.0  # static


def test_unscale_divides_by_the_scale_and_names_params() -> None:
    s = DynamicLossScaler(initial_scale_power=6)
    named = _named_grads(64.0)
    want = [p.grad / 64.0 for _, p in named]
    report = s.unscale_(named)
    assert not report.overflow
    torch.testing.assert_close([p.grad for _, p in named], want, rtol=0, atol=0)  # 1/64: exact
    assert report.grad_norm == pytest.approx(torch.cat([g.reshape(-1) for g in want]).norm().item(), rel=1e-6)
    named[1][1].grad[2, 1] = float("inf")
    report = s.unscale_(named)
    assert report.overflow and report.nonfinite == []  # names only when asked (a host-side scan)
    assert s.unscale_(named, report_nonfinite=True).nonfinite == ["w1"]  # (name, param) pairs
    named[1][1].grad[2, 1] = float("nan")
    assert s.unscale_([p for _, p in named], report_nonfinite=True).nonfinite == ["param[1]"]  # bare params


def test_constructor_and_unscale_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        DynamicLossScaler(0.0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        DynamicLossScaler().unscale_(_named_grads(1.0), None)  # type: ignore[misc]


def _record_for(named, loss_scale: float):
    from shardkit.parallel.grad_utils import UnscaledGrads

    grads = {id(p): (p, p.grad, p.grad._version) for _, p in named}
    sumsq = torch.cat([p.grad.reshape(-1) for _, p in named]).square().sum().reshape(1)
    return UnscaledGrads(loss_scale, grads, torch.zeros(1), sumsq)


def test_expect_unscaled_is_used_once_and_must_match_the_scale() -> None:
    """A record at the current scale: unscale_ leaves those grads alone, once (the next call
    unscales again). A record at another scale raises; update() and load_state_dict drop it."""
    s = DynamicLossScaler(initial_scale_power=3)
    named = _named_grads(1.0)
    before = [p.grad.clone() for _, p in named]
    s.expect_unscaled(_record_for(named, 8.0))
    s.unscale_(named)
    assert all(torch.equal(p.grad, b) for (_, p), b in zip(named, before))
    s.unscale_(named)  # consumed: this one divides by S
    torch.testing.assert_close([p.grad for _, p in named], [b / 8.0 for b in before], rtol=0, atol=0)
    s.expect_unscaled(_record_for(named, 16.0))
    with pytest.raises(RuntimeError, match="loss scale 16.0, but the scale is now 8.0"):
        s.unscale_(named)
    for drop in (lambda: s.update(False), lambda: s.load_state_dict(s.state_dict())):
        s.expect_unscaled(_record_for(named, 16.0))
        drop()
        s.unscale_(named)  # no stale record: no error
