"""Another order of additions for every cross-rank sum: the guard behind docs/testing.md's tolerance rule.

A distributed equality test compares training on several ranks with one process training on the
whole batch. The two add the same numbers in a different order (each rank's partial sum, then the
sum over ranks), so their results differ in the last bits, and which bits differ depends on the
CPU's kernels and the collective's algorithm. A tolerance that passes on one machine only by luck
fails on another. This module makes that spread large and random on purpose: with
``SHARDKIT_TEST_REDUCTION_ORDER=perturb`` in the environment, every worker of the test harness
(``tests/distributed.py``) replaces each floating-point sum over ranks by a value anywhere within
the bound that some order of the same additions could give,

    |s' - s| <= n * u * sum_r |x_r|        (n ranks, u = half an ulp of 1.0 in the dtype),

that is the classic bound for adding n terms in any order, ``(n - 1) u sum |x_r|``, plus one more
rounding of each rank's own partial sum (which the batch split reorders too). Each element moves
by ``bound * h``, ``h`` in [-1, 1) a hash of the sum's bits and the element's position: the same
on every rank (an all-reduce's replicas stay identical, as a real one keeps them) and the same
in two runs that form the same sums (bitwise comparisons of offload vs on-device, or of a
reloaded checkpoint, stay bitwise, as under one deterministic order). Zeros summed with zeros stay
zero, so "no gradient" stays exact.

Tests marked ``@pytest.mark.reduction_order`` must pass under it: ``make test`` runs them a second
time with the variable set. A test that passes normally and fails here has a tolerance below what
another machine's order of additions can move; see "Choosing a tolerance" in docs/testing.md.

Only the harness's own gloo workers are patched, and only ``torch.distributed.all_reduce`` and
``reduce_scatter_single`` (shardkit's collectives go through exactly these, see
``comm/collectives.py``); max/min reductions and integer tensors are left alone. Each patched call
completes before it returns (the noise needs the sum), so overlap is lost, not correctness.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ENV", "perturb_reductions", "perturb_reductions_if_requested", "reduction_bound"]

#: the environment variable that turns the perturbation on in the harness's workers
ENV = "SHARDKIT_TEST_REDUCTION_ORDER"


def reduction_bound(abs_sum: torch.Tensor, n: int) -> torch.Tensor:
    """``n * u * sum_r |x_r|``: how far another order of the same additions can move a sum.

    Args:
        abs_sum: ``sum_r |x_r|`` per element (any shape, floating dtype), formed exactly enough
            (the bound's own rounding is irrelevant at this scale).
        n: number of ranks summed.

    Returns:
        The bound, fp32 (or fp64 for fp64 input), same shape as ``abs_sum``.

    Example:
        >>> reduction_bound(torch.tensor([1.0]), 4)   # 4 * 2**-24
        tensor([2.3842e-07])
    """
    u = torch.finfo(abs_sum.dtype).eps / 2
    return abs_sum.to(torch.promote_types(abs_sum.dtype, torch.float32)) * (n * u)


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _unit_noise(values: torch.Tensor, offset: int) -> torch.Tensor:
    """A number in [-1, 1) per element, a hash of the element's bits and its flat index.

    A function of the value, not of a call counter: two runs that form the same sums (offload vs
    on-device, a reloaded checkpoint) get the same perturbation and stay bitwise equal, as two
    runs of one deterministic reduction order would.
    """
    flat = values.detach().reshape(-1)
    bits = flat.view(_INT_OF[flat.element_size()]).to(torch.int64) & 0xFFFF_FFFF
    idx = torch.arange(offset, offset + flat.numel(), dtype=torch.int64)
    h = (bits * 0x9E37_79B1 + idx * 0x85EB_CA77 + 0x1656_67B1) & 0xFFFF_FFFF
    for shift, mul in ((16, 0x7FEB_352D), (15, 0x846C_A68B), (16, 1)):  # a 32-bit integer mixer
        h = ((h ^ (h >> shift)) * mul) & 0xFFFF_FFFF
    return (h.to(torch.float64) / 2.0**31 - 1.0).view(values.shape)


class _Perturber:
    """The patched collectives: the originals, and the noise applied after each sum."""

    def __init__(self, all_reduce: Callable[..., Any], reduce_scatter_single: Callable[..., Any]) -> None:
        self.all_reduce = all_reduce
        self.reduce_scatter_single = reduce_scatter_single

    @staticmethod
    def _is_sum(op: Any) -> bool:
        return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or op is None

    @staticmethod
    def _perturb(result: torch.Tensor, abs_sum: torch.Tensor, n: int, offset: int) -> None:
        noise = reduction_bound(abs_sum, n).double() * _unit_noise(result, offset)
        result.copy_((result.double() + noise.view_as(result)).to(result.dtype))

    def patched_all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        if not (tensor.is_floating_point() and self._is_sum(op)) or tensor.numel() == 0:
            return self.all_reduce(tensor, op=op, group=group, async_op=async_op)
        n = dist.get_world_size(group)
        abs_sum = tensor.detach().abs().float()
        work = self.all_reduce(tensor, op=op, group=group, async_op=True)
        work.wait()
        self.all_reduce(abs_sum, op=dist.ReduceOp.SUM, group=group)
        if op == dist.ReduceOp.AVG:
            abs_sum.div_(n)
        self._perturb(tensor, abs_sum, n, 0)
        return work if async_op else None

    def patched_reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if not (output.is_floating_point() and self._is_sum(op)) or output.numel() == 0:
            return self.reduce_scatter_single(output, input, op, group, async_op)
        n = dist.get_world_size(group)
        abs_in = input.detach().abs().float()
        abs_out = torch.empty(output.shape, dtype=torch.float32)
        work = self.reduce_scatter_single(output, input, op, group, True)
        work.wait()
        self.reduce_scatter_single(abs_out, abs_in, dist.ReduceOp.SUM, group, False)
        if op == dist.ReduceOp.AVG:
            abs_out.div_(n)
        self._perturb(output, abs_out, n, dist.get_rank(group) * output.numel())
        return work if async_op else None


def perturb_reductions() -> Callable[[], None]:
    """Patch ``torch.distributed``'s sums in this process; returns the function that undoes it.

    Example:
        >>> undo = perturb_reductions()
        >>> dist.all_reduce(x)            # x: the sum, moved within reduction_bound
        >>> undo()
    """
    p = _Perturber(dist.all_reduce, dist.reduce_scatter_single)
    dist.all_reduce = p.patched_all_reduce
    dist.reduce_scatter_single = p.patched_reduce_scatter_single

    def undo() -> None:
        dist.all_reduce = p.all_reduce
        dist.reduce_scatter_single = p.reduce_scatter_single

    return undo


def perturb_reductions_if_requested() -> bool:
    """In a harness worker: :func:`perturb_reductions` when ``ENV`` is ``perturb``; True if it did."""
    mode = os.environ.get(ENV, "")
    if mode == "":
        return False
    if mode != "perturb":
        raise ValueError(f"{ENV} must be 'perturb' or unset, got {mode!r}")
    perturb_reductions()
    return True
