"""Sequence parallelism composed with ZeRO-3 and with a pipeline, against
the dense single-process TinyGPT of ``test_parallelize`` (same seed, same global batch, clipping
active, SGD with momentum).

The norm and row-bias gradients of a sequence-parallel model are summed over tp by one coalesced
node ([Note: sequence-parallel grads under ZeRO-3 and pipelines] in
``parallel/tensor/sequence_parallel.py``): under ZeRO-3 one node per unit, built after the
unit's gather; under a pipeline one per held stage, over that stage's parameters only.
"""

from __future__ import annotations

import copy
import re
from unittest import mock

import pytest
import torch
from torch import nn

import shardkit.parallel.tensor.sequence_parallel as sp_module
from shardkit.comm import ParallelContext
from shardkit.models import gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.tensor import SequenceParallelGrads, SequenceParallelNorm, gpt_plan
from parallelize_cases import CLIP, dense_run, lm_batches, tiny_gpt, train_parallelized
from tolerances import FP32

MICROBATCHES = 2
_REPLICATED = re.compile(r"(^|\.)(ln1|ln2|ln_f)\.|\.proj\.bias$")


@pytest.mark.reduction_order
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_with_zero3_trains_like_the_dense_model(dist_pool, world_size):
    """tp 2 (x dp 2) with dp="zero3" and sequence parallelism: every block's norms compute with
    the values ZeRO-3 gathered for that block, so losses, clipped norms, evaluation and every
    parameter equal the dense model's, as with zero2."""
    dist_pool.run(train_parallelized, 2, 1, True, "1f1b", False, "zero3", True, world_size=world_size, timeout=240)


@pytest.mark.reduction_order
def test_sequence_parallel_under_a_pipeline_sums_only_the_held_stages_norms(dist_pool):
    """tp 2 x pp 2 with sequence parallelism: each pp rank registers and all-reduces over tp the
    norm and row-bias gradients of the blocks it holds, once per micro-batch, not every stage's,
    and trains like the dense model."""
    results = dist_pool.run(_pipeline_body, world_size=4, timeout=240)
    assert {r["model"] for r in results} == {832}


def _pipeline_body() -> dict[str, int]:
    import torch.distributed as dist

    with ParallelContext.from_world(dp=1, tp=2, pp=2) as ctx:
        _, ref_losses, ref_norms = dense_run(False)
        model = tiny_gpt(False)
        # what sequence parallelism sums over tp in the whole model: the LayerNorms and the
        # row-parallel biases of every block, and the final norm (832 elements)
        every = sum(p.numel() for n, p in model.named_parameters() if _REPLICATED.search(n))
        plan = gpt_plan(tie_embeddings=False, sequence_parallel=True)
        pp = {"microbatches": MICROBATCHES, "schedule": "1f1b"}
        par = parallelize(model, ctx, tp_plan=plan, pp=pp, blocks=gpt_blocks, dp="ddp")
        held = [m for stage in par.pipeline.stages.values() for m in stage.modules() if hasattr(m, "grad_sync")]
        held_params = {id(p) for m in held for p in m.replicated_parameters()}
        mine = sum(p.numel() for m in held for p in m.replicated_parameters())
        # the syncs the held layers use register this rank's parameters only (no other stage's
        # parameter is kept alive by them)
        syncs = {id(m.grad_sync): m.grad_sync for m in held}
        assert all(isinstance(s, SequenceParallelGrads) for s in syncs.values())
        registered = {id(p) for s in syncs.values() for p in s.params}
        assert registered == held_params, (len(registered), len(held_params))

        opt = par.make_optimizer(torch.optim.SGD, par.parameters(), lr=0.3, momentum=0.9)
        sizes: list[int] = []
        real = sp_module.all_reduce

        def counting(t: torch.Tensor, **kwargs: object) -> object:
            sizes.append(t.numel())
            return real(t, **kwargs)

        losses = []
        with mock.patch.object(sp_module, "all_reduce", counting):
            for step, (x, y) in enumerate(lm_batches()):
                opt.zero_grad(set_to_none=True)
                losses.append(float(par.forward_backward(x, y)))
                norm = float(par.clip(CLIP))
                par.step(opt)
                assert abs(norm - ref_norms[step]) <= 1e-4 * ref_norms[step], (step, norm, ref_norms[step])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        # per micro-batch: one all-reduce per held stage of exactly its norms and row biases
        per_microbatch = sum(sizes) / (len(lm_batches()) * MICROBATCHES)
        assert per_microbatch == mine < every, (per_microbatch, mine, every)
        assert len(sizes) == len(lm_batches()) * MICROBATCHES * len(par.pipeline.stages)
        total = torch.tensor([mine])
        dist.all_reduce(total, group=ctx.group("pp"))  # the stages partition the model's
        assert int(total) == every, (int(total), every)
        return {"elements_per_microbatch": int(per_microbatch), "model": every}


def _repointed_body() -> None:
    with ParallelContext.from_world(dp=1, tp=2) as ctx:
        tp, r = ctx.size("tp"), ctx.rank("tp")
        torch.manual_seed(5)
        dense = nn.ModuleDict({"a": nn.LayerNorm(6), "b": nn.LayerNorm(6)})
        sync = SequenceParallelGrads(group=ctx.group("tp"))
        model = nn.ModuleDict({k: SequenceParallelNorm(copy.deepcopy(m), ctx=ctx, grad_sync=sync) for k, m in dense.items()})
        gen = torch.Generator().manual_seed(6)
        x, w, b = torch.randn(2, 8, 6, generator=gen), torch.randn(6, generator=gen), torch.randn(6, generator=gen)

        def repoint(ln: nn.LayerNorm) -> None:  # what ZeRO-3's gather does: p.data replaced, not written
            ln.weight.data, ln.bias.data = w.clone(), b.clone()

        repoint(dense["b"])
        want = dense["b"](dense["a"](x))
        want.pow(2).sum().backward()
        h = model["a"](x.chunk(tp, 1)[r])  # the pass's node is built here, over both norms
        repoint(model["b"].module)
        out = model["b"](h)
        torch.testing.assert_close(out, want.chunk(tp, 1)[r], **FP32)
        out.pow(2).sum().backward()
        for k in ("a", "b"):
            torch.testing.assert_close(model[k].module.weight.grad, dense[k].weight.grad, **FP32)
            torch.testing.assert_close(model[k].module.bias.grad, dense[k].bias.grad, **FP32)


@pytest.mark.reduction_order
def test_a_norm_repointed_after_the_pass_began_computes_with_its_new_values(dist_pool):
    """A parameter whose ``.data`` is replaced after the pass's coalesced node took its view (as
    ZeRO-3's gather replaces it) is used with its new values, and its gradient is still the tp sum."""
    dist_pool.run(_repointed_body, world_size=2, timeout=60)
