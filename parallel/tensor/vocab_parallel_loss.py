"""Vocab-parallel cross-entropy: the kernels' two passes around the tp all-reduce of statistics.

Each tp rank holds the logits of its vocabulary shard (``[..., Vs]``, the output of a
column-parallel LM head); no rank ever holds the full ``[tokens, V]`` logits. Forward: one pass
over the shard gives per-token ``(max, sum-exp, target logit, logit sum)``
(:func:`shardkit.kernels.cross_entropy.ce_shard_stats`); two all-reduces over tp combine them
(``max`` of the maxima, then one ``sum`` of ``[3, T]``: the sum-exps rescaled to the global max,
the target logits — non-zero on exactly one rank — and the logit sums, plus the count of
out-of-range targets). Backward: the gradient of the shard, with no communication: each rank's
gradient is local to its columns (see [Note: where the gradient is written]).

Communication per call, ``T`` tokens: all-reduce ``4T`` bytes (max) + ``12T + 4`` bytes (sums
and the target check; ``12T`` with ``check_targets=False``), in CommStats' payload unit, vs.
``2 T V`` or more to gather bf16 logits.

[Note: where the gradient is written]
By default the backward pass writes the gradient into a new ``[T, Vs]`` buffer of the logits'
dtype: the logits are an ordinary autograd input that other ops may also have saved (a z-penalty
``logits.logsumexp(-1)``, a logging op, a soft-cap's ``tanh`` output), and overwriting them would
hand those ops' backward the gradient instead of the logits. Nothing in autograd tells a node who
else saved its input, so writing over the logits — which saves that buffer, the largest transient
of an LM's backward at large vocabularies (``T * Vs`` elements: 1 GiB for 16k tokens of a 32k
bf16 shard) — is the caller's promise: ``inplace_backward=True``. Even then the write bumps the
logits' version counter, so a consumer the caller forgot fails autograd's saved-tensor check
("modified by an inplace operation") instead of computing with the gradient. A leaf is never
overwritten (the user's tensor), and logits whose layout cannot be flattened to ``[T, Vs]``
without a copy (HF's ``logits[:, :-1, :]``) are copied in backward anyway: the gradient is then
written over that private copy whatever the option.

The math, including torch's label-smoothing definition and the z-loss, is in
:mod:`shardkit.kernels.cross_entropy`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from shardkit.comm import CommStats, ParallelContext, all_reduce
from shardkit.kernels.cross_entropy import ce_grad, ce_shard_stats
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


def check_loss_options(reduction: str, label_smoothing: float, z_loss: float) -> None:
    """The cross-entropy options both vocab-parallel losses take, checked (``ValueError`` naming
    the argument).

    Example:
        >>> check_loss_options("mean", 0.1, 0.0)
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def resolve_vocab_size(vocab_size: int | None, tp: int, shard: int) -> int:
    """The real vocabulary size: ``vocab_size``, or ``tp * shard`` when None; it must fit the
    padded ``tp * shard`` classes.

    Example:
        >>> resolve_vocab_size(None, 2, 32), resolve_vocab_size(61, 2, 31)
        (64, 61)
    """
    padded = tp * shard
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp} shards of {shard} classes (at most {padded})")
    return vocab_size


