"""Which tokens of a sequence each context-parallel rank holds, and moving between the full
sequence and this rank's part.

[Note: sequence layouts]
A sequence of ``S`` tokens is split over the ``cp`` ranks of ``ctx.group("cp")``:

* ``"contiguous"``: rank ``r`` holds tokens ``[r S/cp, (r + 1) S/cp)``. Under a causal mask the
  last rank's queries see every key and the first rank's see only their own, so with ring
  attention the work is unbalanced (rank ``cp - 1`` does ``2 cp - 1`` times rank 0's).
* ``"zigzag"`` (the default; Megatron-Core's and ring-flash-attention's load balancing): the
  sequence is cut into ``2 cp`` chunks of ``S / (2 cp)`` tokens and rank ``r`` holds chunks
  ``r`` and ``2 cp - 1 - r``, in that order, so every rank has one early and one late chunk and
  the same amount of causal work.

``S`` must be divisible by ``cp`` (contiguous) or ``2 cp`` (zigzag); :func:`shard_sequence`
raises a ``ValueError`` naming the length otherwise (pad the batch to a multiple: padding
tokens with ``ignore_index`` targets change nothing, as for any padded batch). Every function
here works on any dim, so ``[batch, seq, hidden]`` activations, ``[batch, heads, seq, head_dim]``
attention inputs and ``[batch, seq]`` token ids shard the same way.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from shardkit.comm import CommStats, ParallelContext, all_gather

__all__ = ["SequenceLayout", "LAYOUTS", "check_sequence_length", "shard_positions", "shard_sequence", "gather_sequence"]

SequenceLayout = Literal["zigzag", "contiguous"]
#: The layouts, see [Note: sequence layouts].
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_sequence_length(seq_len: int, cp: int, layout: SequenceLayout) -> None:
    """Raise a ``ValueError`` when a sequence of ``seq_len`` tokens cannot be split over ``cp``
    ranks in ``layout`` (see [Note: sequence layouts]).

    Example:
        >>> check_sequence_length(12, 2, "zigzag")     # 4 chunks of 3 tokens: fine
    """
    parts = cp * _chunks_per_rank(_check_layout(layout))
    if seq_len % parts:
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split over cp={cp} ranks in the {layout!r} layout: "
            f"its length must be a multiple of {parts}; pad it to {-(-seq_len // parts) * parts} tokens "
            "(padding targets = ignore_index)"
        )


def shard_positions(seq_len: int, *, cp: int, rank: int, layout: SequenceLayout = "zigzag", device: Any = None) -> torch.Tensor:
    """Positions in the full sequence of the tokens cp rank ``rank`` holds, in its order.

    Args:
        seq_len: the full sequence length ``S`` (see [Note: sequence layouts] for what divides).
        cp: the number of context-parallel ranks; rank: this rank's index in ``[0, cp)``.
        layout: ``"zigzag"`` or ``"contiguous"``.
        device: where to put the result.

    Returns:
        int64 ``[S / cp]``, ascending.

    Example:
        >>> shard_positions(8, cp=2, rank=0)
        tensor([0, 1, 6, 7])
        >>> shard_positions(8, cp=2, rank=1, layout="contiguous")
        tensor([4, 5, 6, 7])
    """
    check_sequence_length(seq_len, cp, layout)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank}")
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * c])


def _layout_order(seq_len: int, cp: int, layout: SequenceLayout, device: Any) -> torch.Tensor:
    """Positions of all ranks' tokens, rank after rank (what an all-gather of the shards holds)."""
    return torch.cat([shard_positions(seq_len, cp=cp, rank=r, layout=layout, device=device) for r in range(cp)])


def _dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a tensor of shape {tuple(x.shape)}, got {dim}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, ctx: ParallelContext, dim: int = 1, layout: SequenceLayout = "zigzag") -> torch.Tensor:
    """This cp rank's part of a full-sequence tensor (a copy; differentiable).

    Every cp rank calls it on the same full tensor (e.g. the batch's token ids) and gets its
    tokens, in the order :func:`shard_positions` lists them. No communication.

    Args:
        x: any tensor with the full sequence along ``dim``.
        ctx: the context; its ``cp`` axis splits the sequence.
        dim: the sequence dim (1 for ``[batch, seq, ...]``, 2 for ``[batch, heads, seq, head_dim]``).
        layout: see [Note: sequence layouts].

    Returns:
        ``x`` with ``S / cp`` tokens along ``dim``.

    Raises:
        ValueError: the length does not divide (see [Note: sequence layouts]), or a bad
            ``dim``/``layout``.

    Example:
        >>> ids = torch.arange(8).unsqueeze(0)            # [1, 8]; cp = 2, this is cp rank 1
        >>> shard_sequence(ids, ctx)
        tensor([[2, 3, 4, 5]])
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _dim(x, dim)
    cp = ctx.size("cp")
    positions = shard_positions(x.shape[dim], cp=cp, rank=ctx.rank("cp"), layout=layout, device=x.device)
    if cp == 1:
        return x
    return x.index_select(dim, positions)


class _GatherSequence(torch.autograd.Function):
    """All-gather the shards over cp and put the tokens back in sequence order; backward
    returns this rank's part of the gradient (see :func:`gather_sequence`)."""

    @staticmethod
    def forward(
        ctx_: Any, x: torch.Tensor, pctx: ParallelContext, dim: int, layout: str, stats: CommStats | None
    ) -> torch.Tensor:
        cp, rank = pctx.size("cp"), pctx.rank("cp")
        ctx_.dim, ctx_.positions = dim, None
        moved = x.movedim(dim, 0).contiguous()
        full = torch.empty((cp * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather(full, moved, group=pctx.group("cp"), stats=stats)
        seq_len = full.shape[0]
        order = _layout_order(seq_len, cp, layout, x.device)  # full[i] is token order[i]
        natural = torch.empty_like(full)
        natural[order] = full
        ctx_.positions = shard_positions(seq_len, cp=cp, rank=rank, layout=layout, device=x.device)  # type: ignore[arg-type]
        return natural.movedim(0, dim)

    @staticmethod
    def backward(ctx_: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.index_select(ctx_.dim, ctx_.positions), None, None, None, None


def gather_sequence(
    x: torch.Tensor,
    ctx: ParallelContext,
    dim: int = 1,
    layout: SequenceLayout = "zigzag",
    *,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """The full sequence from every cp rank's part: the inverse of :func:`shard_sequence`.

    Collective over ``ctx.group("cp")``. Differentiable: the gradient of this rank's part is its
    tokens' slice of the full tensor's gradient. When every cp rank computes the same loss from
    the gathered tensor, each rank's parameter gradients are its tokens' share, and the full
    gradient is their *sum* over cp; the dp strategies (``parallelize``) *average* over the
    dp × cp ranks, so back-propagate ``cp * loss`` there, as
    :class:`~shardkit.parallel.context.SequenceShardedLoss` does for its own loss.

    Args:
        x: this rank's part, ``S / cp`` tokens along ``dim``.
        ctx, dim, layout: as for :func:`shard_sequence` (the same on every cp rank).
        stats: optional :class:`~shardkit.comm.CommStats` for the all-gather.

    Returns:
        ``x``'s full-sequence tensor (``S`` tokens along ``dim``), the same on every cp rank.

    Example:
        >>> full = torch.randn(2, 8, 16)
        >>> torch.equal(gather_sequence(shard_sequence(full, ctx), ctx), full)
        True
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _dim(x, dim)
    _check_layout(layout)
    if ctx.size("cp") == 1:
        return x
    return _GatherSequence.apply(x, ctx, dim, layout, stats)
