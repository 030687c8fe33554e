"""The gradient reducer: one object whose named phases carry a step's gradient communication.

Shaped after PyTorch FSDP2's ``FSDPParamGroup``: a :class:`TrainingState` enum and one method
per phase, each under a profiler label, so a trace of any strategy reads the same::

    pre_forward()          shardkit::pre_forward        discard a backward that raised (Note)
    post_forward()         shardkit::post_forward       (stage 3 reshards its units in its own)
    pre_backward()         shardkit::pre_backward       first grad of a backward: queue finalize
    post_backward(bucket)  shardkit::post_backward      a bucket's grads are ready: launch
    finalize_backward()    shardkit::finalize_backward  launch the rest, finish every bucket

What a strategy launches and how it finishes are the two callbacks it gives the reducer:
:class:`~shardkit.parallel.DataParallel` launches an all-reduce of the bucket and finishes by
averaging it back into ``p.grad``; :class:`~shardkit.parallel.ShardedDataParallel` launches a
reduce-scatter into this rank's shard and finishes by accumulating the shard (ZeRO-1/2). The
reducer owns the order (the Notes below); the strategies own the data.

[Note: bucket launch order]
Every rank must issue the same collectives in the same order, or NCCL/gloo deadlock. Buckets
are numbered in reverse registration order (roughly the order backward produces grads) and a
bucket is launched only after every lower-numbered bucket was launched, so a rank whose grads
arrive in another order still issues the same sequence. Buckets whose params got no grad in
this backward (unused parameters) are launched, with zeros for the missing grads, by
``finalize_backward`` — again in order (DataParallel carries which params got a grad inside the
buckets themselves, so no collective follows the last bucket). ``finish`` is called in bucket
order after every bucket was launched, so waits are issued in
launch order too (a strategy that waits earlier, to bound its in-flight buffers, waits the
oldest launched bucket first, which keeps the same order).

[Note: a backward that raised]
The engine runs the end-of-backward callback only when backward completes. If backward raises
(an autograd Function, a hook, a NaN check), some buckets may have launched and the reducer is
left mid-step: :attr:`GradReducer.pending` is then true outside any backward, and the strategy
must call :meth:`GradReducer.pre_forward` (or :meth:`GradReducer.reset`) before the next
backward — both strategies do it at the start of ``forward``. ``reset`` never waits on the
abandoned collectives: a peer that did not fail at the same point never issues the matching
ones. If the ranks failed at different points, their collectives are out of step and the job
must restart; if they failed at the same point (a deterministic error), training can go on.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from shardkit.kernels.flatten import bucket_layout

__all__ = ["GradBucket", "GradReducer", "TrainingState"]


class TrainingState(enum.Enum):
    """Where a step is, as the reducer sees it (FSDP2's states, same meaning)."""

    #: between steps, or between forward and backward
    IDLE = enum.auto()
    #: inside ``forward`` (from pre_forward to post_forward)
    FORWARD = enum.auto()
    #: backward started (first grad seen), no bucket launched yet
    PRE_BACKWARD = enum.auto()
    #: at least one bucket launched; finalize_backward not yet run
    POST_BACKWARD = enum.auto()


@dataclass(eq=False)
class GradBucket:
    """A flat gradient buffer shared by a few parameters.

    Attributes:
        index: launch position (see [Note: bucket launch order]).
        params: the parameters, packed in this order.
        offsets: element offset of each parameter's grad in ``buffer``.
        buffer: 1-D contiguous buffer (the grads' dtype and device), ``numel >= sum(sizes)``.
        ready: positions of the params whose grad is ready in the current backward.
        copied: params whose grad the strategy already moved into ``buffer`` this backward
            (eager copy).
        views: per-param views of ``buffer`` (each param's slot, shaped like it), if the strategy
            made them.
        used: set by a strategy that tracks unused parameters: whether each param got a grad on
            *any* rank since the last reduction; ``None``: every param did (or not tracked).
    """

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)
    copied: set[int] = field(default_factory=set)
    views: list[torch.Tensor] = field(default_factory=list)
    used: list[bool] | None = None

    @classmethod
    def laid_out(
        cls, index: int, params: list[torch.nn.Parameter], *, align: int, pad_to_multiple_of: int = 1
    ) -> tuple[GradBucket, int]:
        """The one bucket builder of DataParallel and ZeRO: ``params`` packed in order, each at an
        ``align``-element boundary (:func:`~shardkit.kernels.flatten.bucket_layout`), the total
        padded to ``pad_to_multiple_of`` (ZeRO: equal shards). The caller allocates ``buffer``
        (DataParallel: the gradients and its used flags; ZeRO: a placeholder beside its flat
        parameter buffer).

        Returns:
            ``(bucket, total)``: the bucket (empty ``buffer``) and the laid-out length in elements.

        Example:
            >>> bucket, total = GradBucket.laid_out(0, [w, b], align=4)
            >>> bucket.offsets, total
            ([0, 12], 15)
        """
        offsets, total = bucket_layout([p.numel() for p in params], align=align, pad_to_multiple_of=pad_to_multiple_of)
        device = params[0].device if params else None
        return cls(index=index, params=list(params), offsets=list(offsets), buffer=torch.empty(0, device=device)), total

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer (what one collective over it moves per rank)."""
        return self.buffer.numel() * self.buffer.element_size()

    def grads_or_zeros(self) -> list[torch.Tensor]:
        """Each param's grad, or a zero tensor (of the bucket's dtype) for a param that got none."""
        dtype = self.buffer.dtype
        return [p.grad if p.grad is not None else torch.zeros_like(p, dtype=dtype) for p in self.params]


class GradReducer:
    """Watches backward and launches one collective per bucket, in order, through named phases.

    Args:
        buckets: the buckets (``index`` = launch order).
        launch: called by :meth:`post_backward` with a bucket once all its grads are ready;
            returns an opaque work handle (DDP: flatten + async all-reduce; ZeRO: flatten +
            async reduce-scatter).
        finish: called as ``finish(bucket, work)`` for every bucket, in order, by
            :meth:`finalize_backward` (DDP: wait + average into ``p.grad``; ZeRO: wait +
            accumulate this rank's shard).
        on_ready: optional; called as ``on_ready(bucket, j)`` the moment param ``j``'s grad is
            final, before the bucket launches — e.g. DataParallel's CPU path copies the grad
            into its slot while it is still in cache (it then adds ``j`` to ``bucket.copied``).
        on_finalize: optional; called at the end of :meth:`finalize_backward`, after every
            ``finish`` — ZeRO-3 frees the units still gathered there.

    Example:
        >>> reducer = GradReducer(buckets, launch=start_all_reduce, finish=wait_and_copy)
        >>> reducer.pre_forward(); out = model(x); reducer.post_forward()
        >>> out.sum().backward()   # post_backward per bucket overlaps backward; finalize at the end
        >>> reducer.state
        <TrainingState.IDLE: 1>
    """

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        *,
        launch: Callable[[GradBucket], Any],
        finish: Callable[[GradBucket, Any], None],
        on_ready: Callable[[GradBucket, int], None] | None = None,
        on_finalize: Callable[[], None] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self._on_finalize = on_finalize
        self._on_ready = on_ready
        self._launch = launch
        self._finish = finish
        self._where: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self._where[p] = (b.index, j)
        self._works: list[Any] = []
        self._callback_queued = False
        self.enabled = True
        self.state = TrainingState.IDLE
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]

    # ---- phases ----------------------------------------------------------------------------
    def pre_forward(self) -> list[tuple[GradBucket, Any]]:
        """Start of ``forward``: discard the reduction of a backward that raised, if any.

        Returns:
            What :meth:`reset` returned (empty when the last backward finished): the strategy
            replaces any buffer an abandoned collective may still write.
        """
        with record_function("shardkit::pre_forward"):
            abandoned = self.reset() if self.pending else []
            self.state = TrainingState.FORWARD
            return abandoned

    def post_forward(self) -> None:
        """End of ``forward``. Nothing to do for replicated or stage-1/2 parameters."""
        with record_function("shardkit::post_forward"):
            self.state = TrainingState.IDLE

    def pre_backward(self) -> None:
        """The first grad of a reducing backward: queue :meth:`finalize_backward` on the engine."""
        with record_function("shardkit::pre_backward"):
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)
            self._callback_queued = True
            self.state = TrainingState.PRE_BACKWARD

    def post_backward(self, bucket: GradBucket) -> None:
        """Launch ``bucket``'s collective (its index must be the next in launch order)."""
        if bucket.index != len(self._works):
            raise RuntimeError(f"bucket {bucket.index} launched out of order (next is {len(self._works)})")
        with record_function("shardkit::post_backward"):
            self.state = TrainingState.POST_BACKWARD
            self._works.append(self._launch(bucket))

    def finalize_backward(self) -> None:
        """End of backward: launch unused buckets in order, then finish every bucket in order."""
        with record_function("shardkit::finalize_backward"):
            try:
                while len(self._works) < len(self.buckets):  # unused params: launch in order anyway
                    self.post_backward(self.buckets[len(self._works)])
                for bucket, work in zip(self.buckets, self._works):
                    self._finish(bucket, work)
                if self._on_finalize is not None:
                    self._on_finalize()
            finally:
                self._clear()

    # ---- control ---------------------------------------------------------------------------
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
        self._works = []
        self._callback_queued = False
        self.state = TrainingState.IDLE

    # ---- the hook --------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        b, j = self._where[p]
        if not self.enabled:
            return
        if not self._callback_queued:
            self.pre_backward()
        self.buckets[b].ready.add(j)
        if self._on_ready is not None:
            self._on_ready(self.buckets[b], j)
        while len(self._works) < len(self.buckets):  # launch every complete bucket, in order
            bucket = self.buckets[len(self._works)]
            if len(bucket.ready) < len(bucket.params):
                return
            self.post_backward(bucket)
