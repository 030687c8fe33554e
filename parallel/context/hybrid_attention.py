"""Hybrid context parallelism: Ulysses inside groups of cp ranks, ring attention across them.

[Note: hybrid attention]
Megatron-Core's ``cp_comm_type="a2a+p2p"``. The cp axis is cut into all-to-all groups of ``U``
consecutive cp ranks (on a cluster: the GPUs of one node, where all-to-all is cheap) and rings
of ``R = cp / U`` ranks, one through each place of those groups (:meth:`ParallelContext.cp_split`;
cp rank ``c = ring_rank * U + a2a_rank``). Per attention call:

1. all-to-all within the group ([Note: Ulysses attention]): ``[B, H, S/cp, D]`` → ``[B, H/U,
   U·S/cp, D]``: the group's tokens (its ranks' shards, rank after rank) for ``H/U`` heads;
2. ring attention across the groups ([Note: ring attention]) on those blocks: each ring rank's
   tokens are the union of its group's shards, and the causal mask compares their global
   positions, so the zigzag layout still gives every rank the same work;
3. all-to-all back to ``[B, H, S/cp, D]``.

Per rank and layer, the all-to-alls move ``4 (U-1)/U`` of the rank's shard (independent of
cp), and the ring passes ``R - 1`` key/value blocks of ``U·S/cp`` tokens and ``H/U`` heads — the
same bytes per block as pure ring attention, over ``R - 1`` steps instead of ``cp - 1``. Heads:
``H`` must divide by ``U`` (key/value heads divide by ``U`` or divide it, as Ulysses); ``U = cp``
is Ulysses and ``U = 1`` is ring attention, computed by this path all the same.
"""

from __future__ import annotations

import torch

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels.runtime import Backend

from .ring_attention import Ring, RingAttention
from .sequence_layout import SequenceLayout, shard_positions
from .ulysses_attention import HeadsToSequence, SequenceToHeads, check_ulysses_heads

__all__ = ["hybrid_attention"]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: ParallelContext,
    ulysses_size: int,
    causal: bool = True,
    layout: SequenceLayout = "zigzag",
    scale: float | None = None,
    backend: Backend = "auto",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Hybrid attention over ``ctx``'s cp axis: see [Note: hybrid attention].

    Arguments as :func:`~shardkit.parallel.context.context_parallel_attention` (which checks
    them; call that one with ``mode="hybrid"``); ``ulysses_size`` is ``U``, the all-to-all group
    size (a divisor of cp).

    Example:
        >>> out = hybrid_attention(q, k, v, ctx=ctx, ulysses_size=2)   # cp = 4: 2 x 2
    """
    split = ctx.cp_split(ulysses_size)
    u, cp = split.a2a_size, ctx.size("cp")
    check_ulysses_heads(q.shape[1], k.shape[1], u, mode="hybrid")
    if k.shape[1] < u:  # each kv head repeated so that every group rank gets the one its queries use
        k = k.repeat_interleave(u // k.shape[1], dim=1)
        v = v.repeat_interleave(u // v.shape[1], dim=1)
    seq_len = q.shape[2] * cp
    positions = [
        torch.cat([shard_positions(seq_len, cp=cp, rank=g * u + i, layout=layout, device=q.device) for i in range(u)])
        for g in range(split.ring_size)
    ]
    ring = Ring(split.ring, split.ring_size, split.ring_rank, positions)
    qh, kh, vh = (SequenceToHeads.apply(t, split.a2a, stats, None) for t in (q, k, v))
    out = RingAttention.apply(qh, kh, vh, ring, causal, scale, backend, stats)
    return HeadsToSequence.apply(out, split.a2a, stats, None)  # it packs its send buffer itself: no copy first
