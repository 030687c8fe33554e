"""``DataParallel``: bucketed, overlapped gradient all-reduce built on shardkit's kernels.

Each rank holds the whole model and a different slice of the batch. During backward, gradients
are packed (one multi-tensor flatten launch per bucket) into flat buckets in reverse
registration order; each bucket's all-reduce starts asynchronously as soon as its last gradient
is ready, overlapping communication with the rest of backward. When backward ends, each bucket
is waited for in order and copied back into ``p.grad`` with the 1/dp averaging fused into the
copy (one unflatten launch per bucket). Communication volume: one all-reduce of every gradient
byte per step (docs/reference.md, "ZeRO memory and communication": DDP moves 2Ψ per rank over the
wire for Ψ bytes of gradients; :class:`~shardkit.comm.CommStats` records the Ψ payload), plus one
element per parameter: the used flags (next Note).

[Note: used flags ride in the buckets]
A parameter that no rank used in a step (an MoE expert no token reached, a head the loss skips)
must keep ``grad=None``, as in single-process training, or optimizers with momentum or weight
decay move it. Each bucket's buffer ends with one element per parameter, set to 1 where this
rank holds a grad for it when the bucket launches; the bucket's own all-reduce sums them, so a
sum of 0 means no rank used the parameter. No extra collective, and no host sync unless this rank
lacked a grad in the bucket (only then are the summed flags read back). Torch DDP needs
``find_unused_parameters=True`` and a separate all-reduce of a bitmap for the same answer.

[Note: fused unscale]
With a ``loss_scaler`` the copy back multiplies by ``1 / (dp * S)`` instead of ``1 / dp`` and
measures what it writes (inf/nan flag, Σg²) in the same pass, so fp16 training does not read and
write every gradient a second time to unscale it. The flag and Σg² accumulate over the buckets in
bucket order (deterministic), and after the last bucket the record goes to the scaler
(``expect_unscaled``); its ``unscale_`` then all-reduces only the 4-byte flag over dp. The norm
needs no all-reduce: after the gradient all-reduce every replica holds the same grads.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, broadcast
from shardkit.kernels.flatten import ALIGN_ELEMENTS, flatten_into, unflatten_from
from shardkit.kernels.grad_epilogue import unscale_and_norm_
from shardkit.kernels.layout import is_dense
from shardkit.kernels.runtime import resolve_backend

from .buckets import FIRST_BUCKET_BYTES, plan_buckets
from .grad_utils import UnscaledGrads
from .loss_scaler import DynamicLossScaler
from .reducer import GradBucket, GradReducer

__all__ = ["DataParallel", "broadcast_module_state", "check_same_model"]


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


def _flat_alias(g: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
    """A contiguous 1-D view of ``g`` whose element k is the slot's flat element k, or None.

    Holds when ``g`` is laid out like its slot (contiguous, or the same dense permuted strides,
    e.g. channels_last): both then store the elements in the same memory order.
    """
    if g.is_contiguous() and slot.is_contiguous():
        return g.view(-1)
    if g.stride() == slot.stride() and is_dense(g):
        return g.as_strided((g.numel(),), (1,))
    return None


@torch.no_grad()
def check_same_model(
    module: nn.Module,
    *,
    group: Any,
    device: torch.device,
    stats: CommStats | None,
    who: str,
    local_error: Exception | None = None,
) -> None:
    """Raise ``ValueError`` on every rank if the ranks of ``group`` built different models, or if
    a check that depends on the rank's own machine (``local_error``) failed on any rank.

    One all-reduce (max) of ``[n, numel, hash, -n, -numel, -hash, failed_0 .. failed_{N-1}]``
    (8 bytes each) gives every rank both the max and the min of the parameter count, the element
    count and a hash of the shapes, dtypes, ``requires_grad`` and grad dtypes, and which ranks
    failed a local check (a directory missing on one node): the rank that failed raises its own
    error, every other rank a ``ValueError`` naming it, instead of entering the next collective
    alone and waiting for the timeout. Shared by DataParallel and ShardedDataParallel.

    Example:
        >>> check_same_model(model, group=ctx.group("dp"), device=ctx.device, stats=None, who="DataParallel")
    """
    params = list(module.parameters())
    tensors = params + list(module.buffers())
    layout = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
    layout += "|" + ";".join(f"{p.requires_grad}{_grad_dtype(p)}" for p in params)
    mine = [len(params), sum(t.numel() for t in tensors), zlib.crc32(layout.encode())]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    failed = [int(local_error is not None and r == rank) for r in range(size)]
    both = torch.tensor(mine + [-v for v in mine] + failed, dtype=torch.int64, device=device)
    all_reduce(both, group=group, op="max", stats=stats)
    bad_ranks = [r for r, f in enumerate(both[6:].tolist()) if f]
    if local_error is not None:
        raise local_error
    if bad_ranks:
        raise ValueError(
            f"{who}: dp rank(s) {bad_ranks} failed a check of their own machine (their error names the "
            "argument, e.g. an nvme_dir missing on that node); every rank stops here, before any other collective"
        )
    hi, lo = both[:3].tolist(), [-v for v in both[3:6].tolist()]
    problems = [
        f"{what}: from {lo[i]} to {hi[i]}"
        for i, what in enumerate(("number of parameters", "number of parameter and buffer elements"))
        if lo[i] != hi[i]
    ]
    if lo[2] != hi[2]:
        problems.append("parameter/buffer shapes, dtypes or requires_grad differ")
    if problems:
        raise ValueError(
            f"{who}: the ranks of the dp group built different models ({'; '.join(problems)}); "
            "every rank must build the same model: the same parameters and buffers, in the same "
            "order, with the same shapes and dtypes"
        )


@torch.no_grad()
def broadcast_module_state(module: nn.Module, *, group: Any, stats: CommStats | None) -> None:
    """Copy rank 0's parameters and buffers into every rank's, one broadcast per (device, dtype).

    Example:
        >>> broadcast_module_state(model, group=ctx.group("dp"), stats=None)
    """
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.numel() > 0]
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for group_tensors in by_key.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        broadcast(flat, src=0, group=group, stats=stats)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


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
    * **Unused parameters** need no option: a parameter that got no grad on a rank contributes
      zeros there, so one used on some ranks gets the correct average (the sum over the ranks
      that used it, divided by the dp size), and one unused on *every* rank keeps its grad
      untouched (``None`` after ``zero_grad()``), so optimizers skip it as in single-process
      training. The flags ride in the buckets (one element per parameter; [Note: used flags
      ride in the buckets]). Torch DDP needs ``find_unused_parameters=True`` for this.
    * **A backward that raised** leaves no trace: the next ``forward`` discards its partial
      reduction (see [Note: a backward that raised] in :mod:`shardkit.parallel.reducer`); this is
      safe when every rank failed at the same point. Zero the grads before the next step.
    * **Grad dtype and layout**: buckets use ``p.grad_dtype`` (fp32 grads for bf16 params are
      reduced in fp32); set it before wrapping. Dense non-contiguous params (channels_last) are
      supported; their grads keep the param's layout.
    * **dp = 1** takes the local path: no hooks, no buckets (``buckets`` and ``bucket_bytes``
      are empty), grads are exactly autograd's; ``no_sync`` is a no-op.
    * **With** ``loss_scaler`` (fp16), ``p.grad`` holds the *unscaled* average right after
      backward (torch DDP + a scaler: still scaled until ``unscale_``): the division by the
      loss scale is fused into the copy back. Change grads only after ``scaler.unscale_()``.

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
        find_unused_parameters: accepted for torch DDP compatibility and changes nothing:
            unused parameters are always detected (see the contract above). As in torch DDP,
            a bucket holding a param unused on this rank launches at the end of backward (less
            overlap).
        loss_scaler: the fp16 :class:`~shardkit.parallel.DynamicLossScaler` whose
            ``scale_loss`` drives backward. The copy back from each all-reduced bucket then
            multiplies by ``1 / (dp * S)`` instead of ``1 / dp`` and flags inf/nan and sums g² in
            the same pass (on CUDA one epilogue launch reads the bucket and writes ``p.grad``),
            so ``scaler.unscale_(...)`` afterwards reads and writes no grad: it only agrees the
            overflow over the dp group and clips. Same results as unscaling afterwards, with one
            rounding instead of two.

    Example:
        >>> ctx = ParallelContext.from_env()
        >>> model = DataParallel(TinyGPT(cfg).to(ctx.device), ctx)
        >>> opt = FusedAdamW(model.parameters(), lr=3e-4)
        >>> loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        >>> with model.no_sync():          # gradient accumulation: no communication
        ...     model(x2, y2).backward()
        >>> moe = DataParallel(router_model, ctx)  # an expert no rank routed to keeps grad=None
        >>> scaler = DynamicLossScaler()                       # fp16: unscale fused into backward
        >>> model = DataParallel(fp16_model, ctx, loss_scaler=scaler)
        >>> scaler.scale_loss(model(x, y)).backward()
        >>> report = scaler.unscale_(model.parameters(), group=ctx.group("dp"), max_norm=1.0)
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
        loss_scaler: DynamicLossScaler | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}")
        self.loss_scaler = loss_scaler
        self._unscaled: UnscaledGrads | None = None  # filled bucket by bucket in _finish
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
        # parameters are replicated over dp and cp: [Note: the dp_cp group] (the dp group when cp == 1)
        self._group = ctx.group("dp_cp")
        self._dp = ctx.size("dp_cp")
        self.buckets: list[GradBucket] = []
        self._reducer: GradReducer | None = None
        self._locally_unused: set[int] = set()  # buckets launched with a param this rank has no grad for
        if self._dp == 1:  # the local path: autograd's grads are already the average
            return
        check_same_model(module, group=self._group, device=ctx.device, stats=self.comm_stats, who="DataParallel")
        broadcast_module_state(module, group=self._group, stats=self.comm_stats)
        self._names = {p: name for name, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        plan = plan_buckets(
            [p.numel() * _grad_dtype(p).itemsize for p in params],
            [(p.device, _grad_dtype(p)) for p in params],
            cap_bytes=int(bucket_mb * 2**20),
            first_cap_bytes=min(FIRST_BUCKET_BYTES, int(bucket_mb * 2**20)),
        )
        self.buckets = [self._make_bucket(i, [params[j] for j in idx]) for i, idx in enumerate(plan)]
        self._reducer = GradReducer(
            self.buckets,
            launch=self._launch,
            finish=self._finish,
            on_ready=self._copy_one if self._eager_copy else None,
        )

    # -- construction ------------------------------------------------------------------------
    def _make_bucket(self, index: int, params: list[nn.Parameter]) -> GradBucket:
        align = ALIGN_ELEMENTS if self.gradient_as_bucket_view else 1
        bucket, total = GradBucket.laid_out(index, params, align=align)
        # + one used flag per param after the grads: [Note: used flags ride in the buckets]
        self._new_buffer(bucket, total + len(params), dtype=_grad_dtype(params[0]), device=params[0].device)
        return bucket

    @staticmethod
    def _grads_of(bucket: GradBucket) -> torch.Tensor:
        """The bucket's buffer without the used flags at its end."""
        return bucket.buffer.narrow(0, 0, bucket.buffer.numel() - len(bucket.params))

    @staticmethod
    def _flags_of(bucket: GradBucket) -> torch.Tensor:
        """The used flags at the end of the bucket's buffer, one per param."""
        n = len(bucket.params)
        return bucket.buffer.narrow(0, bucket.buffer.numel() - n, n)

    @staticmethod
    def _new_buffer(bucket: GradBucket, total: int, *, dtype: torch.dtype, device: torch.device) -> None:
        # zeroed: alignment gaps are never written and must add nothing to the all-reduce
        bucket.buffer = torch.zeros(total, dtype=dtype, device=device)
        bucket.views = [_slot(bucket.buffer, o, p) for o, p in zip(bucket.offsets, bucket.params)]

    # -- what post_backward launches and finalize_backward finishes (see parallel/reducer.py) ---
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
            if g is None:  # no grad on this rank: contributes zeros (grad set in _finish if used elsewhere)
                slot.zero_()
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
        has_grad = [p.grad is not None for p in bucket.params]
        if all(has_grad):  # the usual case: a fill on the device, no host-to-device copy
            self._flags_of(bucket).fill_(1)
            self._locally_unused.discard(bucket.index)
        else:
            self._flags_of(bucket).copy_(torch.tensor(has_grad, dtype=bucket.buffer.dtype))
            self._locally_unused.add(bucket.index)
        return all_reduce(bucket.buffer, group=self._group, op="sum", async_op=True, stats=self.comm_stats)

    def _finish(self, bucket: GradBucket, work: Any) -> None:
        work.wait()
        # None: every param used here, hence used (no host sync); else the summed flags decide
        used = [f > 0 for f in self._flags_of(bucket).tolist()] if bucket.index in self._locally_unused else None
        bucket.used = used
        scale = 1.0 / self._dp
        record = None
        if self.loss_scaler is not None:  # [Note: fused unscale] one pass: average + unscale + stats
            if bucket.index == 0:
                device = bucket.buffer.device
                self._unscaled = UnscaledGrads(
                    self.loss_scaler.scale, {}, torch.zeros(1, device=device), torch.zeros(1, device=device)
                )
            record = self._unscaled
            scale = 1.0 / (self._dp * record.loss_scale)
        if self.gradient_as_bucket_view:
            if record is None:
                self._grads_of(bucket).mul_(scale)
            else:  # the zero gaps add nothing to the flag or the norm
                unscale_and_norm_(
                    [self._grads_of(bucket)],
                    inv_scale=scale,
                    found_inf=record.found_inf,
                    sumsq=record.sumsq,
                    backend=self.backend,
                )
            for j, p in enumerate(bucket.params):
                if used is not None and used[j] and p.grad is None:  # used elsewhere only
                    p.grad = bucket.views[j]
        else:
            self._copy_back(bucket, scale, record)
        if record is not None:
            for j, p in enumerate(bucket.params):
                if (used is None or used[j]) and p.grad is not None:
                    record.grads[id(p)] = (p, p.grad, p.grad._version)
            if bucket.index == len(self.buckets) - 1:
                self.loss_scaler.expect_unscaled(record)
                self._unscaled = None

    def _copy_back(self, bucket: GradBucket, scale: float, record: UnscaledGrads | None) -> None:
        """``p.grad = cast(scale * slot)`` for every param of the bucket; with ``record``, also
        flag inf/nan and accumulate Σg² of what was written."""
        used = bucket.used
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        offsets: list[int] = []
        odd: list[torch.Tensor] = []  # grads laid out unlike their slot
        for j, (p, slot) in enumerate(zip(bucket.params, bucket.views)):
            if used is not None and not used[j]:
                continue  # no rank used it: grad untouched (None after zero_grad), as torch DDP
            if p.grad is None:
                p.grad = torch.empty_like(p, dtype=bucket.buffer.dtype)  # keeps the param's layout
            g = p.grad
            flat = _flat_alias(g, slot)
            if flat is not None:
                srcs.append(bucket.buffer.narrow(0, bucket.offsets[j], g.numel()))
                dsts.append(flat)
                offsets.append(bucket.offsets[j])
                continue
            try:
                torch.mul(slot, scale, out=g)
            except RuntimeError as exc:
                raise ValueError(
                    f"DataParallel: cannot write the averaged grad of parameter {self._names.get(p, '?')!r} "
                    f"into its grad (shape {tuple(g.shape)}, strides {g.stride()}): {exc}"
                ) from exc
            odd.append(g)
        if record is not None and dsts and not self._eager_copy:
            # Triton: one launch reads the bucket and writes the grads, flag and Σg² included
            unscale_and_norm_(
                srcs, out=dsts, inv_scale=scale, found_inf=record.found_inf, sumsq=record.sumsq, backend=self.backend
            )
        elif dsts:
            # torch (CPU): the one-pass scaled copy, then a read-only norm pass over the result
            # (the epilogue's torch path with ``out=`` goes through a temporary: slower here)
            unflatten_from(bucket.buffer, dsts, offsets, scale=scale, backend=self.backend)
            if record is not None:
                unscale_and_norm_(dsts, found_inf=record.found_inf, sumsq=record.sumsq, backend=self.backend)
        if record is not None and odd:
            unscale_and_norm_([g.contiguous() for g in odd], found_inf=record.found_inf, sumsq=record.sumsq, backend=self.backend)

    def _discard_unfinished_backward(self, abandoned: list[tuple[GradBucket, Any]]) -> None:
        for bucket, work in abandoned:
            if not work.is_completed():
                # its collective may still write the buffer: the bucket gets a fresh one (the
                # old one lives as long as the collective holds it)
                buf = bucket.buffer
                self._new_buffer(bucket, buf.numel(), dtype=buf.dtype, device=buf.device)

    # -- public API ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after discarding the reduction of a backward that raised)."""
        if self._reducer is None:
            return self.module(*args, **kwargs)
        self._discard_unfinished_backward(self._reducer.pre_forward())
        try:
            return self.module(*args, **kwargs)
        finally:
            self._reducer.post_forward()

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
