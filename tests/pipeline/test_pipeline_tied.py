"""Tied weights across pipeline stages: a tiny GPT whose output projection is its token
embedding trains exactly like the single-process tied model (pp = 2 and 4, every schedule family,
>= 5 steps), whether the tie is a shared nn.Parameter or declared with ``tied=``; ``find_ties``
is checked without processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.pipeline import PipelineParallel
from shardkit.parallel.pipeline.tied import find_ties
from pipeline_models import T, V, gpt_blocks


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _batch(step: int, b: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)


def _tied_body(schedule: str, v: int, n_layers: int, declared: bool, pp: int | None = None) -> list[float]:
    with ParallelContext.from_world(pp=pp or dist.get_world_size(), dp=-1) as ctx:
        n = n_layers + 2
        if declared:  # distinct objects, initialized differently: the broadcast makes them equal
            blocks = gpt_blocks(n_layers, tie=False, seed=0)
            kw = {"tied": [("0.tok.weight", f"{n - 1}.out.weight")]}
        else:
            blocks, kw = gpt_blocks(n_layers, tie=True), {}
        stats = CommStats()
        pipe = PipelineParallel(blocks, ctx, schedule=schedule, microbatches=4, loss_fn=_ce, virtual_stages=v, stats=stats, **kw)
        opt = torch.optim.AdamW(pipe.parameters(), lr=2e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)
        ref = nn.Sequential(*gpt_blocks(n_layers, tie=True))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)
        losses = []
        try:
            for step in range(5):
                x, y = _batch(step)
                loss = pipe.step(x, y)
                opt.step()
                opt.zero_grad()
                ref_loss = _ce(ref(x), y)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-6), step
                losses.append(loss)
            full = pipe.full_state_dict()
            for k, want in ref.state_dict().items():  # both slots of the tie, on every rank
                torch.testing.assert_close(full[k], want, **FP32, msg=k)
            p, mine = ctx.size("pp"), {j for s in pipe.stages for j in pipe.stage_blocks[s]}
            syncs = 5 if p > 1 and (0 in mine or n - 1 in mine) else 0  # one per step on the owners
            # + agree_step's and finalize's closing all-reduce (losses, counts, failure flags), once each a step
            assert stats.calls("all_reduce") == 10 * (p > 1) + syncs
        finally:
            pipe.close()
        return losses


@pytest.mark.parametrize(
    "world_size, schedule, v, n_layers",
    [(2, "gpipe", 1, 2), (2, "zb-h1", 1, 2), (4, "1f1b", 1, 3), (4, "interleaved", 2, 6)],
)
@pytest.mark.reduction_order
def test_tied_embedding_trains_like_single_process(dist_pool, world_size, schedule, v, n_layers):
    res = dist_pool.run(_tied_body, schedule, v, n_layers, False, world_size=world_size, timeout=180)
    assert all(r == res[0] for r in res)


@pytest.mark.parametrize("world_size", [2, 4])
def test_declared_tie_is_broadcast_and_synchronized(dist_pool, world_size):
    dist_pool.run(_tied_body, "1f1b", 1, 3, True, world_size=world_size, timeout=180)


def test_tie_on_one_rank(dist_pool):
    # pp = 1 (dp = 2) with 3 local stages: the shared parameter is one object, stepped once
    dist_pool.run(_tied_body, "interleaved", 3, 1, False, 1, world_size=2, timeout=120)
    # declared tie of distinct objects on one rank: summed locally and kept equal
    dist_pool.run(_tied_body, "gpipe", 1, 2, True, 1, world_size=2, timeout=120)


def test_find_ties():
    blocks = gpt_blocks(2)
    assert find_ties(blocks) == [("0.tok.weight", "3.out.weight")]
    untied = gpt_blocks(2, tie=False)
    assert find_ties(untied) == []
    assert find_ties(untied, [("3.out.weight", "0.tok.weight")]) == [("0.tok.weight", "3.out.weight")]
    shared = nn.Linear(2, 2)  # used twice inside one block only: autograd's business, no tie
    assert find_ties([nn.Sequential(shared, shared), nn.Linear(2, 2)]) == []
    with pytest.raises(ValueError, match=r"tied\[0\]: '0.nope' is no parameter"):
        find_ties(untied, [("0.nope", "3.out.weight")])
    with pytest.raises(ValueError, match=r"tied\[0\]: '0.pos' is float32\[5, 8\] but '3.out.weight'"):
        find_ties(untied, [("0.pos", "3.out.weight")])
    with pytest.raises(ValueError, match=r"tied\[0\] must list at least two"):
        find_ties(untied, [("0.pos",)])
