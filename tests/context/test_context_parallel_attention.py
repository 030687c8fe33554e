"""Context-parallel attention against ``F.scaled_dot_product_attention`` on the full sequence.

Every rank builds the same full ``q``, ``k``, ``v`` (same seed), takes its shard with
``shard_sequence``, runs ``context_parallel_attention`` and a backward with the shard of one
full upstream gradient; the gathered output and input gradients must equal the single-process
SDPA's (computed in fp64 from the same tensors) within the fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.context import (
    context_parallel_attention,
    gather_sequence,
    shard_positions,
    shard_sequence,
)
from tolerances import FP32


def _full_inputs(b: int, h: int, hkv: int, s: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, s, d, generator=g) for n in (h, hkv, hkv, h))
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def _reference(q, k, v, dout, causal):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _attention_body(cp, mode, causal, layout, heads, kv_heads, seq, dtype=torch.float32, ulysses_size=None):
    tol = FP32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    q, k, v, dout = _full_inputs(2, heads, kv_heads, seq, 8, dtype)
    with ParallelContext.from_world(cp=cp) as ctx:
        stats = CommStats()
        shards = [shard_sequence(t, ctx, dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(
            *shards, ctx=ctx, mode=mode, causal=causal, layout=layout, stats=stats, ulysses_size=ulysses_size
        )
        out.backward(shard_sequence(dout, ctx, dim=2, layout=layout))
        got = [gather_sequence(t, ctx, dim=2, layout=layout) for t in (out.detach(), *(s.grad for s in shards))]
        ref = _reference(q, k, v, dout, causal)
        for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(a.double(), r, **tol, msg=lambda m, name=name: f"{name}: {m}")
        assert out.dtype == dtype and all(s.grad.dtype == dtype for s in shards)
        return stats.summary()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_attention_equals_full_attention(dist_pool, cp, mode, causal):
    """MHA, 4 heads: out, dq, dk, dv equal SDPA's on the full sequence (zigzag layout)."""
    dist_pool.run(_attention_body, cp, mode, causal, "zigzag", 4, 4, 8 * cp, world_size=cp)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_contiguous_layout(dist_pool, mode):
    dist_pool.run(_attention_body, 2, mode, True, "contiguous", 4, 4, 10, world_size=2)


@pytest.mark.parametrize(("mode", "kv_heads"), [("ring", 1), ("ring", 2), ("ulysses", 2), ("ulysses", 1)])
def test_grouped_query_attention(dist_pool, mode, kv_heads):
    """GQA/MQA: 4 query heads over 2 or 1 key/value heads at cp 4 (Ulysses repeats kv heads
    so each rank gets the one its queries use; the repeat's gradient sums the copies)."""
    dist_pool.run(_attention_body, 4, mode, True, "zigzag", 4, kv_heads, 16, world_size=4)


@pytest.mark.parametrize(
    ("ulysses_size", "causal", "layout", "kv_heads", "seq"),
    [
        (2, True, "zigzag", 4, 16),
        (2, True, "zigzag", 4, 8),  # one token per chunk: a block's runs are single tokens out of order
        (2, False, "contiguous", 2, 16),
        (2, True, "zigzag", 1, 16),
        (1, True, "zigzag", 2, 16),
        (4, True, "zigzag", 4, 16),
    ],
    ids=["2x2-causal", "2x2-causal-one-token-chunks", "2x2-full-contiguous", "2x2-mqa", "1x4-ring", "4x1-ulysses"],
)
def test_hybrid_attention_equals_full_attention(dist_pool, ulysses_size, causal, layout, kv_heads, seq):
    """cp 4 as all-to-all groups of ulysses_size ranks x a ring across them: out, dq, dk, dv equal
    SDPA's on the full sequence; the all-to-alls stay in their groups, the ring in its own. With
    one-token chunks a group's block holds positions like 0, 7, 1, 6: the CPU path's joined run
    pairs then cover some key columns partly before others (it once added into unset memory)."""
    summaries = dist_pool.run(
        _attention_body, 4, "hybrid", causal, layout, 4, kv_heads, seq, ulysses_size=ulysses_size, world_size=4
    )
    for summary in summaries:
        for op, label in (("all_to_all", "shardkit_cp_a2a["), ("ring_shift", "shardkit_cp_ring[")):
            groups = summary.get(op, {"groups": {}})["groups"]  # a group of one rank sends nothing
            assert all(g.startswith(label) for g in groups) and bool(groups) == (ulysses_size != (1 if op == "all_to_all" else 4))


