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
from typing import Any

from torch import nn

from shardkit.kernels.flatten import ALIGN_ELEMENTS, bucket_layout

from ..buckets import FIRST_BUCKET_BYTES
from .flat_shards import grad_buckets
from .units import select_units, unit_buckets

__all__ = [
    "FlatLayout",
    "Stage3Layout",
    "UnitLayout",
    "ceil_shard",
    "flat_layout",
    "stage3_layout",
    "stage3_transient",
    "zero12_transient",
]


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


def _add_owned(owned: list[int], offsets: list[int], numels: list[int], shard: int) -> None:
    """Add to ``owned[r]`` the elements of each param that rank ``r``'s shard ``[r·S, (r+1)·S)`` holds."""
    for o, n in zip(offsets, numels):
        for r in range(o // shard, (o + n - 1) // shard + 1):
            owned[r] += min(o + n, (r + 1) * shard) - max(o, r * shard)


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
    buckets = grad_buckets(params, grad_bytes=grad_bytes, bucket_mb=bucket_mb)  # the runtime's buckets
    totals: list[int] = []
    owned = [0] * dp
    for bucket in buckets:
        numels = [p.numel() for p in bucket]
        offsets, total = bucket_layout(numels, align=ALIGN_ELEMENTS, pad_to_multiple_of=dp * ALIGN_ELEMENTS)
        totals.append(total)
        shard = total // dp
        _add_owned(owned, offsets, numels, shard)
    frozen = sum(p.numel() for p in params) - sum(p.numel() for b in buckets for p in b)
    return FlatLayout(dp=dp, totals=tuple(totals), owned=max(owned), frozen=frozen)


# ---- stage 3 ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitLayout:
    """One stage-3 unit's buckets (elements, padded): trainable in launch order, then frozen."""

    name: str
    totals: tuple[int, ...]
    frozen_totals: tuple[int, ...]

    @property
    def gathered(self) -> int:
        """Elements of the unit's full buffers while it is gathered."""
        return sum(self.totals) + sum(self.frozen_totals)


@dataclass(frozen=True)
class Stage3Layout:
    """The units and buckets ``ShardedDataParallel(model, ctx, stage=3, wrap=...)`` builds.

    Attributes:
        dp: data-parallel ranks N.
        units: root unit first, then the others in module (forward) order.
        owned: the most trainable parameter elements any one rank's shards hold.
    """

    dp: int
    units: tuple[UnitLayout, ...]
    owned: int

    @property
    def shards(self) -> int:
        """Elements of this rank's trainable shards (every bucket's ``total // N``)."""
        return sum(t // self.dp for u in self.units for t in u.totals)

    @property
    def frozen_shards(self) -> int:
        """Elements of this rank's frozen shards."""
        return sum(t // self.dp for u in self.units for t in u.frozen_totals)


def stage3_layout(model: nn.Module, *, dp: int, bucket_mb: float, wrap: Any = None) -> Stage3Layout:
    """Replay the stage-3 construction (units, per-unit buckets by param bytes, layout) on shapes.

    Example:
        >>> lay = stage3_layout(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), dp=2, bucket_mb=25)
        >>> [(u.name, u.totals) for u in lay.units]
        [('', ()), ('0', (32,)), ('1', (32,))]
    """
    owned = [0] * dp
    units = []
    for spec in select_units(model, wrap):
        per_kind = []
        for want, buckets in zip((True, False), unit_buckets(spec, bucket_mb=bucket_mb)):  # the runtime's buckets
            totals = []
            for bucket in buckets:
                numels = [p.numel() for p in bucket]
                offsets, total = bucket_layout(numels, align=ALIGN_ELEMENTS, pad_to_multiple_of=dp * ALIGN_ELEMENTS)
                totals.append(total)
                if want:  # frozen params have no optimizer state: not counted as owned
                    _add_owned(owned, offsets, numels, total // dp)
            per_kind.append(tuple(totals))
        units.append(UnitLayout(spec.name, *per_kind))
    return Stage3Layout(dp=dp, units=tuple(units), owned=max(owned))


def stage3_transient(
    layout: Stage3Layout,
    *,
    pb: int,
    gb: int,
    reshard_after_forward: bool,
    in_flight: int,
    staging: bool = False,
    host_epilogue: bool = False,
    secondary_block: int = 0,
) -> int:
    """Peak transient bytes of a stage-3 step, replaying the runtime's order of events.

    Forward: the root unit gathered throughout, unit k plus the prefetched k+1 (all units by the
    end of forward without resharding). Backward, units in reverse: unit k and the prefetched
    k-1 gathered while k's buckets launch, each holding its packed gradient (G·T) with at most
    ``in_flight`` buckets alive; a unit is freed after its last launch (units with frozen
    params and the root at the end). Then the root's buckets. An fp32 copy of every reduced
    shard in the epilogue when G ≠ 4, unless ``host_epilogue`` (offload: the epilogue runs on
    the host copies, [Note: gradient copies overlapped with backward]). Assumes each unit runs once, in module order.

    ``staging`` (``offload_params``): a gather also holds a ``[shard]`` device staging buffer
    (1/N of the unit, [Note: offloaded parameter shards]) from its issue until it is waited: in
    forward the unit being waited and the prefetched next one hold theirs for a moment (the
    root's and the first unit's at the start); in backward (with ``reshard_after_forward``) the
    prefetched unit k-1 holds its own while unit k's gradient buckets launch.

    ``secondary_block`` B > 1 (``reshard_after_forward=B``, [Note: hierarchical gathers]): a unit
    freed after its forward keeps a ``1/B`` piece until its backward gather is waited, so at unit
    k the pieces of units 0..k-1 are alive in forward, and in backward those of 0..k (k's until
    its gather is waited, k-1's while it is prefetched).

    Example:
        >>> lay = stage3_layout(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), dp=2, bucket_mb=25)
        >>> stage3_transient(lay, pb=4, gb=4, reshard_after_forward=True, in_flight=2)
        384
    """
    n = layout.dp
    root, units = layout.units[0], list(layout.units[1:])
    r = pb * root.gathered
    size = [pb * u.gathered for u in units]
    stage = [s // n if staging else 0 for s in size]
    piece = [s // secondary_block if secondary_block > 1 and reshard_after_forward else 0 for s in size]
    peak = r + (r // n if staging else 0) + (size[0] + stage[0] if size else 0)  # the root + the first prefetch
    for k in range(len(size)):
        held = sum(size[: k + 2]) if not reshard_after_forward else sum(size[k : k + 2])
        # pieces of the units freed before k, and k's own as it is freed (the copy precedes the free)
        peak = max(peak, r + held + sum(stage[k : k + 2]) + sum(piece[: k + 1]))
    alive = set(range(len(units))) if not reshard_after_forward else set()
    flight: list[int] = []

    def launch(totals: tuple[int, ...], staged: int) -> int:
        most = 0
        for t in totals:
            del flight[: max(0, len(flight) - in_flight + 1)]
            flight.append(gb * t)
            most = max(most, r + sum(size[j] for j in alive) + staged + sum(flight))
        return most

    for k in reversed(range(len(units))):
        alive |= {k} | ({k - 1} if k else set())  # this unit, and the prefetch of the one before
        staged = stage[k - 1] if (k and reshard_after_forward) else 0  # the prefetch of k-1, not yet waited
        # gathered and prefetched, before k's gather is waited: the pieces of 0..k still alive
        peak = max(peak, r + sum(size[j] for j in alive) + staged + sum(piece[: k + 1]))
        peak = max(peak, launch(units[k].totals, staged) + sum(piece[:k]))
        if units[k].totals and not units[k].frozen_totals:
            alive.discard(k)
    peak = max(peak, launch(root.totals, 0))
    epilogue = 4 * layout.shards if gb != 4 and not host_epilogue else 0
    return max(peak, epilogue)


def ceil_shard(n: int, dp: int) -> int:
    """Elements of one rank's shard of ``n`` (flat buffers are padded to a multiple of ``dp``)."""
    return -(-n // dp)  # ceil: flat buffers are padded to a multiple of N, one shard per rank


def zero12_transient(
    layout: FlatLayout | None,
    psi_t: int,
    *,
    dp: int,
    stage: int,
    pb: int,
    gb: int,
    bucket: int,
    in_flight: int,
    host_epilogue: bool = False,
) -> int:
    """Peak transient bytes of stages 1-2: the largest of three phases that never overlap.

    Backward: ``in_flight`` consecutive buckets reducing at once, each holding its
    reduce-scatter input (stage 2: a packed full bucket, G·T; stage 1: nothing, the persistent
    full gradient is reduced in place into this rank's chunk). Epilogue: an fp32 copy of every reduced shard when G ≠ 4, on
    the device unless ``host_epilogue`` (offload: it runs on the host copies). All-gather: ``in_flight`` consecutive buckets' P·T/N input copies (docs/planner.md). Without
    a model the buckets are the caps (first 1 MiB) and the shards ⌈T/N⌉ of each.

    Example:
        >>> zero12_transient(None, 10**6, dp=2, stage=2, pb=4, gb=4, bucket=25 * 2**20, in_flight=2)
        4000000
    """
    if layout is not None:
        totals, shards = list(layout.totals), sum(layout.shards)
    else:
        totals, left, cap = [], psi_t, min(FIRST_BUCKET_BYTES, bucket) // gb
        while left > 0 and len(totals) <= in_flight:  # later windows are never larger
            totals.append(min(left, max(cap, 1)))
            left -= totals[-1]
            cap = bucket // gb
        shards = ceil_shard(psi_t, dp)
    held = [gb * t if stage == 2 else 0 for t in totals]  # stage 1 reduces its bucket in place
    backward = max((sum(held[i : i + in_flight]) for i in range(len(held))), default=0)
    epilogue = 4 * shards if gb != 4 and not host_epilogue else 0
    inputs = [pb * (t // dp) for t in totals] if layout is not None else [pb * ceil_shard(t, dp) for t in totals]
    gather = max((sum(inputs[i : i + in_flight]) for i in range(len(inputs))), default=0)
    return max(backward, epilogue, gather)
