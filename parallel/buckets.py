"""Gradient buckets and the backward hooks that launch one collective per bucket.

This is the part of data parallelism that ZeRO reuses: :func:`plan_buckets` decides which
parameters share a flat buffer, :class:`GradBucket` owns that buffer and its layout, and
:class:`BucketedGradReducer` watches backward and calls a strategy's ``launch(bucket)`` as soon
as every grad of a bucket is ready — DDP launches an all-reduce there, ZeRO-2 a reduce-scatter
into its shard — and ``finish(bucket, work)`` once backward is over.

[Note: bucket launch order]
Every rank must issue the same collectives in the same order, or NCCL/gloo deadlock. Buckets
are numbered in reverse registration order (roughly the order backward produces grads) and a
bucket is launched only after every lower-numbered bucket was launched, so a rank whose grads
arrive in another order still issues the same sequence. Buckets whose params got no grad in
this backward (unused parameters) are launched, with zeros for the missing grads, by the
end-of-backward callback — again in order. With ``agree_used`` (find_unused_parameters), that
callback then issues one more collective, the used-flags agreement, after the last bucket on
every rank. ``finish`` is called in bucket order after every bucket was launched, so waits are
issued in launch order too.

[Note: a backward that raised]
The engine runs the end-of-backward callback only when backward completes. If backward raises
(an autograd Function, a hook, a NaN check), some buckets may have launched and the reducer is
left mid-step: :attr:`BucketedGradReducer.pending` is then true outside any backward, and the
strategy must call :meth:`BucketedGradReducer.reset` before the next backward (DataParallel does
it at the start of ``forward``). ``reset`` never waits on the abandoned collectives: a peer that
did not fail at the same point never issues the matching ones. If the ranks failed at different
points, their collectives are out of step and the job must restart; if they failed at the same
point (a deterministic error), training can go on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["plan_buckets", "GradBucket", "BucketedGradReducer"]

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


@dataclass(eq=False)
class GradBucket:
    """A flat gradient buffer shared by a few parameters.

    Attributes:
        index: launch position (see [Note: bucket launch order]).
        params: the parameters, packed in this order.
        offsets: element offset of each parameter's grad in ``buffer``.
        buffer: 1-D contiguous buffer (the grads' dtype and device), ``numel >= sum(sizes)``.
        ready: positions of the params whose grad is ready in the current backward.
        views: per-param views of ``buffer`` (each param's slot, shaped like it), if the strategy
            made them.
        used: set by the reducer just before ``finish`` when it tracks unused parameters: whether
            each param got a grad on *any* rank since the last reduction. ``None`` otherwise.
    """

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)
    #: params whose grad the strategy already moved into ``buffer`` this backward (eager copy)
    copied: set[int] = field(default_factory=set)
    views: list[torch.Tensor] = field(default_factory=list)
    used: list[bool] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer (what one collective over it moves per rank)."""
        return self.buffer.numel() * self.buffer.element_size()

    def grads_or_zeros(self) -> list[torch.Tensor]:
        """Each param's grad, or a zero tensor (of the bucket's dtype) for a param that got none."""
        dtype = self.buffer.dtype
        return [p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype) for p in self.params]


class BucketedGradReducer:
    """Watches backward and launches one collective per bucket, in order.

    Args:
        buckets: the buckets (``index`` = launch order).
        launch: called with a bucket once all its grads are ready; returns an opaque work
            handle (e.g. the flatten + async all-reduce of DDP).
        finish: called as ``finish(bucket, work)`` for every bucket, in order, at the end of
            backward (e.g. wait + unflatten the averaged grads into ``p.grad``).
        agree_used: optional; track which params got a grad (in this backward or a ``disabled``
            one since the last reduction). At the end of backward, after the last launch, it is
            called with those local flags (int32 CPU tensor, one per param in bucket order, 1 =
            got a grad) and must return the flags of the whole group (e.g. an all-reduce max);
            ``finish`` then sees them as ``bucket.used``.
        on_ready: optional; called as ``on_ready(bucket, j)`` the moment param ``j``'s grad is
            final, before the bucket launches — e.g. DataParallel's CPU path copies the grad
            into its slot while it is still in cache (it then adds ``j`` to ``bucket.copied``).

    Example:
        >>> reducer = BucketedGradReducer(buckets, launch=start_all_reduce, finish=wait_and_copy)
        >>> loss.backward()   # launches overlap backward; finish runs when it ends
        >>> agree = lambda flags: all_reduce(flags, group=dp_group, op="max").output
        >>> reducer = BucketedGradReducer(buckets, launch=..., finish=..., agree_used=agree)
    """

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        *,
        launch: Callable[[GradBucket], Any],
        finish: Callable[[GradBucket, Any], None],
        agree_used: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_ready: Callable[[GradBucket, int], None] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self._on_ready = on_ready
        self._launch = launch
        self._finish = finish
        self._agree_used = agree_used
        self._where: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._first: list[int] = []  # flat index of each bucket's first param
        for b in self.buckets:
            self._first.append(len(self._where))
            for j, p in enumerate(b.params):
                self._where[p] = (b.index, j)
        self._used = [False] * len(self._where)
        self._works: list[Any] = []
        self._callback_queued = False
        self.enabled = True
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block, backward only accumulates local grads (``no_sync``)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def remove(self) -> None:
        """Remove the hooks (the reducer stops acting)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def pending(self) -> bool:
        """A backward started reducing and has not finished. Outside a backward this means the
        last one raised: see [Note: a backward that raised]."""
        return self._callback_queued

    def reset(self) -> list[tuple[GradBucket, Any]]:
        """Forget a backward that never finished, without waiting on anything.

        Returns:
            ``(bucket, work)`` for each bucket it launched: work never waited, whose collective
            may still be writing the bucket's buffer (the strategy decides what to do with it).

        Example:
            >>> if reducer.pending:              # outside backward: the last one raised
            ...     for bucket, work in reducer.reset():
            ...         if not work.is_completed():
            ...             bucket.buffer = torch.zeros_like(bucket.buffer)  # still being written
        """
        abandoned = list(zip(self.buckets, self._works))
        self._clear()
        return abandoned

    def _clear(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.copied.clear()
            bucket.used = None
        self._used = [False] * len(self._used)
        self._works = []
        self._callback_queued = False

    # -- hooks -----------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        b, j = self._where[p]
        self._used[self._first[b] + j] = True  # under `disabled` too: torch DDP's no_sync rule
        if not self.enabled:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        self.buckets[b].ready.add(j)
        if self._on_ready is not None:
            self._on_ready(self.buckets[b], j)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self._works) < len(self.buckets):
            bucket = self.buckets[len(self._works)]
            if len(bucket.ready) < len(bucket.params):
                return
            self._works.append(self._launch(bucket))

    def _on_backward_end(self) -> None:
        try:
            while len(self._works) < len(self.buckets):  # unused params: launch in order anyway
                self._works.append(self._launch(self.buckets[len(self._works)]))
            if self._agree_used is not None:  # after the last launch: see the Note
                agreed = self._agree_used(torch.tensor(self._used, dtype=torch.int32)).tolist()
                for bucket, first in zip(self.buckets, self._first):
                    bucket.used = [bool(u) for u in agreed[first : first + len(bucket.params)]]
            for bucket, work in zip(self.buckets, self._works):
                self._finish(bucket, work)
        finally:
            self._clear()
