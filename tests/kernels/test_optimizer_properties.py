"""Hypothesis property tests of the fused optimizers.

For random shapes (0-d, 0 and 1 element, odd sizes, more elements than the kernel's BLOCK), dtypes
(fp32, and fp16/bf16 with and without fp32 master weights), grad dtypes, hyper-parameters and
numbers of tensors, the Triton kernel (interpreted) and the torch fast path agree with each other
and with an fp32 reference (``torch.optim`` or the written-out references in
``test_fused_optimizers_match_torch.py``).

Interpreter cost is per program instance, so tensors stay small; "more elements than BLOCK" is
reached by drawing a small BLOCK for the launch-config function (patched where the launcher
looks it up), which also exercises LAMB's cross-program norm accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardkit.kernels.adam as adam_kernels
import shardkit.kernels.lamb as lamb_kernels
import shardkit.kernels.lion as lion_kernels
import shardkit.kernels.sgd as sgd_kernels
from optimizer_cases import PAIRS
from tolerances import (
    FP32,
    LAMB_LOWP_UPDATE_RTOL,
    MASTER,
    assert_lowp_step_close,
    assert_rounded_from,
    rounded_param,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: where each optimizer's launcher looks up its launch config
LAUNCH_CONFIG = {
    "adam": (adam_kernels, "adam_launch_config"),
    "adamw": (adam_kernels, "adam_launch_config"),
    "sgd": (sgd_kernels, "sgd_launch_config"),
    "lion": (lion_kernels, "lion_launch_config"),
    "lamb": (lamb_kernels, "lamb_launch_config"),
}

# Lion's update is sign(b1 * m + (1 - b1) * g): where that sum cancels to within an fp32 ulp, two
# correct implementations that round in a different order can disagree on the sign and move a
# weight by 2 * lr. Drawing betas from dyadic fractions and grads from a coarse dyadic grid makes
# every m and c exact in fp32 (and bf16/fp16) for the few steps we take, so the sign is exact and
# the comparison cannot flake; the fp32 training tests cover arbitrary betas and real grads.
_DYADIC_BETAS = st.sampled_from([0.0, 0.5, 0.75, 0.875, 0.9375])

HYPER: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "adam": st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 0.1),
            "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.999)),
            "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
            "weight_decay": st.sampled_from([0.0, 0.01, 0.3]),
            "amsgrad": st.booleans(),
            "maximize": st.booleans(),
        }
    ),
    "sgd": st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 0.5),
            "momentum": st.sampled_from([0.0, 0.5, 0.9]),
            "dampening": st.sampled_from([0.0, 0.3]),
            "nesterov": st.booleans(),
            "weight_decay": st.sampled_from([0.0, 0.01, 0.3]),
            "maximize": st.booleans(),
        }
    ).map(lambda kw: kw if not kw["nesterov"] else dict(kw, momentum=kw["momentum"] or 0.9, dampening=0.0)),
    "lion": st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 1e-2),
            "betas": st.tuples(_DYADIC_BETAS, _DYADIC_BETAS),
            "weight_decay": st.sampled_from([0.0, 0.1, 1.0]),
            "maximize": st.booleans(),
        }
    ),
    "lamb": st.fixed_dictionaries(
        {
            "lr": st.floats(1e-4, 0.05),
            "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.5, 0.999)),
            "eps": st.sampled_from([1e-6, 1e-3]),
            "weight_decay": st.sampled_from([0.0, 0.01, 0.3]),
            "bias_correction": st.booleans(),
            "always_adapt": st.booleans(),
            "weight_norm_clip": st.sampled_from([(0.0, 10.0), (0.0, float("inf")), (0.5, 2.0)]),
            "max_trust_ratio": st.sampled_from([None, 1.0, 5.0]),
            "maximize": st.booleans(),
        }
    ),
}
HYPER["adamw"] = HYPER["adam"]

#: 0-d, 0/1/odd-element 1-d, and small 2-d shapes (incl. empty ones)
SHAPE = st.one_of(
    st.just(()),
    st.tuples(st.sampled_from([0, 1, 2, 15, 16, 17, 63, 65, 129])),
    st.tuples(st.integers(0, 150)),
    st.tuples(st.integers(0, 11), st.integers(0, 11)),
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def block_size(name: str, block: int | None) -> Iterator[None]:
    """Force the kernel's BLOCK (``None``: the launcher's own choice)."""
    if block is None:
        yield
        return
    module, attr = LAUNCH_CONFIG[name]
    with mock.patch.object(module, attr, lambda device, max_numel: (block, 4)):
        yield


def make_grads(name: str, shapes: list[tuple[int, ...]], steps: int, seed: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    if name == "lion":  # k / 16, |k| <= 64: exact in bf16/fp16 (see _DYADIC_BETAS)
        draw = lambda s: torch.randint(-64, 65, s, generator=gen).float() / 16  # noqa: E731
    else:
        draw = lambda s: torch.randn(s, generator=gen)  # noqa: E731
    return [[draw(s).to(dtype) for s in shapes] for _ in range(steps)]


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        if g.dtype != p.dtype:
            p.grad_dtype = g.dtype  # torch checks grad dtypes; e.g. fp32 grads for bf16 params
        p.grad = g.clone()


@pytest.mark.parametrize("name", list(PAIRS))
@SETTINGS
@given(data=st.data())
def test_backends_agree_with_each_other_and_the_reference(name: str, data: st.DataObject) -> None:
    fused_cls, ref_cls = PAIRS[name]
    kw = data.draw(HYPER[name], label="hyper")
    shapes = data.draw(st.lists(SHAPE, min_size=1, max_size=4), label="shapes")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    master = dtype != torch.float32 and data.draw(st.booleans(), label="master_weights")
    grad_dtype = data.draw(st.sampled_from([dtype, torch.float32]), label="grad_dtype")
    steps = data.draw(st.integers(1, 3), label="steps")
    block = data.draw(st.sampled_from([None, 32, 64]), label="block")
    seed = data.draw(st.integers(0, 2**16), label="seed")

    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = make_grads(name, shapes, steps, seed + 1, grad_dtype)
    runs = {}
    for backend in ("triton", "torch"):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = fused_cls(params, master_weights=master, backend=backend, **kw)
        runs[backend] = (params, opt)

    if dtype != torch.float32 and not master:
        # No fp32 copy: each step rounds params and state to fp16/bf16. The two backends round
        # differently-ordered fp32 results, so compare them one step at a time from identical state.
        (tri, tri_opt), (tor, tor_opt) = runs["triton"], runs["torch"]
        update_rtol = LAMB_LOWP_UPDATE_RTOL[dtype] if name == "lamb" else 0.0
        for step_grads in grads:
            before = [p.detach().clone() for p in tor]
            set_grads(tri, step_grads)
            set_grads(tor, step_grads)
            with block_size(name, block):
                tri_opt.step()
            tor_opt.step()
            for p, q, b in zip(tri, tor, before):
                assert_lowp_step_close(p.detach(), q.detach(), b, update_rtol=update_rtol)
                for key, value in tri_opt.state[p].items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        assert value.dtype == dtype
                        assert_lowp_step_close(value, tor_opt.state[q][key])
                        tor_opt.state[q][key].copy_(value)  # continue from identical state
                q.detach().copy_(p.detach())
        return

    ref = [nn.Parameter(t.float()) for t in init]
    ref_opt = ref_cls(ref, **kw)
    for step_grads in grads:
        set_grads(ref, [g.float() for g in step_grads])
        ref_opt.step()
        for backend, (params, opt) in runs.items():
            set_grads(params, step_grads)
            with block_size(name, block if backend == "triton" else None):
                opt.step()
    for backend, (params, opt) in runs.items():
        for p, r in zip(params, ref):
            if dtype == torch.float32:
                assert_close(p.detach(), r.detach(), **FP32)
                continue
            master_param = opt.state[p]["master_param"]
            assert master_param.dtype == torch.float32
            assert_close(master_param, r.detach(), **MASTER)
            assert_rounded_from(p.detach(), master_param, interpreted=backend == "triton")
            assert_close(p.detach().float(), r.detach(), **rounded_param(dtype))
    (tri, tri_opt), (tor, tor_opt) = runs["triton"], runs["torch"]
    for p, q in zip(tri, tor):
        assert tri_opt.state[p].keys() == tor_opt.state[q].keys()
        for key, value in tri_opt.state[p].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == tor_opt.state[q][key].dtype
                assert_close(value.float(), tor_opt.state[q][key].float(), **FP32)
