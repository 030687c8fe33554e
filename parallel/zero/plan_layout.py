"""The flat-buffer layout ``ShardedDataParallel`` will build for a model, computed without allocating.

The planner's formulas count ⌈Ψ/N⌉ elements per shard; the real stages 1-2 pack each bucket's
parameters at 16-element offsets (``ALIGN_ELEMENTS``, for 128-bit kernel accesses) and pad the
bucket to a multiple of 16·N, so every rank's shard starts aligned ([Note: bucket layout] in
:mod:`shardkit.kernels.flatten`). For a model with many small tensors (biases, norms) that
padding is a few percent of Ψ. :func:`flat_layout` replays the same two pure functions the
runtime calls (:func:`~shardkit.parallel.buckets.plan_buckets`,
:func:`~shardkit.kernels.flatten.bucket_layout`) on the parameters' shapes, so a plan of a model
(meta device fine) counts the padding and the bucket sizes exactly (docs/planner.md, "Exact
layout of a model").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardkit.kernels.flatten import ALIGN_ELEMENTS, bucket_layout

from ..buckets import FIRST_BUCKET_BYTES, plan_buckets

__all__ = ["FlatLayout", "flat_layout"]


@dataclass(frozen=True)
class FlatLayout:
    """Buckets of the stage-1/2 flat buffers for one model and dp size.

    Attributes:
        dp: data-parallel ranks N.
        totals: padded length of each bucket in elements, bucket 0 (launched first) first.
        owned: the most parameter elements (padding excluded) any one rank's shards hold: what
            the optimizer keeps state for on the worst rank.
        frozen: elements of frozen (or empty) parameters, which stay outside the flat buffers.

    Example:
        >>> flat_layout(nn.Linear(3, 2), dp=2, bucket_mb=25, grad_bytes=4).totals
        (32,)
    """

    dp: int
    totals: tuple[int, ...]
    owned: int
    frozen: int

    @property
    def shards(self) -> tuple[int, ...]:
        """This rank's shard of each bucket in elements (``total // N``; equal on every rank)."""
        return tuple(t // self.dp for t in self.totals)


def flat_layout(model: nn.Module, *, dp: int, bucket_mb: float, grad_bytes: int) -> FlatLayout:
    """The bucket layout ``ShardedDataParallel(model, ctx, stage=1|2, bucket_mb=...)`` builds.

    Trainable parameters (``requires_grad``, non-empty; shared ones once) are bucketed by
    gradient bytes (``numel * grad_bytes``) with the first bucket capped at 1 MiB, as
    DataParallel and torch DDP do, then laid out at 16-element offsets and padded to 16·N.

    Args:
        model: the model (any device, meta included: only shapes are read).
        dp: data-parallel ranks N (>= 1).
        bucket_mb: bucket capacity in MiB.
        grad_bytes: bytes per gradient element (4 for the default fp32 gradients).

    Returns:
        A :class:`FlatLayout`.

    Example:
        >>> lay = flat_layout(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), dp=2, bucket_mb=25, grad_bytes=4)
        >>> lay.totals, lay.owned   # [w2 b2 w1 b1] at offsets 0, 16, 32, 48 -> 64 elements
        ((64,), 20)
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad and p.numel() > 0]
    cap = int(bucket_mb * 2**20)
    plan = plan_buckets(
        [p.numel() * grad_bytes for p in trainable],
        [(p.device, p.dtype) for p in trainable],
        cap_bytes=cap,
        first_cap_bytes=min(FIRST_BUCKET_BYTES, cap),
    )
    totals: list[int] = []
    owned = [0] * dp
    for idx in plan:
        numels = [trainable[i].numel() for i in idx]
        offsets, total = bucket_layout(numels, align=ALIGN_ELEMENTS, pad_to_multiple_of=dp * ALIGN_ELEMENTS)
        totals.append(total)
        shard = total // dp
        for o, n in zip(offsets, numels):  # the ranks whose shard [r·S, (r+1)·S) this param overlaps
            for r in range(o // shard, (o + n - 1) // shard + 1):
                owned[r] += min(o + n, (r + 1) * shard) - max(o, r * shard)
    frozen = sum(p.numel() for p in params) - sum(p.numel() for p in trainable)
    return FlatLayout(dp=dp, totals=tuple(totals), owned=max(owned), frozen=frozen)
