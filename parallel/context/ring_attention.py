"""Ring attention: each cp rank keeps its queries and the key/value blocks travel around the ring.

[Note: ring attention]
With ``N = cp`` ranks, rank ``r`` holds the queries, keys and values of its tokens (positions
from :func:`~shardkit.parallel.context.shard_positions`). Forward, step ``i = 0 .. N-1``: rank
``r`` attends its queries to the key/value block of rank ``(r - i) mod N`` (its own first) with
:func:`~shardkit.kernels.attention.attention_block_forward`, which masks by the tokens' global
positions, and merges the block into its running output with the log-sum-exp rule
(:func:`~shardkit.kernels.attention.merge_attention_blocks`); meanwhile the block moves on to
rank ``r + 1`` (:func:`~shardkit.comm.ring_shift`, posted before the block's compute so the
transfer overlaps it). After ``N`` steps each rank has the exact attention of its queries over
the whole sequence, and no rank ever held more than two key/value blocks.

Backward replays the ring with the merged ``lse`` and ``delta = rowsum(dO * O)``
(:func:`~shardkit.kernels.attention.attention_block_backward`): ``dq`` accumulates locally;
each block's ``dk``/``dv`` accumulate in an fp32 buffer that travels with the block, one rank
behind it, and after ``N`` shifts arrives back at the block's owner.

With the zigzag layout and a causal mask every rank does the same work at every step (each
holds one early and one late chunk; [Note: sequence layouts]); blocks or rows a query cannot
see are skipped by the kernels, not computed and masked.

[Note: the output in the model's layout]
The merged output is ``[B, H, S/N, D]`` as the kernels return it, but stored as ``[B, S/N, H,
D]`` (a transposed view of that memory), as flash attention stores its output. The model's
``y.transpose(1, 2).reshape(B, S/N, H * D)`` back to the residual stream is then a view, not a
copy, and the output projection saves that view of the tensor ring attention saves anyway for
its backward: one ``[tokens, d]`` activation less per layer (fp32: the projection's input and
the merged output are one tensor; bf16/fp16: the projection keeps the rounded output, as it
would its copy). So in fp32 the returned output *is* a saved tensor: a model that changes it in
place (after a ``.contiguous()``, which is now a no-op) makes autograd refuse the backward, as it
would for any saved tensor.

Bytes per rank and layer: forward ``(N - 1)`` key/value blocks (``2 B Hkv S/N D`` elements
each); backward ``N - 1`` key/value blocks plus ``N`` fp32 ``dk``/``dv`` blocks. At the backward's
peak a rank holds two key/value blocks and two fp32 ``dk``/``dv`` blocks (the one being filled,
the one in transfer), one fp32 ``dq`` that every step adds into in place (``dq_into``), and the
output gradient as autograd hands it (strided: no contiguous copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkit.comm import CommHandle, CommStats, ParallelContext, ring_shift
from shardkit.kernels.attention import attention_block_backward, attention_block_forward, merge_attention_blocks
from shardkit.kernels.runtime import Backend

from .sequence_layout import SequenceLayout, shard_positions

__all__ = ["Ring", "ring_attention"]


@dataclass(frozen=True)
class Ring:
    """The ranks a ring attention passes key/value blocks around.

    Attributes:
        group: the ring's process group (``ring_shift`` sends to its next rank).
        size, rank: ranks in the ring and this rank's place.
        positions: for each ring rank, the global positions of the tokens it holds (``[tokens]``
            int64, in the order of its q/k/v rows): what the causal mask compares.

    Example:
        >>> ring = Ring.over_cp(ctx, seq_len=1024, layout="zigzag", device=q.device)
        >>> out = RingAttention.apply(q, k, v, ring, True, None, "auto", None)   # q/k/v: [B, H, 1024/cp, D]
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    positions: list[torch.Tensor]

    @classmethod
    def over_cp(cls, ctx: ParallelContext, seq_len: int, layout: SequenceLayout, device: torch.device) -> Ring:
        """The cp axis as the ring, each rank holding its ``layout`` share of ``seq_len`` tokens."""
        n = ctx.size("cp")
        positions = [shard_positions(seq_len, cp=n, rank=r, layout=layout, device=device) for r in range(n)]
        return cls(ctx.group("cp"), n, ctx.rank("cp"), positions)