def reduce_shard_stats(
    local: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    stats: CommStats | None = None,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, x_t, q, extra)`` over the whole vocabulary from each rank's ``ce_shard_stats``.

    Two all-reduces over ``group``: ``max`` of the maxima, then one ``sum`` of the sum-exps
    rescaled to the global max, the target logits, the logit sums and ``extra`` (a small fp32
    vector every rank wants summed, e.g. a count of bad targets). ``group=None`` is one shard:
    no collective.

    Args:
        local: fp32 ``[4, T]`` from :func:`shardkit.kernels.cross_entropy.ce_shard_stats`.
        group: the tp group holding the other vocabulary shards, or ``None``.
        stats: optional CommStats recording the two all-reduces.
        extra: optional fp32 ``[k]`` summed over the group alongside.

    Returns:
        fp32 ``[T]`` log-sum-exp, target logit and logit sum, and ``extra`` summed.

    Example:
        >>> lse, x_t, q, _ = reduce_shard_stats(ce_shard_stats(x, t, vocab_start=r * Vs), ctx.group("tp"))
    """
    n = local.shape[1]
    if group is None:
        return local[0] + torch.log(local[1]), local[2], local[3], extra
    m = local[0].clone()
    all_reduce(m, group=group, op="max", stats=stats)
    # A shard with no valid column has m = -inf, s = 0: it contributes 0, not 0 * inf = nan.
    parts = [torch.where(local[1] > 0, local[1] * torch.exp(local[0] - m), 0.0), local[2], local[3]]
    sums = torch.cat(parts if extra is None else [*parts, extra])
    all_reduce(sums, group=group, op="sum", stats=stats)
    rows = sums[: 3 * n].view(3, n)
    return m + torch.log(rows[0]), rows[1], rows[2], None if extra is None else sums[3 * n :]


def token_losses(
    lse: torch.Tensor,
    x_t: torch.Tensor,
    q: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    ignore_index: int,
    smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """fp32 ``[T]`` per-token loss from the global statistics (0 where ``target == ignore_index``).

    ``(1 - ε)(lse - x_t) + ε (lse - q / V) + z lse²``: torch's label smoothing, PaLM's z-loss.

    Example:
        >>> loss = token_losses(lse, x_t, q, t, vocab_size=V, ignore_index=-100, smoothing=0.0, z_loss=0.0)
    """
    loss = (1.0 - smoothing) * (lse - x_t) + z_loss * lse * lse
    if smoothing:
        loss = loss + smoothing * (lse - q / vocab_size)
    return torch.where(target != ignore_index, loss, 0.0)


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
        inplace_backward: bool,
        check_targets: bool,
    ) -> torch.Tensor:
        shard = logits.shape[-1]
        x = logits.reshape(-1, shard)  # a copy only for a layout that cannot be flattened
        t = target.reshape(-1)
        start, n_valid = vocab_shard_range(vocab_size, shard, group.rank())
        local = ce_shard_stats(x, t, vocab_start=start, n_valid=n_valid, ignore_index=ignore_index, backend=backend)
        extra = _out_of_range(t, vocab_size, ignore_index).float().sum().reshape(1) if check_targets else None
        lse, x_t, q, bad = reduce_shard_stats(local, group, stats=stats, extra=extra)
        if check_targets and bad[0] > 0:  # the same verdict on every rank: all raise, none waits
            raise IndexError(_target_error(t, vocab_size, ignore_index, int(bad[0])))
        loss = token_losses(lse, x_t, q, t, vocab_size=vocab_size, ignore_index=ignore_index, smoothing=smoothing, z_loss=z_loss)
        keep = t != ignore_index
        n_keep = keep.sum()
        ctx.save_for_backward(logits, t, lse.contiguous(), n_keep)
        # A leaf's storage is the user's tensor: never overwritten with its own gradient.
        ctx.inplace = inplace_backward and not logits.is_leaf
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
        x = logits.reshape(-1, logits.shape[-1])
        # [Note: where the gradient is written]: over a private copy, over the logits when the
        # caller allows it, else into a new buffer.
        private = logits.numel() > 0 and x.data_ptr() != logits.data_ptr()
        out = x if private or ctx.inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        options = dict(vocab_start=start, n_valid=n_valid, ignore_index=ignore_index, backend=backend)
        ce_grad(x, t, lse, coef, vocab_size=vocab_size, label_smoothing=smoothing, z_loss=z_loss, out=out, **options)
        if out is x and not private:
            # The kernel's stores are invisible to autograd: another saved use of the logits must
            # fail its version check, not read the gradient.
            torch.autograd.graph.increment_version(logits)
        return out.view(logits.shape), None, None, None, None, None, None, None, None, None, None, None


def _out_of_range(t: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    return (t != ignore_index) & ((t < 0) | (t >= vocab_size))


def _target_error(
    t: torch.Tensor, vocab_size: int, ignore_index: int, total: int, fn: str = "vocab_parallel_cross_entropy"
) -> str:
    bad = t[_out_of_range(t, vocab_size, ignore_index)]
    here = f"e.g. {bad[:4].tolist()} on this rank" if bad.numel() else "none of them on this rank"
    return (
        f"{fn}: targets outside [0, {vocab_size}) that are not ignore_index={ignore_index} "
        f"({total} counted over the tp ranks' targets; {here}); F.cross_entropy raises IndexError too. "
        "check_targets=False skips this check (its host sync)"
    )


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
    inplace_backward: bool = False,
    check_targets: bool = True,
) -> torch.Tensor:
    """Cross-entropy over logits split along the vocabulary across the tp ranks.

    Equals ``F.cross_entropy(full_logits.float(), target, ignore_index=..., label_smoothing=...,
    reduction=...)`` on the gathered (unpadded) logits, plus ``z_loss * lse²`` per token
    (PaLM's z-loss, ``lse`` the log-sum-exp of the token's logits). Computed in fp32 whatever
    the logits' dtype; the loss is fp32.

    The logits may have other consumers (a z-penalty, a logging op) and any layout with unit
    stride along the vocabulary (e.g. ``logits[:, :-1, :]``). The backward pass writes the
    gradient into a new buffer unless ``inplace_backward`` (see [Note: where the gradient is
    written] and [Note: bounded working memory] in :mod:`shardkit.kernels.cross_entropy`).

    Args:
        logits_shard: ``[..., Vs]`` fp32/bf16/fp16: this tp rank's contiguous ``Vs`` columns
            (rank ``r`` holds classes ``[r Vs, (r+1) Vs)``), the same ``Vs`` on every rank; any
            strides (a layout that cannot be flattened to ``[T, Vs]`` is copied).
        target: int64 ``[...]`` (the logits' leading shape): global class indices in ``[0, V)``
            or ``ignore_index``; the same on every tp rank.
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
        inplace_backward: write the gradient over ``logits_shard`` (saves one ``[T, Vs]``
            buffer in backward). Only when nothing else uses the logits: no other op saved them
            for its backward (one that did raises autograd's in-place error) and nobody reads
            them after backward. Leaves are never overwritten.
        check_targets: raise ``IndexError`` on every tp rank when a target is outside
            ``[0, V)`` and not ``ignore_index`` (as ``F.cross_entropy``). Costs 4 bytes in the
            existing all-reduce and one host sync; ``False`` skips it (such a target then has
            no target logit: a finite, wrong loss).

    Returns:
        fp32 loss: a scalar, or ``[...]`` for ``reduction="none"``.

    Raises:
        ValueError / TypeError: bad shapes, dtypes or options, before any collective.
        IndexError: an out-of-range target (``check_targets``), on every tp rank alike.

    Example:
        >>> logits = head(h)                              # VocabParallelLMHead, [b, s, V/tp]
        >>> loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], ctx=ctx, vocab_size=V)
        >>> loss = loss + 1e-4 * logits.float().logsumexp(-1).square().mean()   # another consumer: fine
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
    check_loss_options(reduction, label_smoothing, z_loss)
    vocab_size = resolve_vocab_size(vocab_size, tp, logits_shard.shape[-1])
    return _VocabParallelCE.apply(
        logits_shard,
        target,
        group,
        vocab_size,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        reduction,
        backend,
        stats,
        bool(inplace_backward),
        bool(check_targets),
    )