def _hybrid_refusals_body():
    q = torch.randn(1, 4, 4, 8)
    with ParallelContext.from_world(cp=4) as ctx:
        cases = [
            ({"mode": "hybrid"}, TypeError, "needs ulysses_size"),
            ({"mode": "hybrid", "ulysses_size": 3}, ValueError, "positive divisor of the cp size 4"),
            ({"mode": "ring", "ulysses_size": 2}, ValueError, "applies to mode='hybrid' only"),
        ]
        for kwargs, exc, match in cases:
            with pytest.raises(exc, match=match):
                context_parallel_attention(q, q, q, ctx=ctx, **kwargs)
        with pytest.raises(ValueError, match="heads must be divisible by ulysses_size"):
            context_parallel_attention(q[:, :3], q[:, :3], q[:, :3], ctx=ctx, mode="hybrid", ulysses_size=2)
        return ctx.cp_split(2) is ctx.cp_split(2)  # created once, then the same groups


def test_hybrid_refusals_name_the_argument(dist_pool):
    assert all(dist_pool.run(_hybrid_refusals_body, world_size=4))


def test_ring_attention_in_bf16(dist_pool):
    dist_pool.run(_attention_body, 2, "ring", True, "zigzag", 2, 2, 16, torch.bfloat16, world_size=2)


def test_dp_times_cp(dist_pool):
    """dp 2 x cp 2 on 4 ranks: each dp replica's two cp ranks attend together; the transfers
    stay on the cp group."""
    summaries = dist_pool.run(_attention_body, 2, "ring", True, "zigzag", 2, 2, 8, world_size=4)
    for summary in summaries:
        groups = summary["ring_shift"]["groups"]
        assert all(label.startswith("shardkit_cp") for label in groups), groups


def _comm_bytes_body(mode):
    """Ring: 1 kv block shifted forward (cp-1 = 1 time), kv once and dkv (fp32) twice backward."""
    b, h, s, d = 1, 2, 8, 4
    q, k, v, dout = _full_inputs(b, h, h, s, d, torch.float32)
    with ParallelContext.from_world(cp=2) as ctx:
        stats = CommStats()
        shards = [shard_sequence(t, ctx, dim=2).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*shards, ctx=ctx, mode=mode, stats=stats)
        out.backward(shard_sequence(dout, ctx, dim=2))
        return stats.summary()


def test_ring_and_ulysses_bytes(dist_pool):
    block = 2 * 1 * 2 * 4 * 4 * 4  # k and v: [1, 2, S/cp=4, 4] fp32
    ring = dist_pool.run(_comm_bytes_body, "ring", world_size=2)[0]["ring_shift"]
    assert ring["calls"] == 1 + 1 + 2 and ring["bytes"] == block + block + 2 * block
    ulysses = dist_pool.run(_comm_bytes_body, "ulysses", world_size=2)[0]["all_to_all"]
    assert ulysses["calls"] == 4 + 4 and ulysses["bytes"] == 8 * (block // 2)  # q, k, v, out; and back


def _layout_body(layout):
    with ParallelContext.from_world(cp=dist.get_world_size()) as ctx:
        full = torch.arange(2 * 12).reshape(2, 12).float().requires_grad_()
        part = shard_sequence(full, ctx, dim=1, layout=layout)
        back = gather_sequence(part, ctx, dim=1, layout=layout)
        (back * torch.arange(12.0)).sum().backward()
        return part.detach(), back.detach(), full.grad


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_and_gather_sequence(dist_pool, layout):
    """gather(shard(x)) == x; every rank's part is the positions shard_positions lists; the
    gradient through gather reaches exactly this rank's tokens."""
    for r, (part, back, grad) in enumerate(dist_pool.run(_layout_body, layout, world_size=3)):
        positions = shard_positions(12, cp=3, rank=r, layout=layout)
        full = torch.arange(24).reshape(2, 12).float()
        assert torch.equal(part, full[:, positions]) and torch.equal(back, full)
        want = torch.zeros(2, 12)
        want[:, positions] = positions.float()
        assert torch.equal(grad, want)


def test_zigzag_positions_balance_causal_work():
    """Rank r holds chunks r and 2cp-1-r: every rank's queries see the same number of keys."""
    cp, s = 4, 32
    seen = []
    for r in range(cp):
        pos = shard_positions(s, cp=cp, rank=r)
        assert pos.tolist() == [*range(4 * r, 4 * r + 4), *range(4 * (7 - r), 4 * (8 - r))]
        seen.append(int((pos + 1).sum()))
    assert len(set(seen)) == 1
    assert sorted(torch.cat([shard_positions(s, cp=cp, rank=r) for r in range(cp)]).tolist()) == list(range(s))


def _refusals_body():
    with ParallelContext.from_world(cp=2) as ctx:
        q = torch.randn(1, 3, 4, 8)
        with pytest.raises(ValueError, match="heads must be divisible by cp"):
            context_parallel_attention(q, q, q, ctx=ctx, mode="ulysses")
        with pytest.raises(ValueError, match="key/value heads to divide by cp=2 or to divide it"):
            ctx4 = ctx  # 6 query heads over 3 kv heads, cp 2: 3 neither divides 2 nor is divisible
            context_parallel_attention(torch.randn(1, 6, 4, 8), q, q, ctx=ctx4, mode="ulysses")
        with pytest.raises(ValueError, match="local sequence length must be even"):
            context_parallel_attention(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), ctx=ctx)
        with pytest.raises(ValueError, match="mode must be one of"):
            context_parallel_attention(q, q, q, ctx=ctx, mode="p2p")
        with pytest.raises(ValueError, match="self-attention"):
            context_parallel_attention(q, q[:, :, :2], q[:, :, :2], ctx=ctx)
        with pytest.raises(ValueError, match="multiple of 4; pad it to 12 tokens"):
            shard_sequence(torch.zeros(1, 10), ctx)
        with pytest.raises(TypeError, match="ctx must be a ParallelContext"):
            context_parallel_attention(q, q, q, ctx=None)  # type: ignore[arg-type]
    return True