class RingAttention(torch.autograd.Function):
    """``(q, k, v, ring, causal, scale, backend, stats) -> out``: [Note: ring attention] over
    ``ring`` (:class:`Ring`); q/k/v ``[B, H, tokens, D]`` with ``ring.positions[ring.rank]``'s
    tokens, contiguous; returns ``[B, H, tokens, D]`` in q's dtype. Hybrid attention builds its own
    :class:`Ring` (the groups' tokens); :func:`ring_attention` the cp axis's.

    Example:
        >>> out = RingAttention.apply(q, k, v, Ring.over_cp(ctx, S, "zigzag", q.device), True, None, "auto", None)
    """

    @staticmethod
    def forward(
        fctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
        causal: bool,
        scale: float | None,
        backend: Backend,
        stats: CommStats | None,
    ) -> torch.Tensor:
        group, n, me, positions = ring.group, ring.size, ring.rank, ring.positions
        kv = torch.stack([k, v])  # one buffer, one transfer per step
        spare = torch.empty_like(kv)
        out = lse = None
        for step in range(n):
            handle = ring_shift(spare, kv, group=group, async_op=True, stats=stats) if step < n - 1 else None
            src = (me - step) % n
            o, s = attention_block_forward(
                q, kv[0], kv[1], positions[me], positions[src], scale=scale, causal=causal, backend=backend
            )
            if out is None:  # [Note: the output in the model's layout]
                out = o.new_empty(o.shape[0], o.shape[2], o.shape[1], o.shape[3]).transpose(1, 2).copy_(o)
                lse = s
            else:
                merge_attention_blocks(out, lse, o, s)
            if handle is not None:  # the block just sent is the next send's buffer, if there is one
                kv, spare = handle.wait(), (kv if step + 2 < n else None)
        assert out is not None and lse is not None
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring, fctx.causal, fctx.scale, fctx.backend, fctx.stats = ring, causal, scale, backend, stats
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        ring: Ring = fctx.ring
        group, n, me, positions, stats = ring.group, ring.size, ring.rank, ring.positions, fctx.stats
        # dout stays as autograd hands it (the transposed gradient of the [B, S, H, D] output): the
        # kernels read strides, and a contiguous copy would be one more q-sized buffer at the peak
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, kv_spare = torch.stack([k, v]), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # travels with its block
        dkv_spare = torch.empty_like(dkv)
        dkv_handle: CommHandle | None = None
        for step in range(n):
            kv_handle = ring_shift(kv_spare, kv, group=group, async_op=True, stats=stats) if step < n - 1 else None
            src = (me - step) % n
            _, bk, bv = attention_block_backward(
                dout, q, kv[0], kv[1], lse, delta, positions[me], positions[src],
                scale=fctx.scale, causal=fctx.causal, backend=fctx.backend, out=out, dq_into=dq,
            )  # fmt: skip
            if dkv_handle is not None:  # block src's accumulator, arriving from rank me - 1
                dkv, dkv_spare = dkv_handle.wait(), dkv
            dkv[0] += bk
            dkv[1] += bv
            dkv_handle = ring_shift(dkv_spare, dkv, group=group, async_op=True, stats=stats) if n > 1 else None
            if kv_handle is not None:  # as in forward: no buffer kept past the last send
                kv, kv_spare = kv_handle.wait(), (kv if step + 2 < n else None)
        if dkv_handle is not None:  # the last shift brings each block's gradient home
            dkv = dkv_handle.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: ParallelContext,
    causal: bool = True,
    layout: SequenceLayout = "zigzag",
    scale: float | None = None,
    backend: Backend = "auto",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Ring attention over ``ctx``'s cp axis: see [Note: ring attention].

    Arguments as :func:`~shardkit.parallel.context.context_parallel_attention` (which checks
    them; call that one).

    Example:
        >>> out = ring_attention(q, k, v, ctx=ctx)      # q/k/v: this rank's [B, H, S/cp, D]
    """
    ring = Ring.over_cp(ctx, q.shape[2] * ctx.size("cp"), layout, q.device)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, causal, scale, backend, stats)
