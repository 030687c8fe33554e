"""Per-dtype tolerances for the test suite: the one shared place (see STYLE.md §5).

Each entry is a ``dict(rtol=..., atol=...)`` for ``torch.testing.assert_close``. Anything looser
than :data:`FP32` says why next to it.
"""

from __future__ import annotations

import torch

#: fp32 vs fp32, including multi-step training of a small model against ``torch.optim``. The
#: kernels and torch evaluate the same formula in a different order (FMA contraction, ``a/b/c``
#: vs ``a/(b*c)``): ~1 ulp (6e-8 relative) per op per step, and ~10 steps of training feed those
#: differences back through the gradients. 1e-5 leaves two orders of magnitude of margin while
#: still catching any real semantic error (a wrong bias correction or decay is >1e-4 after one
#: step at the learning rates the tests use).
FP32 = dict(rtol=1e-5, atol=1e-5)

#: Adam/AdamW's ``eps`` for a test that compares training across a change of the order of
#: additions (dp/tp/pp split vs one process; see "Choosing a tolerance" in docs/testing.md). Adam
#: moves a param by ``lr * m_hat / (sqrt(v_hat) + eps)``; at the first step that is
#: ``lr * g / (|g| + eps)``, whose derivative in ``g`` is ``lr * eps / (|g| + eps)**2 <= lr / eps``.
#: With torch's default ``eps=1e-8`` and ``lr=1e-2``, a gradient that another order of additions
#: moves by 5e-11 can move the param by 5e-5 (seen on another CPU: 4.9e-5 at dp 4), whatever
#: tolerance the test picks. With ``eps >= lr`` (this value, for the tests' ``lr <= 1e-2``) the
#: param moves by at most about the gradient's own spread per step, far below :data:`FP32`, while a
#: wrong bias correction, decay or group setting still moves it by > 1e-4.
ADAM_EPS_ACROSS_ORDERS = 1e-2

#: The fp32 *master* copy of an fp16/bf16 param vs an fp32 reference fed the same (rounded)
#: gradients: the master follows the fp32 math exactly, so this is :data:`FP32`.
MASTER = FP32

#: The spacing of fp16/bf16 values: a dtype with s significant bits (bf16: 8, fp16: 11) has an
#: ulp of 2^(1-s) relative to values just above a power of two, its worst case: 2^-7 for bf16,
#: 2^-10 for fp16. Round-to-nearest costs at most half of that.

#: An fp16/bf16 param (kept with an fp32 master) vs the fp32 reference: the param is the master
#: rounded once, to nearest, to its dtype (compiled kernels, torch, and the interpreted kernels,
#: which round explicitly: see :func:`assert_rounded_from`), plus the master's own FP32 error: half
#: an ulp, 2^-8 for bf16 and 2^-11 for fp16, + 1e-5. atol covers values near zero, where a
#: relative bound is meaningless.
ROUNDED_PARAM = {
    torch.bfloat16: dict(rtol=2.0**-8 + FP32["rtol"], atol=FP32["atol"]),
    torch.float16: dict(rtol=2.0**-11 + FP32["rtol"], atol=FP32["atol"]),
}

#: fp16/bf16 params and state *without* a master copy, Triton kernel vs the torch fast path,
#: one step from identical state (there is no fp32 reference for this mode: dropping sub-ulp
#: updates is its point). Both compute in fp32 and round every stored tensor to nearest, but the
#: kernel's fp32 math runs in a different order (FMA contraction, another association), so an fp32
#: value a few ulp away can round to the neighbouring fp16/bf16 value: one worst-case ulp (2^-7
#: bf16, 2^-10 fp16). atol covers values
#: near zero, whose ulp is tiny while the fp32 update's own rounding is not.
LOWP_NO_MASTER = {
    torch.bfloat16: dict(rtol=2.0**-7, atol=1e-5),
    torch.float16: dict(rtol=2.0**-10, atol=1e-5),
}

#: LAMB without a master copy computes its update from the moments *as stored* (rounded), so the
#: one-ulp difference of :data:`LOWP_NO_MASTER` in ``m`` (and ``v``, halved by the sqrt) moves
#: ``u`` in the same step by up to 1.5 ulp relative, and the trust ratio ``phi/||u||`` by as much
#: again: under 2^-5 of the update for bf16 (3 x 2^-7), 2^-8 for fp16 (3 x 2^-10). The other
#: optimizers update from fp32 values and need no such term.
LAMB_LOWP_UPDATE_RTOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def rounded_param(dtype: torch.dtype) -> dict[str, float]:
    """Tolerance of an fp16/bf16 param (with an fp32 master) vs the fp32 reference."""
    return ROUNDED_PARAM[dtype]


def lowp_no_master(dtype: torch.dtype) -> dict[str, float]:
    """Tolerance of Triton vs torch backend for fp16/bf16 state without a master copy."""
    return LOWP_NO_MASTER[dtype]


def assert_lowp_step_close(
    actual: torch.Tensor, expected: torch.Tensor, before: torch.Tensor | None = None, *, update_rtol: float = 0.0
) -> None:
    """One fp16/bf16 step without a master copy: ``actual`` vs ``expected``, both from ``before``.

    Elementwise ``|actual - expected| <= atol + rtol * |expected| + update_rtol * |expected - before|``
    with :data:`LOWP_NO_MASTER`'s ``rtol``/``atol``; ``update_rtol`` is
    :data:`LAMB_LOWP_UPDATE_RTOL` for LAMB, else 0.
    """
    tol = LOWP_NO_MASTER[expected.dtype]
    a, e = actual.float(), expected.float()
    b = e if before is None else before.float()
    bound = tol["atol"] + tol["rtol"] * e.abs() + update_rtol * (e - b).abs()
    bad = (a - e).abs() > bound
    assert not bool(bad.any()), (
        f"{int(bad.sum())}/{bad.numel()} elements differ; worst: actual {a[bad][:4].tolist()}, "
        f"expected {e[bad][:4].tolist()}, before {b[bad][:4].tolist()}"
    )


def assert_rounded_from(param: torch.Tensor, master: torch.Tensor, *, interpreted: bool = False) -> None:
    """Assert that the fp16/bf16 ``param`` is its fp32 ``master`` rounded to nearest, ties to even.

    Exact equality with ``master.to(param.dtype)`` (torch's rounding) for every executor: compiled
    kernels round to nearest even natively, and the interpreted ones explicitly
    (``shardkit.kernels.tl_helpers.round_to``: Triton 3.9's interpreter alone would truncate
    fp32 -> bf16). ``interpreted`` is accepted for existing callers and changes nothing.
    """
    del interpreted
    assert torch.equal(param, master.to(param.dtype)), "param is not master rounded to nearest even"
