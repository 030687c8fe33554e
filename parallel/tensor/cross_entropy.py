"""Vocab-parallel cross-entropy: the kernels' two passes around the tp all-reduce of statistics.

Each tp rank holds the logits of its vocabulary shard (``[..., Vs]``, the output of a
column-parallel LM head); no rank ever holds the full ``[tokens, V]`` logits. Forward: one pass
over the shard gives per-token ``(max, sum-exp, target logit, logit sum)``
(:func:`shardkit.kernels.cross_entropy.ce_shard_stats`); two all-reduces over tp combine them
(``max`` of the maxima, then one ``sum`` of ``[3, T]``: the sum-exps rescaled to the global max,
the target logits — non-zero on exactly one rank — and the logit sums). Backward: the gradient
is written into the logits shard in place (:func:`~shardkit.kernels.cross_entropy.ce_grad_`), with
no communication: each rank's gradient is local to its columns.

Communication per call, ``T`` tokens: all-reduce ``4T`` bytes (max) + ``12T`` bytes (sums), in
CommStats' payload unit, vs. ``2 T V`` or more to gather bf16 logits.

The math, including torch's label-smoothing definition and the z-loss, is in
:mod:`shardkit.kernels.cross_entropy`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from shardkit.comm import CommStats, ParallelContext, all_reduce
from shardkit.kernels.cross_entropy import ce_grad_, ce_shard_stats
from shardkit.kernels.runtime import Backend

__all__ = ["vocab_parallel_cross_entropy", "vocab_shard_range"]

Reduction = Literal["none", "mean", "sum"]


def vocab_shard_range(vocab_size: int, shard_size: int, tp_rank: int) -> tuple[int, int]:
    """``(vocab_start, n_valid)`` of rank ``tp_rank``'s shard of ``shard_size`` columns.

    The vocabulary is padded to ``tp * shard_size`` and rank ``r`` holds columns
    ``[r * shard_size, (r + 1) * shard_size)``; ``n_valid`` of them are real classes.

    Example:
        >>> [vocab_shard_range(10, 4, r) for r in range(3)]     # V = 10 at tp = 3: 4 + 4 + 2
        [(0, 4), (4, 4), (8, 2)]
    """
    start = tp_rank * shard_size
    return start, max(0, min(shard_size, vocab_size - start))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        vocab_size: int,
        ignore_index: int,
        smoothing: float,
        z_loss: float,
        reduction: str,
        backend: Backend,
        stats: CommStats | None,
    ) -> torch.Tensor:
        shard = logits.shape[-1]
        x = logits.reshape(-1, shard)
        t = target.reshape(-1)
        start, n_valid = vocab_shard_range(vocab_size, shard, group.rank())
        local = ce_shard_stats(x, t, vocab_start=start, n_valid=n_valid, ignore_index=ignore_index, backend=backend)
        m = local[0].clone()
        all_reduce(m, group=group, op="max", stats=stats)
        # A shard with no valid column has m = -inf, s = 0: it contributes 0, not 0 * inf = nan.
        sums = torch.stack([torch.where(local[1] > 0, local[1] * torch.exp(local[0] - m), 0.0), local[2], local[3]])
        all_reduce(sums, group=group, op="sum", stats=stats)
        lse = m + torch.log(sums[0])
        keep = t != ignore_index
        loss = (1.0 - smoothing) * (lse - sums[1]) + z_loss * lse * lse
        if smoothing:
            loss = loss + smoothing * (lse - sums[2] / vocab_size)
        loss = torch.where(keep, loss, 0.0)
        n_keep = keep.sum()
        ctx.save_for_backward(logits, t, lse.contiguous(), n_keep)
        # A leaf's storage is the user's tensor: never overwrite it with its own gradient.
        ctx.copy_first = logits.is_leaf
        ctx.args = (vocab_size, start, n_valid, ignore_index, smoothing, z_loss, reduction, backend)
        if reduction == "sum":
            return loss.sum()
        if reduction == "mean":
            return loss.sum() / n_keep  # all tokens ignored: 0 / 0 = nan, as torch
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        logits, t, lse, n_keep = ctx.saved_tensors
        vocab_size, start, n_valid, ignore_index, smoothing, z_loss, reduction, backend = ctx.args
        coef = grad_out.float()
        if reduction == "mean":
            coef = coef / n_keep
        coef = coef.reshape(-1).expand(t.shape[0]).contiguous()
        if ctx.copy_first:
            logits = logits.clone()
        x = logits.view(-1, logits.shape[-1])  # the saved tensor's own storage: written in place
        options = dict(vocab_start=start, n_valid=n_valid, ignore_index=ignore_index, backend=backend)
        ce_grad_(x, t, lse, coef, vocab_size=vocab_size, label_smoothing=smoothing, z_loss=z_loss, **options)
        return logits, None, None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    ctx: ParallelContext,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
    vocab_size: int | None = None,
    backend: Backend = "auto",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Cross-entropy over logits split along the vocabulary across the tp ranks.

    Equals ``F.cross_entropy(full_logits.float(), target, ignore_index=..., label_smoothing=...,
    reduction=...)`` on the gathered (unpadded) logits, plus ``z_loss * lse²`` per token
    (PaLM's z-loss, ``lse`` the log-sum-exp of the token's logits). Computed in fp32 whatever
    the logits' dtype; the loss is fp32.

    The backward pass writes the gradient into ``logits_shard``'s storage: do not use the logits
    after calling backward (a leaf tensor is copied first, so a user's parameter is never
    overwritten). See [Note: bounded working memory] in :mod:`shardkit.kernels.cross_entropy`.

    Args:
        logits_shard: ``[..., Vs]`` fp32/bf16/fp16: this tp rank's contiguous ``Vs`` columns
            (rank ``r`` holds classes ``[r Vs, (r+1) Vs)``), the same ``Vs`` on every rank.
        target: int64 ``[...]`` (the logits' leading shape): global class indices.
        ctx: the parallel context; the statistics are all-reduced over ``ctx.group("tp")``.
        ignore_index: targets equal to it add nothing to the loss or the gradient, and are not
            counted by ``reduction="mean"``.
        label_smoothing: ``ε`` in ``[0, 1]``: the target distribution is ``(1 - ε)`` one-hot
            plus ``ε / V`` on every class (torch's definition).
        z_loss: weight of ``lse²`` (0 disables it).
        reduction: ``"none"`` (``[...]``), ``"mean"`` over non-ignored tokens, or ``"sum"``.
        vocab_size: the real vocabulary size ``V`` when it is not ``tp * Vs``: columns past
            ``V`` are padding and are masked (never win the max, get zero gradient).
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.
        stats: optional CommStats recording the two all-reduces.

    Returns:
        fp32 loss: a scalar, or ``[...]`` for ``reduction="none"``.

    Raises:
        ValueError / TypeError: bad shapes, dtypes or options, before any collective.

    Example:
        >>> logits_shard = head(h)                        # ColumnParallelLinear, [b, s, V/tp]
        >>> loss = vocab_parallel_cross_entropy(logits_shard, targets, ctx=ctx)
        >>> loss.backward()
    """
    group = ctx.group("tp")
    tp = group.size()
    if not isinstance(logits_shard, torch.Tensor) or logits_shard.dim() < 1:
        raise ValueError(
            f"logits_shard must be a tensor [..., shard classes], got {getattr(logits_shard, 'shape', logits_shard)}"
        )
    if not isinstance(target, torch.Tensor) or target.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"target must have the logits' leading shape {tuple(logits_shard.shape[:-1])}, got {getattr(target, 'shape', target)}"
        )
    if target.dtype != torch.int64:
        raise TypeError(f"target must be int64, got {target.dtype}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    padded = tp * logits_shard.shape[-1]
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit {tp} shards of {logits_shard.shape[-1]} columns (at most {padded})"
        )
    return _VocabParallelCE.apply(
        logits_shard, target, group, vocab_size, ignore_index, float(label_smoothing), float(z_loss), reduction, backend, stats
    )
