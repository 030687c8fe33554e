"""DynamicLossScaler's schedule vs the rules of REFERENCE.md ("fp16 dynamic loss scaling").

Each scenario's expected scales were worked out by hand from the written rules, step by step,
in the comments — not read off the implementation.
"""

from __future__ import annotations

import pytest

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


def test_doubles_every_window_of_clean_steps() -> None:
    # window 3: clean steps since last overflow 1,2,3 -> double at the 3rd, again at the 6th.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3)
    assert run(s, "......") == [16, 16, 32, 32, 32, 64]


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
    # hysteresis 2, window 2. step0 'o': hyst 2->1, scale 16. step1 '.': 1 clean step since the
    # overflow -> no change. step2 '.': 2 clean -> double to 32 and refill hysteresis to 2.
    # step3 'o': hyst 2->1, scale 32 (refilled, so no halving). step4 'o': halve to 16.
    s = DynamicLossScaler(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert run(s, "o..oo") == [16, 16, 32, 32, 16]


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


def test_static_scale_never_changes() -> None:
    s = DynamicLossScaler(loss_scale=128.0, loss_scale_window=1, hysteresis=1)
    assert run(s, "o.o..oo") == [128.0] * 7


def test_from_config_deepspeed_keys_and_typos() -> None:
    cfg = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 500,
           "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2}  # fmt: skip
    s = DynamicLossScaler.from_config(cfg)
    assert (s.scale, s.loss_scale_window, s.hysteresis, s.consecutive_hysteresis, s.min_loss_scale) == (
        256.0, 500, 3, True, 2.0)  # fmt: skip
    with pytest.raises(ValueError, match="loss_scale_windw"):
        DynamicLossScaler.from_config({"loss_scale_windw": 10})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"loss_scale": -1.0}, "loss_scale"), ({"loss_scale_window": 0}, "loss_scale_window"),
     ({"hysteresis": 0}, "hysteresis"), ({"min_loss_scale": 0.0}, "min_loss_scale")],
)  # fmt: skip
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


def test_state_dict_round_trip_continues_identically() -> None:
    a = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    run(a, "o..o.")
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert run(a, "...o.oo") == run(b, "...o.oo")
