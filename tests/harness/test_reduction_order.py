"""The reduction-order guard itself (``tests/reduction_order.py``): it must move sums, within the bound.

The guard is only worth something if it really perturbs shardkit's collectives and stays inside
what another order of additions could give; these tests pin both, against gloo's own sums of the
same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reduction_order import ENV, perturb_reductions, perturb_reductions_if_requested, reduction_bound
from shardkit.comm import ParallelContext, all_reduce, reduce_scatter


def _rank_input(rank: int, n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    x[:8] = 0.0  # zeros on every rank: their sum must stay exactly zero
    return x


def _perturbed_sums(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = ParallelContext.from_world()
    world, rank, group = ctx.world_size, ctx.global_rank, ctx.group("dp")
    bound = reduction_bound(sum(_rank_input(r, n).float().abs() for r in range(world)), world).double()
    plain = _rank_input(rank, n).float()
    all_reduce(plain, group=group, op="sum")  # gloo's own order, unperturbed
    undo = perturb_reductions()
    try:
        summed = _rank_input(rank, n).float()
        all_reduce(summed, group=group, op="sum")
        again = _rank_input(rank, n).float()
        all_reduce(again, group=group, op="sum")
        avg = _rank_input(rank, n).float()
        all_reduce(avg, group=group, op="avg")
        chunk = torch.empty(n // world)
        reduce_scatter(chunk, _rank_input(rank, n).float(), group=group)
        flags = torch.tensor([float(rank)])
        all_reduce(flags, group=group, op="max")  # max is order-free: left alone
    finally:
        undo()
    assert dist.all_reduce.__qualname__ == "all_reduce"  # undo restored torch's function
    half_ulp = plain.double().abs() * 2.0**-24  # the perturbed value's own rounding to fp32
    moved = (summed.double() - plain.double()).abs()
    assert bool((moved <= bound + half_ulp).all()), float((moved - bound).max())
    assert int((moved > 0).sum()) > n // 2, "the guard did not move the sums"
    assert bool((summed[:8] == 0).all())
    assert torch.equal(again, summed), "the same sums must get the same perturbation (bitwise tests stay bitwise)"
    own = slice(rank * (n // world), (rank + 1) * (n // world))
    assert bool(((chunk.double() - plain[own].double()).abs() <= bound[own] + half_ulp[own]).all())
    assert bool(((avg.double() - plain.double() / world).abs() <= (bound + half_ulp) / world * 1.5).all())
    assert float(flags) == world - 1
    ctx.destroy()
    return summed, chunk


@pytest.mark.parametrize("world_size", [2, 4])
def test_guard_moves_every_sum_within_the_order_bound(dist_pool, world_size: int) -> None:
    results = dist_pool.run(_perturbed_sums, 4096, world_size=world_size, timeout=60)
    first = results[0][0]
    assert all(torch.equal(s, first) for s, _ in results), "an all-reduce's replicas must stay identical"


def test_guard_is_off_unless_asked_and_rejects_other_values(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert perturb_reductions_if_requested() is False
    monkeypatch.setenv(ENV, "reverse")
    with pytest.raises(ValueError, match=ENV):
        perturb_reductions_if_requested()


def test_bound_is_n_half_ulps_of_the_absolute_sum() -> None:
    torch.testing.assert_close(reduction_bound(torch.tensor([1.0, 3.0]), 4), torch.tensor([4.0, 12.0]) * 2.0**-24)
