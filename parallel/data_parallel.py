"""``DataParallel``: bucketed, overlapped gradient all-reduce built on shardkit's kernels.

Each rank holds the whole model and a different slice of the batch. During backward, gradients
are packed (one multi-tensor flatten launch per bucket) into flat buckets in reverse
registration order; each bucket's all-reduce starts asynchronously as soon as its last gradient
is ready, overlapping communication with the rest of backward. When backward ends, each bucket
is waited for in order and copied back into ``p.grad`` with the 1/dp averaging fused into the
copy (one unflatten launch per bucket). Communication volume: one all-reduce of every gradient
byte per step (REFERENCE.md: DDP moves 2Ψ per rank over the wire for Ψ bytes of gradients;
:class:`~shardkit.comm.CommStats` records the Ψ payload).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, broadcast
from shardkit.kernels.flatten import ALIGN_ELEMENTS, bucket_layout, bucket_views, flatten_into, unflatten_from

from .buckets import FIRST_BUCKET_BYTES, BucketedGradReducer, GradBucket, plan_buckets

__all__ = ["DataParallel"]


class DataParallel(nn.Module):
    """Wrap a module for data-parallel training over ``ctx``'s ``dp`` axis.

    Parameters and buffers are broadcast from dp-rank 0 at wrap time, so every replica starts
    identical. Works with any optimizer (torch.optim or shardkit's fused ones): after
    ``backward()`` each ``p.grad`` holds the dp-average.

    Args:
        module: the model (already on its device).
        ctx: the parallel context; its ``dp`` group carries the all-reduces.
        bucket_mb: bucket capacity in MiB (the first bucket is capped at 1 MiB, as torch DDP,
            so communication starts early).
        stats: a :class:`~shardkit.comm.CommStats` to record into (default: a new one, exposed
            as ``.comm_stats``).
        backend: kernel backend for flatten/unflatten (``"auto"``: Triton on CUDA, torch on
            CPU; ``"triton"`` runs the interpreter on CPU, for tests).
        gradient_as_bucket_view: make each ``p.grad`` a view into its bucket (as torch DDP's
            option of the same name). Saves one full copy of the gradients (autograd's grad
            tensors are released as each bucket launches) and the copy back after the
            all-reduce (averaging becomes one in-place scale of the bucket). Slots are then
            aligned to 16 elements so the optimizer's kernels keep 128-bit accesses; the
            all-reduce carries those few padding elements too. Grads stay views until
            ``zero_grad(set_to_none=True)``; with ``set_to_none=False`` backward accumulates
            straight into the bucket.

    Example:
        >>> ctx = ParallelContext.from_env()
        >>> model = DataParallel(TinyGPT(cfg).to(ctx.device), ctx)
        >>> opt = FusedAdamW(model.parameters(), lr=3e-4)
        >>> loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        >>> with model.no_sync():          # gradient accumulation: no communication
        ...     model(x2, y2).backward()
    """

    def __init__(
        self,
        module: nn.Module,
        ctx: ParallelContext,
        *,
        bucket_mb: float = 25.0,
        stats: CommStats | None = None,
        backend: str = "auto",
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        self.ctx = ctx
        self.backend = backend
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.comm_stats = stats if stats is not None else CommStats()
        self._group = ctx.group("dp")
        self._dp = ctx.size("dp")
        params = [p for p in module.parameters() if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            params = list({id(p): p for p in params}.values())
        self._broadcast_state()
        plan = plan_buckets(
            [p.numel() * p.element_size() for p in params],
            [(p.device, p.dtype) for p in params],
            cap_bytes=int(bucket_mb * 2**20),
            first_cap_bytes=min(FIRST_BUCKET_BYTES, int(bucket_mb * 2**20)),
        )
        self.buckets = [self._make_bucket(i, [params[j] for j in idx]) for i, idx in enumerate(plan)]
        self._reducer = BucketedGradReducer(self.buckets, launch=self._launch, finish=self._finish)

    # -- construction ------------------------------------------------------------------------
    def _make_bucket(self, index: int, params: list[nn.Parameter]) -> GradBucket:
        align = ALIGN_ELEMENTS if self.gradient_as_bucket_view else 1
        offsets, total = bucket_layout([p.numel() for p in params], align=align)
        # zeroed: alignment gaps are never written and must add nothing to the all-reduce
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        bucket = GradBucket(index=index, params=params, offsets=list(offsets), buffer=buffer)
        if self.gradient_as_bucket_view:
            bucket.views = bucket_views(buffer, offsets, [p.shape for p in params])
        return bucket

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        if self._dp == 1:
            return
        tensors = [t for t in list(self.module.parameters()) + list(self.module.buffers()) if t.numel() > 0]
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.device, t.dtype), []).append(t)
        for (device, dtype), group in by_key.items():  # one broadcast per (device, dtype)
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            broadcast(flat, src=0, group=self._group, stats=self.comm_stats)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # -- the two bucket callbacks (see parallel/buckets.py) ------------------------------------
    def _launch(self, bucket: GradBucket) -> Any:
        if self.gradient_as_bucket_view:
            # grads already living in their slot (set_to_none=False, no_sync) need no copy
            todo = [j for j, (p, v) in enumerate(zip(bucket.params, bucket.views))
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr()]  # fmt: skip
            live = [j for j in todo if bucket.params[j].grad is not None]
            for j in todo:
                if bucket.params[j].grad is None:  # unused this backward: contributes zeros
                    bucket.views[j].zero_()
            if live:
                flatten_into([bucket.params[j].grad for j in live], bucket.buffer,
                             [bucket.offsets[j] for j in live], backend=self.backend)  # fmt: skip
            for j in todo:  # releases autograd's grad tensors now, not after backward
                bucket.params[j].grad = bucket.views[j]
        else:
            flatten_into(bucket.grads_or_zeros(), bucket.buffer, bucket.offsets, backend=self.backend)
        if self._dp == 1:
            return None
        return all_reduce(bucket.buffer, group=self._group, op="sum", async_op=True, stats=self.comm_stats)

    def _finish(self, bucket: GradBucket, work: Any) -> None:
        if work is not None:
            work.wait()
        if self.gradient_as_bucket_view:
            if self._dp > 1:
                bucket.buffer.mul_(1.0 / self._dp)
            return
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
        grads = [p.grad for p in bucket.params]
        unflatten_from(bucket.buffer, grads, bucket.offsets, scale=1.0 / self._dp, backend=self.backend)

    # -- public API ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally (no communication) for backwards run inside the block.

        The first backward outside the block all-reduces the accumulated sum, so
        ``k`` micro-batches under ``no_sync`` plus one outside equal one big-batch step
        (with a loss averaged per micro-batch, divide by ``k + 1`` as usual).
        """
        with self._reducer.disabled():
            yield

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [b.nbytes for b in self.buckets]