def test_refusals_name_the_argument(dist_pool):
    assert all(dist_pool.run(_refusals_body, world_size=2))


def test_one_rank_is_plain_attention():
    """cp == 1: the function is SDPA (a model written against it runs without cp)."""
    with ParallelContext.from_env() as ctx:
        q, k, v, _ = _full_inputs(1, 4, 2, 6, 8, torch.float32)
        out = context_parallel_attention(q, k, v, ctx=ctx)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        assert shard_sequence(q, ctx, dim=2) is q


# ---- peers: PyTorch's ring attention, DeepSpeed's Ulysses ------------------------------------------
def _torch_ring_body(causal):
    """PyTorch's ring (``_templated_ring_attention``, its head-tail load balancing = zigzag), driven
    on CPU with the CPU flash-attention op, against ours on the same shards."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    aten = torch.ops.aten
    q, k, v, dout = _full_inputs(2, 4, 4, 16, 8, torch.float32)
    with ParallelContext.from_world(cp=dist.get_world_size()) as ctx:
        shards = [shard_sequence(t, ctx, dim=2) for t in (q, k, v)]
        dout_shard = shard_sequence(dout, ctx, dim=2)
        saved = torch_cp._cp_options.enable_load_balance
        torch_cp._cp_options.enable_load_balance = causal
        try:
            group = ctx.group("cp")
            out, lse = torch_cp._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, *shards, is_causal=causal
            )[:2]
            grads = torch_cp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout_shard,
                grad_out_name="grad_out", query=shards[0], key=shards[1], value=shards[2], out=out, logsumexp=lse,
                is_causal=causal, dropout_p=0.0,
            )[:3]  # fmt: skip
        finally:
            torch_cp._cp_options.enable_load_balance = saved
        mine = [t.clone().requires_grad_() for t in shards]
        my_out = context_parallel_attention(*mine, ctx=ctx, mode="ring", causal=causal)
        my_out.backward(dout_shard)
        for name, a, b in zip(("out", "dq", "dk", "dv"), (my_out, *(m.grad for m in mine)), (out, *grads), strict=True):
            torch.testing.assert_close(a, b, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    return True


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_matches_pytorch_ring_attention(dist_pool, causal):
    assert all(dist_pool.run(_torch_ring_body, causal, world_size=2))


def _deepspeed_ulysses_body(kv_heads):
    """DeepSpeed's ``DistributedAttention`` ([b, s/p, h, d], the contiguous layout) around SDPA,
    against ours on the same shards."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the worker's initialized default group
    q, k, v, dout = _full_inputs(2, 4, kv_heads, 16, 8, torch.float32)
    with ParallelContext.from_world(cp=dist.get_world_size()) as ctx:
        shards = [shard_sequence(t, ctx, dim=2, layout="contiguous") for t in (q, k, v)]
        dout_shard = shard_sequence(dout, ctx, dim=2, layout="contiguous")

        def local_attention(qh, kh, vh):  # [b, s, h/p, d]
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qh, kh, vh)), is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)

        peer = DistributedAttention(local_attention, ctx.group("cp"), scatter_idx=2, gather_idx=1)
        theirs = [t.transpose(1, 2).contiguous().requires_grad_() for t in shards]
        their_out = peer(*theirs, batch_dim_idx=0)
        their_out.backward(dout_shard.transpose(1, 2))
        mine = [t.clone().requires_grad_() for t in shards]
        my_out = context_parallel_attention(*mine, ctx=ctx, mode="ulysses", layout="contiguous")
        my_out.backward(dout_shard)
        pairs = zip(
            ("out", "dq", "dk", "dv"), (my_out, *(m.grad for m in mine)), (their_out, *(t.grad for t in theirs)), strict=True
        )
        for name, a, b in pairs:
            torch.testing.assert_close(a, b.transpose(1, 2), **FP32, msg=lambda m, name=name: f"{name}: {m}")
    return True


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ulysses_matches_deepspeed_distributed_attention(dist_pool, kv_heads):
    assert all(dist_pool.run(_deepspeed_ulysses_body, kv_heads, world_size=2))
