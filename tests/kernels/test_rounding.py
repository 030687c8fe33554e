"""Every interpreted kernel store of fp16/bf16 rounds like torch: to nearest, ties to even.

Triton 3.9's interpreter truncates fp32 -> bf16; the kernels round explicitly
(``shardkit.kernels.tl_helpers.round_to``). Each test feeds fp32 values chosen to hit every
rounding case — exact ties with an even and an odd kept bit, one ulp either side of a tie,
subnormals of fp32 and of the target, the largest finite values and the first that overflow,
±0, ±inf, NaN — plus random bit patterns, and compares the kernel's output *bitwise* with torch's
``.to(dtype)`` of the same fp32 values. NaN payloads are not compared (torch itself writes
0xFFFF, 0x7FC0 or 0x7FFF for a bf16 NaN depending on the code path and device): a NaN must stay a
NaN.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels.adam import adam_step
from shardkit.kernels.flatten import flatten_into, unflatten_from
from shardkit.kernels.grad_epilogue import unscale_and_norm_
from shardkit.kernels.lamb import lamb_step
from shardkit.kernels.lion import lion_step
from shardkit.kernels.sgd import sgd_step

LOWP = [torch.bfloat16, torch.float16]


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def special_values(dtype: torch.dtype, *, finite_only: bool = False) -> torch.Tensor:
    """fp32 values exercising every rounding case of fp32 -> ``dtype``, both signs."""
    if dtype == torch.bfloat16:  # bf16 keeps the top 16 bits of fp32
        base = [0x3F800000, 0x3F810000, 0x00010000, 0x7F7F0000, 0x7F7E0000, 0x00000000]
        ulp_half = 0x8000
    else:  # fp16: 10 mantissa bits kept of 23 -> 13 dropped
        base = [0x3F800000, 0x3F802000, 0x38800000, 0x477FE000, 0x477FC000, 0x33800000, 0x33000000]
        ulp_half = 0x1000
    bits = []
    for b in base:  # exact, ties (even and odd kept bit), one ulp either side of the tie
        bits += [b, b + ulp_half, b + ulp_half - 1, b + ulp_half + 1, b + 2 * ulp_half + ulp_half]
    bits += [0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x00000001, 0x007FFFFF, 0x00400000]  # max, subnormals
    if dtype == torch.float16:  # around fp16's largest finite (65504) and its subnormal range
        bits += [0x477FEFFF, 0x477FF000, 0x477FF001, 0x33C00000, 0x337FFFFF, 0x387FE000, 0x387FF000]
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([_from_bits(bits), torch.randn(200, generator=gen) * 2.0 ** torch.randint(-30, 30, (200,))])
    values = torch.cat([values, -values])
    if not finite_only:
        values = torch.cat([values, torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])])
    return values[torch.isfinite(values)] if finite_only else values


def assert_bitwise_rounded(actual: torch.Tensor, fp32: torch.Tensor) -> None:
    """``actual`` equals ``fp32.to(actual.dtype)`` bit for bit; NaN only needs to stay NaN."""
    expected = fp32.to(actual.dtype)
    nan = torch.isnan(fp32)
    assert torch.equal(torch.isnan(actual), nan), "NaN created or lost"
    a, e = actual[~nan].view(torch.int16), expected[~nan].view(torch.int16)
    bad = a != e
    assert not bool(bad.any()), (
        f"{int(bad.sum())} values misrounded, e.g. fp32 {fp32[~nan][bad][:4].tolist()}: "
        f"got {actual[~nan][bad][:4].tolist()}, expected {expected[~nan][bad][:4].tolist()}"
    )


@pytest.mark.parametrize("dtype", LOWP)
def test_special_values_cover_ties(dtype: torch.dtype) -> None:
    """The inputs really contain ties that truncation would get wrong (the test can fail)."""
    x = special_values(dtype, finite_only=True)
    shift = 16 if dtype == torch.bfloat16 else 13
    dropped = x.view(torch.int32) & ((1 << shift) - 1)
    assert bool((dropped == 1 << (shift - 1)).any()), "no exact ties"
    if dtype == torch.bfloat16:
        truncated = (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        assert not torch.equal(truncated, x.to(dtype))


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("scale", [None, 1.0])
def test_flatten_casting_copy_rounds_to_nearest_even(dtype: torch.dtype, scale: float | None) -> None:
    x = special_values(dtype)
    flat = torch.zeros(x.numel(), dtype=dtype)
    flatten_into([x], flat, [0], scale=scale, backend="triton")
    assert_bitwise_rounded(flat, x)
    back = torch.empty(x.numel(), dtype=dtype)
    unflatten_from(x, [back], [0], scale=scale, backend="triton")
    assert_bitwise_rounded(back, x)


@pytest.mark.parametrize("dtype", LOWP)
def test_grad_epilogue_out_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    g = special_values(dtype)
    out = torch.empty(g.numel(), dtype=dtype)
    unscale_and_norm_([g], inv_scale=1.0, out=[out], backend="triton")
    assert_bitwise_rounded(out, g)


def _step(name: str, param: torch.Tensor, master: torch.Tensor) -> None:
    """One step with lr=0 and no decay: the master is unchanged, the param becomes its rounding."""
    grad = torch.ones_like(param)
    state = [torch.zeros_like(master)]
    if name == "adam":
        adam_step(
            [param],
            [grad],
            state,
            [torch.zeros_like(master)],
            [],
            [master],
            step=1,
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            decoupled=True,
            amsgrad=False,
            maximize=False,
            backend="triton",
        )
    elif name == "sgd":
        sgd_step(
            [param],
            [grad],
            state,
            [master],
            lr=0.0,
            momentum=0.9,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
            first_step=True,
            backend="triton",
        )
    elif name == "lion":
        lion_step(
            [param], [grad], state, [master], lr=0.0, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False, backend="triton"
        )
    else:
        lamb_step(
            [param],
            [grad],
            state,
            [torch.zeros_like(master)],
            [master],
            step=1,
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.0,
            adapt=name == "lamb",
            backend="triton",
        )


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("name", ["adam", "sgd", "lion", "lamb", "lamb_unadapted"])
def test_optimizer_param_is_master_rounded_to_nearest_even(name: str, dtype: torch.dtype) -> None:
    # SGD and LAMB add wd * w to the update even at wd = 0: 0 * inf is NaN, so finite masters there
    master = special_values(dtype, finite_only=name.startswith("lamb") or name == "sgd")
    if name == "lamb":  # ||w||^2 must stay finite too, or the trust ratio is inf and lr * trust NaN
        master = master[master.abs() < 1e15]
    expected_master = master.clone()
    param = torch.zeros(master.numel(), dtype=dtype)
    _step(name, param, master)
    # arithmetic may quiet a signalling NaN; every other value must keep its bits
    keep = ~torch.isnan(expected_master)
    assert torch.equal(torch.isnan(master), ~keep), "lr=0 created or lost a NaN"
    assert torch.equal(master[keep].view(torch.int32), expected_master[keep].view(torch.int32)), "lr=0 moved it"
    assert_bitwise_rounded(param, master)


@pytest.mark.parametrize("dtype", LOWP)
def test_adam_lowp_state_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    """Without a master, the moments are computed in fp32 and stored rounded."""
    gen = torch.Generator().manual_seed(1)
    g32 = torch.randn(5000, generator=gen)
    m32 = torch.randn(5000, generator=gen).to(dtype).float()
    # beta1 = 0.75: both products are exact, so the only roundings are the fp32 sum (the same in
    # torch and the kernel) and the store; sums of few-bit values hit many exact ties.
    expected = 0.75 * m32 + 0.25 * g32.to(dtype).float()
    param, m = torch.zeros(5000, dtype=dtype), m32.to(dtype)
    adam_step(
        [param],
        [g32.to(dtype)],
        [m],
        [torch.zeros_like(m)],
        [],
        [],
        step=1,
        lr=0.0,
        beta1=0.75,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        decoupled=True,
        amsgrad=False,
        maximize=False,
        backend="triton",
    )
    assert_bitwise_rounded(m, expected)
