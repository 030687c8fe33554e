"""Dropout under context parallelism: Ulysses' attention dropout and the model's dropout modules.

References: ``F.scaled_dot_product_attention`` with dropout on the full sequence of one head
group, run from the generator state Ulysses' own call began with (captured by wrapping SDPA), so
the two draw the same mask; the dense model in eval mode; the same model without activation
checkpointing (a recomputed segment must draw the masks its forward drew). And the property the
streams exist for: cp ranks draw different masks for their shards, which one seed on every rank
would not give ([Note: dropout under context parallelism]).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, gpt_blocks
from shardkit.parallel import parallelize
from shardkit.parallel.context import (
    context_parallel_attention,
    context_parallelize,
    gather_sequence,
    gpt_cp_plan,
    shard_sequence,
)

P = 0.3


def _ulysses_dropout_body(layout: str) -> list[torch.Tensor]:
    b, h, s, d = 2, 4, 16, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g) for _ in range(4))
    states: list[torch.Tensor] = []
    sdpa = F.scaled_dot_product_attention

    def capturing(*args, **kwargs):
        states.append(torch.get_rng_state())
        return sdpa(*args, **kwargs)

    with ParallelContext.from_world(cp=2) as ctx:
        r = ctx.rank("cp")
        torch.manual_seed(7)  # the same seed on every rank, as a training script sets it
        shards = [shard_sequence(t, ctx, dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention = capturing
        try:
            out = context_parallel_attention(*shards, ctx=ctx, mode="ulysses", layout=layout, dropout_p=P)
        finally:
            F.scaled_dot_product_attention = sdpa
        out.backward(shard_sequence(dout, ctx, dim=2, layout=layout))
        got = [gather_sequence(t.detach(), ctx, dim=2, layout=layout) for t in (out, *(x.grad for x in shards))]
    assert len(states) == 1
    # the reference: this rank's heads over the whole sequence, from the state Ulysses drew from
    heads = slice(r * h // 2, (r + 1) * h // 2)
    ref_in = [t[:, heads].clone().requires_grad_() for t in (q, k, v)]
    torch.set_rng_state(states[0])
    ref = F.scaled_dot_product_attention(*ref_in, dropout_p=P, is_causal=True)
    ref.backward(dout[:, heads])
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, (ref, *(x.grad for x in ref_in)), strict=True):
        torch.testing.assert_close(a[:, heads], e.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert (got[0][:, heads] == 0).any()  # some weights were dropped: the reference is not plain SDPA
    return [states[0]]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ulysses_attention_dropout_is_sdpa_dropout_of_each_head_group(dist_pool, layout):
    (s0,), (s1,) = dist_pool.run(_ulysses_dropout_body, layout, world_size=2, timeout=60)
    assert not torch.equal(s0, s1)  # each cp rank drew its heads' masks from its own stream


class _DropoutOnly(nn.Module):
    """Token embeddings, then dropout: the output's zeros are the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 64)
        nn.init.ones_(self.emb.weight)
        self.drop = nn.Dropout(0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.emb(ids))


def _dropout_masks_body(hooked: bool) -> torch.Tensor:
    with ParallelContext.from_world(cp=2) as ctx:
        model = _DropoutOnly()
        if hooked:
            context_parallelize(model, ctx, {})
        torch.manual_seed(3)
        ids = shard_sequence(torch.zeros(1, 32, dtype=torch.long), ctx, dim=1)
        before = torch.get_rng_state()
        mask = model(ids) == 0
        after = torch.get_rng_state()
        model.eval()
        assert (model(ids) == 1).all()  # eval: no dropout, no region
        if hooked:  # the shared stream went on the same on every rank: one draw for the seed
            states = [torch.empty_like(after) for _ in range(2)]
            dist.all_gather(states, after, group=ctx.group("cp"))
            assert torch.equal(states[0], states[1]) and not torch.equal(before, after)
        return mask


def test_each_cp_rank_drops_its_own_tokens(dist_pool):
    m0, m1 = dist_pool.run(_dropout_masks_body, True, world_size=2, timeout=60)
    assert not torch.equal(m0, m1)
    assert 0.3 < m0.float().mean().item() < 0.7 and 0.3 < m1.float().mean().item() < 0.7
    # without the hooks one seed gives every shard the same mask: the fault the streams remove
    u0, u1 = dist_pool.run(_dropout_masks_body, False, world_size=2, timeout=60)
    assert torch.equal(u0, u1)


VOCAB, D, LAYERS, HEADS, S = 23, 32, 2, 4, 16


def _train_dropout_body(checkpointing: bool, dropout: float) -> tuple[list[float], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(VOCAB, (2, S), generator=g), torch.randint(VOCAB, (2, S), generator=g)
    with ParallelContext.from_world(cp=2) as ctx:
        torch.manual_seed(0)
        model = TinyGPT(VOCAB, D, LAYERS, HEADS, S, dropout=dropout)
        kw = dict(blocks=gpt_blocks, checkpointing=True) if checkpointing else {}
        par = parallelize(model, ctx, dp="ddp", cp={"plan": gpt_cp_plan(), "mode": "ulysses"}, **kw)
        opt = torch.optim.SGD(par.parameters(), lr=0.1)
        torch.manual_seed(11)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(par.forward_backward(x, y).item())
            opt.step()
        return losses, [p.detach().clone() for p in par.parameters()]


def test_checkpointed_blocks_recompute_the_masks_their_forward_drew(dist_pool):
    plain = dist_pool.run(_train_dropout_body, False, 0.2, world_size=2, timeout=120)
    ckpt = dist_pool.run(_train_dropout_body, True, 0.2, world_size=2, timeout=120)
    for (l0, p0), (l1, p1) in zip(plain, ckpt, strict=True):
        assert l0 == l1
        for a, b in zip(p0, p1, strict=True):
            assert torch.equal(a, b)
    (no_dropout, _), _ = dist_pool.run(_train_dropout_body, False, 0.0, world_size=2, timeout=120)
    assert all(a != b for a, b in zip(plain[0][0], no_dropout))  # the attention and residual dropouts did drop


def _refusals_body() -> None:
    with ParallelContext.from_world(cp=2) as ctx:
        q = torch.randn(1, 2, 4, 8)
        for mode, kw in (("ring", {}), ("hybrid", {"ulysses_size": 2})):
            with pytest.raises(ValueError, match="dropout_p=0.1 with mode="):
                context_parallel_attention(q, q, q, ctx=ctx, mode=mode, dropout_p=0.1, **kw)
        for bad in (1.0, -0.1, "0.1", True):
            with pytest.raises(ValueError, match="dropout_p must be"):
                context_parallel_attention(q, q, q, ctx=ctx, mode="ulysses", dropout_p=bad)
        # a model whose attention drops weights, under ring: refused by the module's name, at once
        model = TinyGPT(VOCAB, D, LAYERS, HEADS, S, dropout=0.1)
        context_parallelize(model, ctx, gpt_cp_plan(), mode="ring")
        with pytest.raises(ValueError, match=r"blocks\.0\.attn: attention dropout \(dropout_p=0\.1\).*needs mode='ulysses'"):
            model(shard_sequence(torch.zeros(1, S, dtype=torch.long), ctx, dim=1))
        model.eval()  # eval passes dropout_p=0: nothing to refuse
        model(shard_sequence(torch.zeros(1, S, dtype=torch.long), ctx, dim=1))


def test_attention_dropout_is_refused_where_the_kernels_have_none(dist_pool):
    dist_pool.run(_refusals_body, world_size=2, timeout=60)
