"""Gradient bucket planning: which parameters share a flat buffer.

This is the part of data parallelism that ZeRO reuses: :func:`plan_buckets` decides which
parameters share a flat buffer (a pure function). The buffer itself (:class:`GradBucket`) and
the object that watches backward and launches one collective per bucket
(:class:`~shardkit.parallel.reducer.GradReducer`, with its named phases and the
[Note: bucket launch order] and [Note: a backward that raised]) live in
:mod:`shardkit.parallel.reducer`; they are re-exported here, ``BucketedGradReducer`` being the
reducer's earlier name.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .reducer import GradBucket, GradReducer

__all__ = ["plan_buckets", "GradBucket", "BucketedGradReducer"]

#: the reducer's earlier name (same class)
BucketedGradReducer = GradReducer

#: torch DDP's default: a small first bucket so communication starts early in backward.
FIRST_BUCKET_BYTES = 1 << 20


def plan_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    cap_bytes: int,
    first_cap_bytes: int | None = FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Group parameter indices into buckets, in reverse registration order.

    A pure function. Parameters are visited from last to first; a bucket is closed when adding
    the next parameter would exceed its cap (a parameter larger than the cap gets a bucket of
    its own). Parameters with different ``keys`` (device, dtype) never share a bucket: a bucket
    holding one key is closed when a parameter of another key arrives.

    Args:
        nbytes: gradient bytes of each parameter, in registration order.
        keys: bucketing key of each parameter (e.g. ``(device, dtype)``).
        cap_bytes: bucket capacity in bytes (> 0).
        first_cap_bytes: capacity of the first bucket (None: same as ``cap_bytes``).

    Returns:
        Lists of parameter indices, bucket 0 first.

    Example:
        >>> plan_buckets([400, 400, 400], ["f32"] * 3, cap_bytes=800, first_cap_bytes=None)
        [[2, 1], [0]]
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    if len(nbytes) != len(keys):
        raise ValueError(f"nbytes and keys differ in length: {len(nbytes)} vs {len(keys)}")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_key: Hashable = None
    for i in reversed(range(len(nbytes))):
        cap = first_cap_bytes if (not buckets and first_cap_bytes) else cap_bytes
        if current and (keys[i] != current_key or current_bytes + nbytes[i] > cap):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes[i]
        current_key = keys[i]
    if current:
        buckets.append(current)
    return buckets
