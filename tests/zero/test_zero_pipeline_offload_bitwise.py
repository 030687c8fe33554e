"""ZeRO under a pipeline with offload (parallelize(dp="zero2", pp=...)).

``offload="cpu"`` claims results bitwise those of the device optimizer (docs/offload.md); the
pipeline tests only ran without offload. Here dp 2 x pp 2 with a tied embedding (a cross-stage
tie: one copy's squares left out of the norm) and optionally frozen parameters inside a stage
trains three AdamW steps both ways: the clipped global norms and every parameter must be equal
bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from parallelize_cases import B, lm_batches, tiny_gpt


def _zero2_pp_run(offload: str | None, freeze: bool) -> tuple[list[torch.Tensor], list[float]]:
    with ParallelContext.from_world(dp=2, pp=2) as ctx:
        model = tiny_gpt(tie=True)
        if freeze:  # a frozen param inside a stage: not bucketed, never stepped
            model.blocks[1].ln1.weight.requires_grad_(False)
        opts = {"offload": offload} if offload else None
        par = parallelize(model, ctx, dp="zero2", pp={"microbatches": 2}, blocks=gpt_blocks, dp_options=opts)
        opt = par.make_optimizer(torch.optim.AdamW, par.parameters(), lr=1e-2)
        dp, r = ctx.size("dp"), ctx.rank("dp")
        rows = slice(r * B // dp, (r + 1) * B // dp)
        norms = []
        for x, y in lm_batches()[:3]:
            opt.zero_grad(set_to_none=True)
            par.forward_backward(x[rows], y[rows])
            norms.append(float(par.clip(0.3)))
            assert par.step(opt)
        params = [p.detach().clone() for p in par.module.parameters()]
        par.close()
        return params, norms


@pytest.mark.parametrize("freeze", [False, True], ids=["all-trainable", "frozen-param"])
def test_zero2_under_a_pipeline_with_cpu_offload_is_bitwise_the_device_run(dist_pool, freeze: bool) -> None:
    device = dist_pool.run(_zero2_pp_run, None, freeze, world_size=4, timeout=120)
    offload = dist_pool.run(_zero2_pp_run, "cpu", freeze, world_size=4, timeout=120)
    for rank, ((pa, na), (pb, nb)) in enumerate(zip(device, offload, strict=True)):
        assert na == nb, (rank, na, nb)
        assert len(pa) == len(pb) > 0
        for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
            assert torch.equal(a, b), (rank, i, (a - b).abs().max())
    # the gradients were not all zero (a run that trained nothing would compare equal too)
    assert all(n > 0 for _, norms in device for n in norms)
