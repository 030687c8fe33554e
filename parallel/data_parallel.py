"""``DataParallel``: bucketed, overlapped gradient all-reduce built on shardkit's kernels.

Each rank holds the whole model and a different slice of the batch. During backward, gradients
are packed (one multi-tensor flatten launch per bucket) into flat buckets in reverse
registration order; each bucket's all-reduce starts asynchronously as soon as its last gradient
is ready, overlapping communication with the rest of backward. When backward ends, each bucket
is waited for in order and copied back into ``p.grad`` with the 1/dp averaging fused into the
copy (one unflatten launch per bucket). Communication volume: one all-reduce of every gradient
byte per step (REFERENCE.md: DDP moves 2Ψ per rank over the wire for Ψ bytes of gradients;
:class:`~shardkit.comm.CommStats` records the Ψ payload), plus, with ``find_unused_parameters``,
one all-reduce of 4 bytes per parameter (the used flags).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, broadcast
from shardkit.kernels.flatten import ALIGN_ELEMENTS, bucket_layout, flatten_into, unflatten_from
from shardkit.kernels.layout import is_dense
from shardkit.kernels.runtime import resolve_backend

from .buckets import FIRST_BUCKET_BYTES, BucketedGradReducer, GradBucket, plan_buckets

__all__ = ["DataParallel"]


def _first_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype autograd gives ``p.grad``: ``p.grad_dtype`` (e.g. fp32 grads for bf16 params),
    else ``p.dtype`` (also when ``grad_dtype`` is None, i.e. "any")."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _slot(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """The param's slot of a bucket, laid out like the param (as torch DDP's bucket views).

    A dense non-contiguous param (channels_last) gets a view with its own strides over the same
    ``numel`` elements, so autograd's layout contract (grad strides = param strides) holds for a
    grad that is the view, and copies between grad and slot are plain memory-order copies.
    """
    if param.is_contiguous() or not is_dense(param):
        return buffer.narrow(0, offset, param.numel()).view(param.shape)
    return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)


class DataParallel(nn.Module):
    """Wrap a module for data-parallel training over ``ctx``'s ``dp`` axis.

    Parameters and buffers are broadcast from dp-rank 0 at wrap time, so every replica starts
    identical. Works with any optimizer (torch.optim or shardkit's fused ones): after
    ``backward()`` each ``p.grad`` holds the dp-average.

    Contract and differences from ``torch.nn.parallel.DistributedDataParallel``:

    * **Same model on every rank**: same parameters and buffers, in the same order, shapes and
      dtypes (buckets and the broadcast are built from them). The constructor checks this with
      one tiny all-reduce and raises ``ValueError`` on every rank if it does not hold.
    * **Buffers** (e.g. BatchNorm running stats) are broadcast at wrap time only; torch DDP
      re-broadcasts them from rank 0 before every forward by default. Here each rank's buffers
      evolve from its own data (sync them yourself, or use SyncBatchNorm-style layers, if that
      matters).
    * **Unused parameters**. By default a parameter that got no grad on a rank contributes zeros
      there: one used on some ranks gets the correct average (the sum over the ranks that used
      it, divided by the dp size), but one unused on *every* rank gets a zero grad (torch DDP
      raises instead) — which optimizers with weight decay or momentum then apply. Pass
      ``find_unused_parameters=True`` for models with conditionally used parameters.
    * **A backward that raised** leaves no trace: the next ``forward`` discards its partial
      reduction (see [Note: a backward that raised] in :mod:`shardkit.parallel.buckets`); this is
      safe when every rank failed at the same point. Zero the grads before the next step.
    * **Grad dtype and layout**: buckets use ``p.grad_dtype`` (fp32 grads for bf16 params are
      reduced in fp32); set it before wrapping. Dense non-contiguous params (channels_last) are
      supported; their grads keep the param's layout.
    * **dp = 1** takes the local path: no hooks, no buckets (``buckets`` and ``bucket_bytes``
      are empty), grads are exactly autograd's; ``no_sync`` is a no-op.

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
        find_unused_parameters: as torch DDP's option: at the end of each backward, one extra
            all-reduce (max) of an int32 flag per parameter (1: got a grad on this rank, in this
            backward or a ``no_sync`` one since the last reduction), issued after the last
            bucket on every rank and recorded in ``comm_stats``. Parameters no rank used keep
            their grad untouched (``None`` after ``zero_grad()``, and no bucket view), so
            optimizers skip them exactly as in single-process training. Buckets holding a param
            unused on this rank launch at the end of backward (less overlap).

    Example:
        >>> ctx = ParallelContext.from_env()
        >>> model = DataParallel(TinyGPT(cfg).to(ctx.device), ctx)
        >>> opt = FusedAdamW(model.parameters(), lr=3e-4)
        >>> loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        >>> with model.no_sync():          # gradient accumulation: no communication
        ...     model(x2, y2).backward()
        >>> moe = DataParallel(router_model, ctx, find_unused_parameters=True)  # experts may idle
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
        find_unused_parameters: bool = False,
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
        # [Note: eager vs batched grad copies] On the torch (CPU) path each grad is copied into
        # its slot as soon as autograd produces it, while it is still in cache; on the Triton
        # (CUDA) path a bucket is packed by one multi-tensor launch when it completes.
        self._eager_copy = resolve_backend(backend, _first_device(module)) == "torch"
        self.find_unused_parameters = bool(find_unused_parameters)
        self.comm_stats = stats if stats is not None else CommStats()
        self._group = ctx.group("dp")
        self._dp = ctx.size("dp")
        self.buckets: list[GradBucket] = []
        self._reducer: BucketedGradReducer | None = None
        if self._dp == 1:  # the local path: autograd's grads are already the average
            return
        self._check_same_model()
        self._broadcast_state()
        self._names = {p: name for name, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        plan = plan_buckets(
            [p.numel() * _grad_dtype(p).itemsize for p in params],
            [(p.device, _grad_dtype(p)) for p in params],
            cap_bytes=int(bucket_mb * 2**20),
            first_cap_bytes=min(FIRST_BUCKET_BYTES, int(bucket_mb * 2**20)),
        )
        self.buckets = [self._make_bucket(i, [params[j] for j in idx]) for i, idx in enumerate(plan)]
        self._reducer = BucketedGradReducer(
            self.buckets, launch=self._launch, finish=self._finish,
            agree_used=self._agree_used if self.find_unused_parameters else None,
            on_ready=self._copy_one if self._eager_copy else None,
        )  # fmt: skip

    # -- construction ------------------------------------------------------------------------
    def _make_bucket(self, index: int, params: list[nn.Parameter]) -> GradBucket:
        align = ALIGN_ELEMENTS if self.gradient_as_bucket_view else 1
        offsets, total = bucket_layout([p.numel() for p in params], align=align)
        bucket = GradBucket(index=index, params=params, offsets=list(offsets), buffer=torch.empty(0))
        self._new_buffer(bucket, total, dtype=_grad_dtype(params[0]), device=params[0].device)
        return bucket

    @staticmethod
    def _new_buffer(bucket: GradBucket, total: int, *, dtype: torch.dtype, device: torch.device) -> None:
        # zeroed: alignment gaps are never written and must add nothing to the all-reduce
        bucket.buffer = torch.zeros(total, dtype=dtype, device=device)
        bucket.views = [_slot(bucket.buffer, o, p) for o, p in zip(bucket.offsets, bucket.params)]

    @torch.no_grad()
    def _check_same_model(self) -> None:
        """Raise on every rank if the ranks built different models: one all-reduce (max) of
        ``[n, numel, hash, -n, -numel, -hash]`` gives every rank both the max and the min."""
        params = list(self.module.parameters())
        tensors = params + list(self.module.buffers())
        layout = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
        layout += "|" + ";".join(f"{p.requires_grad}{_grad_dtype(p)}" for p in params)
        mine = [len(params), sum(t.numel() for t in tensors), zlib.crc32(layout.encode())]
        both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.ctx.device)
        all_reduce(both, group=self._group, op="max", stats=self.comm_stats)
        hi, lo = both[:3].tolist(), [-v for v in both[3:].tolist()]
        problems = [
            f"{what}: from {lo[i]} to {hi[i]}"
            for i, what in enumerate(("number of parameters", "number of parameter and buffer elements"))
            if lo[i] != hi[i]
        ]
        if lo[2] != hi[2]:
            problems.append("parameter/buffer shapes, dtypes or requires_grad differ")
        if problems:
            raise ValueError(
                f"DataParallel: the ranks of the dp group built different models ({'; '.join(problems)}); "
                "every rank must build the same model: the same parameters and buffers, in the same "
                "order, with the same shapes and dtypes"
            )

    @torch.no_grad()
    def _broadcast_state(self) -> None:
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

    # -- the bucket callbacks (see parallel/buckets.py) ----------------------------------------
    def _copy_one(self, bucket: GradBucket, j: int) -> None:
        p, slot = bucket.params[j], bucket.views[j]
        g = p.grad
        if g is None or g.dtype != bucket.buffer.dtype or g.device != bucket.buffer.device:
            return  # left to _launch (zeros, or its clear error)
        if not (self.gradient_as_bucket_view and g.data_ptr() == slot.data_ptr()):
            slot.copy_(g)
        if self.gradient_as_bucket_view:
            p.grad = slot
        bucket.copied.add(j)

    def _launch(self, bucket: GradBucket) -> Any:
        as_view = self.gradient_as_bucket_view
        packed: list[torch.Tensor] = []
        packed_offsets: list[int] = []
        to_view: list[int] = []
        for j, (p, slot) in enumerate(zip(bucket.params, bucket.views)):
            if j in bucket.copied:
                continue
            g = p.grad
            if g is None:  # no grad on this rank: contributes zeros
                slot.zero_()
                if as_view and not self.find_unused_parameters:  # else decided in _finish
                    to_view.append(j)
                continue
            if as_view and g.data_ptr() == slot.data_ptr():
                continue  # already lives in its slot (set_to_none=False, no_sync)
            if g.dtype != bucket.buffer.dtype or g.device != bucket.buffer.device:
                raise ValueError(
                    f"DataParallel: the grad of parameter {self._names.get(p, '?')!r} is {g.dtype} on "
                    f"{g.device}, but its bucket was built for {bucket.buffer.dtype} grads on "
                    f"{bucket.buffer.device} (from p.grad_dtype at wrap time: set it before wrapping)"
                )
            if g.is_contiguous() and slot.is_contiguous():
                packed.append(g)
                packed_offsets.append(bucket.offsets[j])
            else:  # e.g. channels_last: one strided copy, for this param only
                slot.copy_(g)
            if as_view:
                to_view.append(j)
        if packed:
            flatten_into(packed, bucket.buffer, packed_offsets, backend=self.backend)
        for j in to_view:  # releases autograd's grad tensors now, not after backward
            bucket.params[j].grad = bucket.views[j]
        return all_reduce(bucket.buffer, group=self._group, op="sum", async_op=True, stats=self.comm_stats)

    def _finish(self, bucket: GradBucket, work: Any) -> None:
        work.wait()
        used = bucket.used  # None unless find_unused_parameters
        scale = 1.0 / self._dp
        if self.gradient_as_bucket_view:
            bucket.buffer.mul_(scale)
            for j, p in enumerate(bucket.params):
                if used is not None and used[j] and p.grad is None:  # used elsewhere only
                    p.grad = bucket.views[j]
            return
        unpacked: list[torch.Tensor] = []
        unpacked_offsets: list[int] = []
        for j, (p, slot) in enumerate(zip(bucket.params, bucket.views)):
            if used is not None and not used[j]:
                continue  # no rank used it: grad untouched (None after zero_grad), as torch DDP
            if p.grad is None:
                p.grad = torch.empty_like(p, dtype=bucket.buffer.dtype)  # keeps the param's layout
            g = p.grad
            if g.is_contiguous() and slot.is_contiguous():
                unpacked.append(g)
                unpacked_offsets.append(bucket.offsets[j])
                continue
            try:
                torch.mul(slot, scale, out=g)
            except RuntimeError as exc:
                raise ValueError(
                    f"DataParallel: cannot write the averaged grad of parameter {self._names.get(p, '?')!r} "
                    f"into its grad (shape {tuple(g.shape)}, strides {g.stride()}): {exc}"
                ) from exc
        if unpacked:
            unflatten_from(bucket.buffer, unpacked, unpacked_offsets, scale=scale, backend=self.backend)

    def _agree_used(self, local: torch.Tensor) -> torch.Tensor:
        flags = local.to(self.buckets[0].buffer.device)
        return all_reduce(flags, group=self._group, op="max", stats=self.comm_stats).output.cpu()

    def _discard_unfinished_backward(self) -> None:
        assert self._reducer is not None
        for bucket, work in self._reducer.reset():
            if not work.is_completed():
                # its collective may still write the buffer: the bucket gets a fresh one (the
                # old one lives as long as the collective holds it)
                buf = bucket.buffer
                self._new_buffer(bucket, buf.numel(), dtype=buf.dtype, device=buf.device)

    # -- public API ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after discarding the reduction of a backward that raised)."""
        if self._reducer is not None and self._reducer.pending:
            self._discard_unfinished_backward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally (no communication) for backwards run inside the block.

        The first backward outside the block all-reduces the accumulated sum, so
        ``k`` micro-batches under ``no_sync`` plus one outside equal one big-batch step
        (with a loss averaged per micro-batch, divide by ``k + 1`` as usual).
        """
        if self._reducer is None:
            yield
            return
        with self._reducer.disabled():
            yield

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket, in launch order (empty at dp = 1: no buckets)."""
        return [b.nbytes for b in self.buckets]
