"""Ulysses attention: all-to-all from sequence shards to head shards, full attention, and back.

[Note: Ulysses attention]
DeepSpeed-Ulysses' scheme. With ``N = cp`` ranks each holding ``S/N`` tokens of every head,
one all-to-all per tensor regroups ``q``, ``k``, ``v`` so that each rank holds the *whole*
sequence for ``H/N`` of the heads; attention then runs unchanged (``F.scaled_dot_product_attention``,
so flash attention on a GPU), and one all-to-all takes the output back to sequence shards.
Bytes per rank and layer: ``4 (N-1)/N`` of its ``[B, H, S/N, D]`` shard forward (q, k, v, out),
the same backward: unlike ring attention this does not grow with ``N``, but ``N`` may not
exceed the number of heads.

Heads: the query heads ``H`` must be divisible by ``N``. Key/value heads (GQA/MQA) ``Hkv``
either divide by ``N`` (each rank gets ``Hkv/N``) or divide ``N``; then each key/value head is
repeated ``N/Hkv`` times first (DeepSpeed's uneven-heads rule), so rank ``j`` gets the one
key/value head its query heads use; the repeat's backward sums the copies' gradients. Any
other count is a ``ValueError``.

The all-gathered sequence is in the layout's order (rank after rank); it is permuted to
sequence order before the attention (the causal mask needs it), in the same copy that unpacks
the all-to-all ([Note: Ulysses' wire layout]), and back after. The output comes back laid out
``[B, S/N, H, D]``, so the model's ``out.transpose(1, 2).reshape(B, S/N, H*D)`` for its output
projection is a view.
Memory: the projection keeps that tensor for its backward and SDPA keeps its own output on the
head shards, so a layer saves one ``[B, S/N, H*D]`` tensor more than at cp = 1 or in ring
attention, where the two are one buffer (the planner's ``proj_input``, docs/planner.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext, all_to_all

from .sequence_layout import SequenceLayout, shard_positions
from .sequence_rng import cp_rng_region

__all__ = ["HeadsToSequence", "Reorder", "SequenceToHeads", "check_ulysses_heads", "ulysses_attention"]


def check_ulysses_heads(heads: int, kv_heads: int, cp: int, *, mode: str = "ulysses") -> None:
    """Raise a ``ValueError`` when ``heads`` query / ``kv_heads`` key-value heads cannot be
    split over ``cp`` ranks by an all-to-all (see [Note: Ulysses attention]); ``mode`` names the
    caller in the message (``"hybrid"``: ``cp`` is then the all-to-all group size).

    Example:
        >>> check_ulysses_heads(32, 8, 4)       # 8 query heads and 2 kv heads per rank
        >>> check_ulysses_heads(32, 2, 4)       # each kv head repeated twice: 1 per rank
    """
    over, by = (f"cp={cp} ranks", "cp") if mode == "ulysses" else (f"all-to-all groups of ulysses_size={cp}", "ulysses_size")
    other = "use mode='ring', which has no such limit" + ("" if mode == "ulysses" else ", or a smaller ulysses_size")
    if heads % cp:
        raise ValueError(f"mode={mode!r} splits the {heads} query heads over {over}: heads must be divisible by {by} ({other})")
    if kv_heads % cp and cp % kv_heads:
        raise ValueError(f"mode={mode!r} needs the {kv_heads} key/value heads to divide by {by}={cp} or to divide it ({other})")


#: ``(order, to_sequence)``: ``order[i]`` is the sequence position of token ``i`` in the
#: rank-after-rank (layout) order, ``to_sequence`` its inverse (``argsort(order)``)
Reorder = tuple[torch.Tensor, torch.Tensor]


class SequenceToHeads(torch.autograd.Function):
    """``(x, group, stats, reorder)``: ``[B, H, S/N, D]`` (this rank's tokens, all heads) ->
    ``[B, H/N, S, D]`` (the ``N`` ranks' tokens of ``group``; this rank's heads). The tokens come
    rank after rank, or, with ``reorder`` (a :data:`Reorder`), in sequence order, gathered in the
    copy that unpacks the all-to-all. Backward is the inverse all-to-all.

    Example:
        >>> qh = SequenceToHeads.apply(q, ctx.group("cp"), None, None)    # [B, H, S/N, D] -> [B, H/N, S, D]
    """

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, reorder: Reorder | None
    ) -> torch.Tensor:
        fctx.group, fctx.stats, fctx.reorder = group, stats, reorder
        return _sequence_to_heads(x, group, stats, None if reorder is None else reorder[1])

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        order = None if fctx.reorder is None else fctx.reorder[0]
        return _heads_to_sequence(grad, fctx.group, fctx.stats, order), None, None, None


class HeadsToSequence(torch.autograd.Function):
    """``(x, group, stats, reorder)``: the inverse of :class:`SequenceToHeads` (with ``reorder``,
    ``x`` is in sequence order). The result is laid out ``[B, S/N, H, D]`` in memory (a
    transposed view), the layout a model's output projection reads it in, so reshaping it to
    ``[B, S/N, H*D]`` copies nothing.

    Example:
        >>> out = HeadsToSequence.apply(oh, ctx.group("cp"), None, None)  # [B, H/N, S, D] -> [B, H, S/N, D]
    """

    @staticmethod
    def forward(
        fctx: Any, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, reorder: Reorder | None
    ) -> torch.Tensor:
        fctx.group, fctx.stats, fctx.reorder = group, stats, reorder
        return _heads_to_sequence(x, group, stats, None if reorder is None else reorder[0])

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        to_sequence = None if fctx.reorder is None else fctx.reorder[1]
        return _sequence_to_heads(grad, fctx.group, fctx.stats, to_sequence), None, None, None


# [Note: Ulysses' wire layout]
# Both all-to-alls send [N, S/N, B, H/N, D] chunks (token-major): chunk j of a sequence-to-heads
# send is head group j's heads of this rank's tokens; chunk j of a heads-to-sequence send is
# rank j's tokens of this rank's heads. A received buffer viewed as [S, B, H/N, D] is then the
# ranks' tokens in layout order, so the move to or from sequence order is one index_select over
# its first dimension, the same copy that packs or unpacks the buffer: one copy on each side of
# every all-to-all, and no buffer besides send, receive and result. In the contiguous layout the
# layout order is the sequence, and the heads side is a strided view of the received buffer
# (attention reads strides): no result buffer at all, as DeepSpeed's all-to-all.


def _sequence_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, to_sequence: torch.Tensor | None
) -> torch.Tensor:
    n = group.size()
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).permute(1, 3, 0, 2, 4).contiguous()  # [N (head group), S/N, B, H/N, D]
    recv = torch.empty_like(send)
    all_to_all(recv, send, group=group, stats=stats)  # [N (source rank), S/N, B, H/N, D]
    heads = recv.view(n * s, b, h // n, d).permute(1, 2, 0, 3)  # [B, H/N, S (layout order), D], a view
    return heads if to_sequence is None else heads.index_select(2, to_sequence)  # strided [S, B, H/N, D] memory, or a copy


def _heads_to_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, order: torch.Tensor | None
) -> torch.Tensor:
    n = group.size()
    b, hn, seq, d = x.shape
    tokens = x.permute(2, 0, 1, 3)  # [S, B, H/N, D], a view
    send = tokens.contiguous() if order is None else tokens.index_select(0, order)  # layout order
    send = send.view(n, seq // n, b, hn, d)  # [N (token rank), S/N, B, H/N, D]
    recv = torch.empty_like(send)
    all_to_all(recv, send, group=group, stats=stats)  # [N (head group), S/N, B, H/N, D]
    out = recv.new_empty(b, seq // n, n, hn, d)  # [B, S/N, H, D] in memory
    out.copy_(recv.permute(2, 1, 0, 3, 4))
    return out.view(b, seq // n, n * hn, d).transpose(1, 2)  # [B, H, S/N, D], a view


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: ParallelContext,
    causal: bool = True,
    layout: SequenceLayout = "zigzag",
    scale: float | None = None,
    stats: CommStats | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Ulysses attention over ``ctx``'s cp axis: see [Note: Ulysses attention].

    Arguments as :func:`~shardkit.parallel.context.context_parallel_attention` (which checks
    them; call that one).

    Example:
        >>> out = ulysses_attention(q, k, v, ctx=ctx)   # q/k/v: this rank's [B, H, S/cp, D]
    """
    n = ctx.size("cp")
    check_ulysses_heads(q.shape[1], k.shape[1], n)
    if k.shape[1] < n:  # each kv head repeated so that every rank gets the one its queries use
        k = k.repeat_interleave(n // k.shape[1], dim=1)
        v = v.repeat_interleave(n // v.shape[1], dim=1)
    reorder = None  # contiguous: the ranks' tokens, rank after rank, are the sequence
    if layout != "contiguous":
        seq_len = q.shape[2] * n
        order = torch.cat([shard_positions(seq_len, cp=n, rank=r, layout=layout, device=q.device) for r in range(n)])
        reorder = (order, torch.argsort(order))
    group = ctx.group("cp")
    qh, kh, vh = (SequenceToHeads.apply(t, group, stats, reorder) for t in (q, k, v))
    gqa = kh.shape[1] != qh.shape[1]
    with cp_rng_region(group, enabled=dropout_p > 0):  # this rank's heads, its own masks
        out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa)
    return HeadsToSequence.apply(out, group, stats, reorder)
