"""Flat padded per-rank shards of parameters, master weights and gradients (ZeRO-1/2 data path).

Layout (shared with DataParallel, see [Note: bucket layout] in :mod:`shardkit.kernels.flatten`):
a bucket's params are packed by ``bucket_layout(numels, align=ALIGN_ELEMENTS,
pad_to_multiple_of=N * ALIGN_ELEMENTS)`` into ``total`` elements; rank ``r`` of the ``N``
data-parallel ranks owns elements ``[r * total/N, (r + 1) * total/N)``, which
:func:`~shardkit.kernels.flatten.shard_segments` maps back to at most one 1-D segment per param.
Every shard starts on a 16-element boundary, so the kernels keep 128-bit accesses.

What a rank holds per bucket (bytes per rank, Ψ elements per bucket, b = param bytes, g = grad
bytes, fp32 master only when b < 4), docs/reference.md "ZeRO memory and communication":

=====================  ============================  ==========================================
tensor                 stage 1                       stage 2
=====================  ============================  ==========================================
``flat_param``         bΨ (params are views of it)   bΨ
gradients              ``grad_full``: gΨ              ``grad_shard``: gΨ/N
master (b < 4)         4Ψ/N                          4Ψ/N
optimizer state        on the master shard: e.g. Adam 8Ψ/N
transient (peak)       shard gΨ/N (reduce-scatter     two buckets in flight, each gΨ + gΨ/N;
                       output), bΨ/N (all-gather in)  bΨ/N (all-gather input)
=====================  ============================  ==========================================

Communication per step: one reduce-scatter of every bucket (payload gΨ) during backward and one
all-gather of the updated params (payload bΨ) after the step: 2Ψ elements, the same as DDP's one
all-reduce, which CommStats records as Ψ and the ZeRO paper counts as 2Ψ (see
:func:`paper_comm_bytes`).

[Note: the reduced shard is final only after the step epilogue]
The reduce-scatter *sums*; the 1/N average (and 1/S for fp16 loss scaling) is applied once per
optimizer step by :meth:`FlatShards.epilogue`, in the same pass that flags inf/nan and sums g²
of this rank's shard. Backwards between two steps therefore add raw sums (stage 2: every
backward reduce-scatters and accumulates into the shard; stage 1: earlier micro-batches run
under ``no_sync`` and accumulate locally in the full gradient), and the epilogue runs once.

[Note: params without a gradient are not stepped]
``torch.optim`` skips a param whose ``.grad`` is None: no weight decay, no momentum, its state
untouched. A param that got no gradient on ANY rank since the last ``zero_grad`` (an MoE expert
no token reached anywhere, a branch not taken) must be skipped too, while one that got a
gradient on some ranks only is stepped with the average (the others contribute zeros, as
DataParallel does). Which case it is needs every rank's view: each reduction records, per param,
whether it had a ``.grad`` on this rank (``sb.got_grad``, OR-ed over the backwards of a step;
stage 1's ``zero_grad(set_to_none=False)`` keeps zeroed ``.grad`` views, so those params count as
having one, as in torch); ``ShardedDataParallel.finalize_gradients`` sums the flags over dp in the
all-reduce it issues anyway for the norm/overflow (one float per param; alone, and as small,
when neither is asked for); and ``ZeroOptimizer.step`` hides the ``.grad`` of the shard params of
params nobody had a gradient for (:meth:`FlatShards.unstepped`). The host reads the agreed flags
only on a rank that missed some gradient itself: a rank that had every gradient steps everything,
whatever the others had, so a step where all params are used costs no host sync.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from shardkit.comm import CommStats, all_gather, reduce_scatter
from shardkit.kernels.flatten import Segment, flatten_into
from shardkit.kernels.grad_epilogue import unscale_and_norm_

from ..buckets import FIRST_BUCKET_BYTES, plan_buckets
from ..reducer import GradBucket
from .offload import HostGradients
from .sharded_bucket import ShardedBucket
from .sync_check import SyncCheck

__all__ = ["FlatShards", "grad_buckets", "paper_comm_bytes"]

#: buckets whose reduce-scatter may be in flight at once in stage 2 (each holds a full-size
#: transient gradient buffer): two overlap communication with the next bucket's backward
MAX_IN_FLIGHT = 2


def paper_comm_bytes(summary: dict[str, dict]) -> int:
    """Communication in the ZeRO paper's units from a ``CommStats.summary()``.

    CommStats records payload bytes (an all-reduce of Ψ as Ψ, a reduce-scatter as its input Ψ,
    an all-gather as its output Ψ). The paper counts an all-reduce as 2Ψ (reduce-scatter +
    all-gather), so this is the sum of payloads with all-reduces counted twice: DDP, ZeRO-1
    and ZeRO-2 then all give 2Ψ per step and compare like for like.

    Example:
        >>> paper_comm_bytes({"all_reduce": {"calls": 1, "bytes": 400}})
        800
    """
    return sum(v["bytes"] * (2 if op == "all_reduce" else 1) for op, v in summary.items())


def _unwritten(gb: GradBucket, total: int) -> list[tuple[int, int]]:
    """``(start, length)`` of a bucket's elements no grad of this backward fills: alignment gaps,
    the tail padding, and the slots of params that got no grad (they contribute zeros)."""
    spans = sorted((off, p.numel(), p.grad is None) for off, p in zip(gb.offsets, gb.params))
    out, end = [], 0
    for off, n, missing in spans:
        if off > end:
            out.append((end, off - end))
        if missing and n:
            out.append((off, n))
        end = max(end, off + n)
    if total > end:
        out.append((end, total - end))
    return out


def grad_buckets(params: list[nn.Parameter], *, grad_bytes: int, bucket_mb: float) -> list[list[nn.Parameter]]:
    """Stages 1-2's buckets: the trainable non-empty params, bucketed by gradient bytes
    (``numel * grad_bytes``) up to ``bucket_mb`` MiB, the first capped at 1 MiB as DataParallel
    and torch DDP do (the last layer's gradients, ready first, go out early).

    The one bucketing of stages 1-2: :class:`~shardkit.parallel.zero.ShardedDataParallel` builds
    these buckets and the planner (:func:`~shardkit.parallel.zero.plan_layout.flat_layout`) lays
    them out.

    Example:
        >>> [len(b) for b in grad_buckets(list(nn.Linear(4, 2).parameters()), grad_bytes=4, bucket_mb=25)]
        [2]
    """
    trainable = [p for p in params if p.requires_grad and p.numel() > 0]
    cap = int(bucket_mb * 2**20)
    plan = plan_buckets(
        [p.numel() * grad_bytes for p in trainable],
        [(p.device, p.dtype) for p in trainable],
        cap_bytes=cap,
        first_cap_bytes=min(FIRST_BUCKET_BYTES, cap),
    )
    return [[trainable[i] for i in idx] for idx in plan]


class FlatShards:
    """The stage-1/2 runtime: builds the shards, and is the reducer's launch/finish pair.

    Args:
        buckets: parameters per bucket, bucket 0 first (one dtype and device per bucket).
        group: the dp process group; ``rank``/``size`` its rank and size.
        stage: 1 (full gradient kept) or 2 (only this rank's gradient shard kept).
        grad_dtype: dtype of the gradient reduction and storage.
        stats: CommStats for the collectives.
        backend: kernel backend for the flatten copies and the epilogue.
        offload: the optimizer keeps the fp32 masters and steps elsewhere (CPU/NVMe): no
            device masters and no device shard params are built; each reduced shard is copied
            to :attr:`host` as its reduce-scatter completes, the epilogue and clip run on the
            host copies ([Note: gradient copies overlapped with backward] in ``offload.py``),
            the optimizer reads ``sb.opt_grad`` (the host fp32 buffer) and writes
            ``sb.local_param_shard()`` before :meth:`all_gather_params`.
        check_sync: before each collective (bucket reduce-scatter, step epilogue, parameter
            all-gather) agree over dp which one it is ([Note: diverged ranks] in
            :mod:`~shardkit.parallel.zero.sync_check`); ``self.sync`` is then the
            :class:`~shardkit.parallel.zero.sync_check.SyncCheck`, else None.

    Example:
        >>> shards = FlatShards([[w, b]], group=dp, rank=0, size=2, stage=2,
        ...                     grad_dtype=torch.float32, stats=CommStats())
        >>> reducer = GradReducer([s.grad_bucket for s in shards.buckets],
        ...                       launch=shards.launch, finish=shards.finish)
    """

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        *,
        group: Any,
        rank: int,
        size: int,
        stage: int,
        grad_dtype: torch.dtype,
        stats: CommStats,
        backend: str = "auto",
        offload: bool = False,
        check_sync: bool = False,
    ) -> None:
        self.group, self.rank, self.size, self.stage = group, rank, size, stage
        self.offload = offload
        self.grad_dtype = grad_dtype
        self.stats = stats
        self.backend = backend
        self.buckets = [self._build(i, params) for i, params in enumerate(buckets)]
        self.host: HostGradients | None = None
        if offload:  # the epilogue's fp32 gradient is the host buffer, for good
            device = self.buckets[0].flat_param.device if self.buckets else torch.device("cpu")
            self.host = HostGradients([sb.shard for sb in self.buckets], grad_dtype=grad_dtype, device=device, backend=backend)
            for sb, g in zip(self.buckets, self.host.fp32):
                self._bind_opt_grad(sb, g)
        self._in_flight: deque[tuple[ShardedBucket, Any, torch.Tensor | None, torch.Tensor]] = deque()
        self._transient = 0
        self.peak_transient_bytes = 0
        self.finalized = False  # the epilogue ran since the last zero_grad
        self._versions = self._param_versions()  # [Note: params written between steps]
        self.sync: SyncCheck | None = None
        if check_sync:
            device = self.buckets[0].flat_param.device if self.buckets else torch.device("cpu")
            who = f"ShardedDataParallel(stage={stage}, check_sync=True)"
            self.sync = SyncCheck(group, size, stats, device, who=who)

    # ---- construction ------------------------------------------------------------------------
    @torch.no_grad()
    def _build(self, index: int, params: list[nn.Parameter]) -> ShardedBucket:
        sb = ShardedBucket.from_params(index, params, size=self.size, rank=self.rank, backend=self.backend)
        sb.param_views = []  # stages 1-2: the params stay views of flat_param for good
        dtype = sb.flat_param.dtype
        if not (dtype == torch.float32 or self.offload):
            sb.master = sb.local_param_shard().float()
        if self.stage == 1:
            self._new_grad_full(sb)
            if self.grad_dtype != dtype:  # autograd then accumulates straight into the views
                for p in params:
                    p.grad_dtype = self.grad_dtype
        else:
            sb.grad_shard = torch.zeros(sb.shard, dtype=self.grad_dtype, device=sb.flat_param.device)
        self._add_shard_params(sb)
        return sb

    def _add_shard_params(self, sb: ShardedBucket) -> None:
        """The optimizer's 1-D params: views of the master shard, one per segment (the optimizer's
        in-place updates write the shard; none with ``offload``, whose optimizer builds its own),
        their ``.grad`` the reduced shard when the gradients are fp32."""
        weights = sb.master_shard()
        for seg in [] if self.offload else sb.segments:
            sb.shard_params.append(nn.Parameter(weights.narrow(0, seg.flat_offset - sb.start, seg.numel)))
        if self.grad_dtype == torch.float32:
            self._bind_opt_grad(sb, sb.reduced_shard)

    def _new_grad_full(self, sb: ShardedBucket) -> None:
        gb = sb.grad_bucket
        sb.grad_full = gb.buffer = torch.zeros(sb.total, dtype=self.grad_dtype, device=sb.flat_param.device)
        gb.views = [sb.grad_full.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(gb.params, gb.offsets)]

    @staticmethod
    def _bind_opt_grad(sb: ShardedBucket, grad: torch.Tensor | None) -> None:
        """Point each shard param's ``.grad`` at its piece of ``grad`` (``[shard]`` fp32), or None."""
        sb.opt_grad = grad
        for seg, sp in zip(sb.segments, sb.shard_params):
            sp.grad = None if grad is None else grad.narrow(0, seg.flat_offset - sb.start, seg.numel)

    def shard_param_of(self) -> dict[nn.Parameter, nn.Parameter]:
        """Original param -> its 1-D shard param on this rank (params with no element here are absent;
        empty with ``offload``: the offloaded optimizer builds its own, see :meth:`segment_of`)."""
        return {sb.grad_bucket.params[seg.index]: sp for sb in self.buckets for seg, sp in zip(sb.segments, sb.shard_params)}

    def segment_of(self) -> dict[nn.Parameter, tuple[ShardedBucket, Segment]]:
        """Original param -> (its bucket, its segment of this rank's shard); absent when no element here."""
        return {sb.grad_bucket.params[seg.index]: (sb, seg) for sb in self.buckets for seg in sb.segments}

    # ---- transient accounting -----------------------------------------------------------------
    def _hold(self, nbytes: int) -> None:
        self._transient += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient)

    def _release(self, nbytes: int) -> None:
        self._transient -= nbytes

    # ---- the reducer's callbacks (post_backward launches, finalize finishes) -----------------
    def launch(self, gb: GradBucket) -> Any:
        """Pack the bucket's grads and start its reduce-scatter (see the module's Note)."""
        sb = self.buckets[gb.index]
        if self.finalized:
            raise RuntimeError(
                "ShardedDataParallel: backward after the optimizer step without zero_grad(); call "
                "opt.zero_grad() after each step (the reduced shard was already averaged and consumed)"
            )
        if self.sync is not None:
            self.sync.check("gradient reduce-scatter", gb.index)
        while self.host is None and len(self._in_flight) >= MAX_IN_FLIGHT:  # bound transient memory; oldest first
            self._complete_oldest()
        for j, p in enumerate(gb.params):  # [Note: params without a gradient are not stepped]
            if p.grad is not None:
                sb.got_grad[j] = True
        if self.stage == 1:
            if sb.reduced:
                raise RuntimeError(
                    "ShardedDataParallel(stage=1) reduces once per optimizer step: run the earlier "
                    "micro-batches under no_sync() (sdp.no_sync() or ParallelModel.no_sync(); stage 1 accumulates "
                    "them locally), or use stage=2"
                )
            full = sb.grad_full
            self._pack(gb, full, into_views=True)
            sb.reduced = True
        else:
            # uninitialized: _pack writes every slot and zeroes the rest (gaps, padding, params
            # without a grad), instead of clearing the whole bucket and then overwriting it
            full = torch.empty(sb.total, dtype=self.grad_dtype, device=sb.flat_param.device)
            self._hold(full.numel() * full.element_size())
            self._pack(gb, full, into_views=False)
        while self.host is not None and self._in_flight:  # offload: start the older buckets' copies now
            self._complete_oldest()  # [Note: gradient copies overlapped with backward] (offload.py)
        if self.stage == 1:  # in place: this rank's chunk of the packed bucket is its shard
            out = full.narrow(0, sb.start, sb.shard)
        else:
            out = sb.grad_shard if sb.fresh else torch.empty_like(full[: sb.shard])
            if out is not sb.grad_shard:
                self._hold(out.numel() * out.element_size())
        # the packed bucket is dead once reduced (stage 2: transient; stage 1: only this rank's
        # shard of it is read again), so gloo may reduce it in place (see comm.reduce_scatter)
        if self.stats is not None:
            self.stats.set_phase(f"backward: reduce-scatter of gradient bucket {gb.index}")
        work = reduce_scatter(out, full, group=self.group, op="sum", async_op=True, stats=self.stats, input_is_scratch=True)
        self._in_flight.append((sb, work, full if self.stage >= 2 else None, out))
        return work

    def _pack(self, gb: GradBucket, full: torch.Tensor, *, into_views: bool) -> None:
        packed, offsets = [], []
        for j, p in enumerate(gb.params):
            g = p.grad
            if g is None:  # unused on this rank: contributes zeros
                if into_views:
                    gb.views[j].zero_()
                    p.grad = gb.views[j]
                continue
            if into_views and g.data_ptr() == gb.views[j].data_ptr():
                continue  # autograd accumulated straight into its slot
            packed.append(g.contiguous())
            offsets.append(gb.offsets[j])
        if packed:
            flatten_into(packed, full, offsets, backend=self.backend)
        if not into_views:  # a fresh uninitialized bucket: zero what no grad wrote
            for start, length in _unwritten(gb, full.numel()):
                full.narrow(0, start, length).zero_()
        for j, p in enumerate(gb.params):
            # stage 1: the grad is its slot from now on; stage 2: autograd's grads are freed now
            p.grad = gb.views[j] if into_views else None

    def _complete_oldest(self) -> None:
        sb, work, full, out = self._in_flight.popleft()
        work.wait()
        if self.host is not None:  # the last micro-batch's copy may still read the shard
            self.host.device_writable(sb.grad_bucket.index)
        if self.stage >= 2 and out is not sb.grad_shard:  # stage 1 reduced in place
            sb.grad_shard.add_(out)
            self._release(out.numel() * out.element_size())
        if full is not None:
            self._release(full.numel() * full.element_size())
        sb.fresh = False
        if self.host is not None:
            self.host.issue(sb.grad_bucket.index, sb.reduced_shard)

    def finish(self, gb: GradBucket, work: Any) -> None:
        """Wait for every bucket launched up to ``gb`` (in launch order) and accumulate its shard."""
        while any(sb.grad_bucket is gb for sb, *_ in self._in_flight):
            self._complete_oldest()

    def abandon(self) -> None:
        """Forget a backward that raised ([Note: a backward that raised]): never wait, and give
        every buffer a collective may still write a fresh replacement."""
        for sb, work, _, out in self._in_flight:
            if work.is_completed():
                continue
            if self.stage == 1:  # its input: the collective may still read it
                self._new_grad_full(sb)
            elif out is sb.grad_shard:
                sb.grad_shard = torch.zeros_like(out)
            if self.grad_dtype == torch.float32 and self.host is None:
                self._bind_opt_grad(sb, sb.reduced_shard)
        self._in_flight.clear()
        self._transient = 0
        self.zero_grad(set_to_none=True)

    # ---- step --------------------------------------------------------------------------------
    def zero_grad(self, *, set_to_none: bool = True) -> None:
        """Forget the gradients of this step (the persistent buffers are kept, zeroed)."""
        # a step skipped after the epilogue (clip_grad_norm_ then zero_grad, no opt.step()) left
        # the transient fp32 copies of bf16/fp16 grads bound: release them through the same path
        # as after a step, so the transient accounting does not drift up by one copy per skip
        self.release_step_buffers()
        for sb in self.buckets:
            if self.host is not None:  # a copy may still read the shard zeroed here
                self.host.device_writable(sb.grad_bucket.index)
            for p in sb.grad_bucket.params:
                p.grad = None
            if sb.grad_full is not None and not set_to_none:  # p.grad stays a zeroed view
                sb.grad_full.zero_()
                for p, v in zip(sb.grad_bucket.params, sb.grad_bucket.views):
                    p.grad = v
            # the reduced shard is not zeroed here: the step's first reduction overwrites it
            # (stage 1 copies into it, stages 2-3 reduce-scatter straight into it while
            # ``fresh``), and the epilogue zeroes a bucket no backward reduced (saves a memset
            # of the shard per step: 10 ms of a 700 ms ZeRO-1 step at 20M params on 2 ranks)
            sb.fresh, sb.reduced = True, False
            sb.got_grad, sb.stepped = [False] * len(sb.grad_bucket.params), None
        if self.host is not None:
            self.host.reset()
        self.finalized = False

    @torch.no_grad()
    def epilogue(
        self, inv_scale: float, *, replicated: set[nn.Parameter] | None = None, replicated_weight: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Average (and unscale) this rank's reduced shards once per step; flag inf/nan, sum g².

        Args:
            inv_scale: the factor applied to every gradient element (1/(N·S)).
            replicated: params whose squares count ``replicated_weight`` times in ``sumsq``
                (with tensor parallelism: the params every tp rank holds whole, counted
                ``1/tp`` on each so that the sum over tp counts them once).
            replicated_weight: their weight.

        Returns:
            ``(found_inf, sumsq)``: fp32 ``[1]`` each, on the params' device, of this rank's
            shards only (the caller agrees them over dp: the global norm is the sum of every
            rank's ``sumsq``). With ``offload`` the pass runs over the host copies and
            ``sb.opt_grad`` is the host fp32 buffer.
        """
        if self.finalized:
            raise RuntimeError("the gradient epilogue already ran for this step (call zero_grad() after step)")
        if self.sync is not None:  # the norm/overflow all-reduce (if any) follows on every rank alike
            self.sync.check("gradient epilogue (norm/overflow)")
        device = self.buckets[0].flat_param.device if self.buckets else torch.device("cpu")
        for sb in self.buckets:  # no backward reduced it since zero_grad: its gradient is zero
            if (not sb.reduced) if self.stage == 1 else sb.fresh:
                sb.reduced_shard.zero_()
        host, backend, where = self.host, self.backend, device
        if host is not None:  # the host copies: [Note: gradient copies overlapped with backward]
            backend, where = host.backend, torch.device("cpu")
            for i, sb in enumerate(self.buckets):
                if not host.valid[i]:  # no backward reduced it since zero_grad: copy it now
                    host.issue(i, sb.reduced_shard)
                host.wait(i)
        found_inf, sumsq = torch.zeros(1, device=where), torch.zeros(1, device=where)
        for i, sb in enumerate(self.buckets):
            g = sb.reduced_shard if host is None else host.raw[i]
            if self.grad_dtype == torch.float32:
                unscale_and_norm_([g], inv_scale=inv_scale, found_inf=found_inf, sumsq=sumsq, backend=backend)
                continue
            if host is None:
                self._bind_opt_grad(sb, torch.empty(sb.shard, dtype=torch.float32, device=device))  # transient fp32
                self._hold(sb.shard * 4)
            unscale_and_norm_([g], inv_scale=inv_scale, out=[sb.opt_grad], found_inf=found_inf, sumsq=sumsq, backend=backend)
        if replicated and replicated_weight != 1.0:
            # re-read the (small: norms, biases) replicated pieces, already unscaled, and take
            # (1 - w) of their squares back out of the bucket sums
            rep = torch.zeros(1, device=where)
            for sb in self.buckets:
                g = sb.opt_grad if sb.opt_grad is not None else sb.reduced_shard
                for seg in sb.segments:
                    if sb.grad_bucket.params[seg.index] in replicated:
                        rep += g.narrow(0, seg.flat_offset - sb.start, seg.numel).float().square().sum()
            sumsq.sub_((1.0 - replicated_weight) * rep)
        self.finalized = True
        return found_inf.to(device), sumsq.to(device)  # the all-reduce's device (NCCL: CUDA)

    def got_grad_flags(self) -> list[bool]:
        """Whether each trainable param (bucket order, then param order) had a gradient on this rank
        since the last zero_grad ([Note: params without a gradient are not stepped])."""
        return [g for sb in self.buckets for g in sb.got_grad]

    def set_stepped(self, agreed: list[bool] | None) -> None:
        """Record which params some rank had a gradient for (``got_grad_flags`` order; None: all)."""
        at = 0
        for sb in self.buckets:
            n = len(sb.got_grad)
            sb.stepped = None if agreed is None or all(agreed[at : at + n]) else list(agreed[at : at + n])
            at += n

    def unstepped(self) -> list[tuple[int, int]]:
        """``(bucket, segment)`` of this rank's shard pieces whose param no rank had a gradient for:
        the optimizer must not step them ([Note: params without a gradient are not stepped])."""
        return [
            (i, k)
            for i, sb in enumerate(self.buckets)
            if sb.stepped is not None
            for k, seg in enumerate(sb.segments)
            if not sb.stepped[seg.index]
        ]

    def clip_targets(self) -> tuple[list[torch.Tensor], str]:
        """The shard gradients a clip scales (with offload the host copies) and the kernel
        backend where they live."""
        grads = [sb.opt_grad for sb in self.buckets if sb.opt_grad is not None and sb.shard]
        return grads, self.backend if self.host is None else self.host.backend

    def release_step_buffers(self) -> None:
        """Drop the transient fp32 gradient copies after the optimizer step (offload: the host
        buffers persist)."""
        if self.grad_dtype == torch.float32 or self.host is not None:
            return
        for sb in self.buckets:
            if sb.opt_grad is not None:
                self._release(sb.shard * 4)
                self._bind_opt_grad(sb, None)

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every rank's updated shard back into every rank's full params (one all-gather per bucket)."""
        works: list[tuple[Any, torch.Tensor]] = []
        for sb in self.buckets:
            if self.size == 1:  # one rank: the shard is the whole bucket, nothing to gather
                dst, src = sb.flat_param.narrow(0, sb.start, sb.shard), sb.master_shard()
                if dst.data_ptr() != src.data_ptr():  # a bf16 param from its fp32 master, or offload
                    dst.copy_(src)
                continue
            while len(works) >= MAX_IN_FLIGHT:  # bound transient memory, as the reduce-scatters; oldest first
                self._finish_gather(*works.pop(0))
            # a separate input: all-gather into the buffer its input lives in is not portable;
            # copy_ also casts the fp32 master and brings it from another device (offload)
            src = torch.empty(sb.shard, dtype=sb.flat_param.dtype, device=sb.flat_param.device)
            src.copy_(sb.master_shard())
            self._hold(src.numel() * src.element_size())
            if self.sync is not None:
                self.sync.check("parameter all-gather", sb.grad_bucket.index)
            works.append((all_gather(sb.flat_param, src, group=self.group, async_op=True, stats=self.stats), src))
        for work, src in works:
            self._finish_gather(work, src)

    def _finish_gather(self, work: Any, src: torch.Tensor) -> None:
        work.wait()
        self._release(src.numel() * src.element_size())

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-read the fp32 master shards from the params (after loading params)."""
        for sb in self.buckets:
            if sb.master is not None:
                sb.master.copy_(sb.flat_param.narrow(0, sb.start, sb.shard))
        self.record_param_versions()

    # [Note: params written between steps]
    # With bf16/fp16 params (stages 1-2, no offload) the optimizer steps an fp32 master shard and
    # the params are its rounded copy, all-gathered after each step. A user who writes the
    # params between steps (``module.load_state_dict``, ``p.copy_`` under no_grad: loading
    # pretrained weights after wrapping, an EMA swap, a re-initialisation) writes only the
    # rounded copy: the next step would update the stale master and all-gather it over the
    # write. Each param's ``_version`` tells: it moves on the user's in-place writes to ``p``,
    # and not on the all-gather's writes into the flat buffer ``p`` is a view of (``p.data`` was
    # set to the view: it keeps its own counter). So each step first re-reads the master pieces
    # of the params written since the last record, exactly (bf16/fp16 widen to fp32 exactly),
    # as the offloaded optimizer does for its host masters (``offload.py``); the unwritten
    # elements keep their extra precision. Stage 3 frees the params between steps (a write
    # raises), and the fp32 case has no master: both are skipped.
    def _param_versions(self) -> list[int]:
        return [p._version for sb in self.buckets for p in sb.grad_bucket.params]

    def record_param_versions(self) -> None:
        """Take the params as they are now as the masters' source (after a step or a load)."""
        self._versions = self._param_versions()

    @torch.no_grad()
    def refresh_written_masters(self) -> None:
        """Re-read the fp32 master pieces of params written since the last record ([Note: params
        written between steps]); a no-op without masters, at stage 3, and when nothing was written.

        Example:
            >>> sdp.module.load_state_dict(sd)        # bf16 params, ZeRO-2
            >>> shards.refresh_written_masters()      # ZeroOptimizer.step does this first
        """
        if self.stage == 3 or all(sb.master is None for sb in self.buckets):
            return
        now = self._param_versions()
        if now == self._versions:
            return
        params = [p for sb in self.buckets for p in sb.grad_bucket.params]
        written = {id(p) for p, a, b in zip(params, now, self._versions, strict=True) if a != b}
        for sb in self.buckets:
            if sb.master is None:
                continue
            local = sb.local_param_shard()
            for seg in sb.segments:
                if id(sb.grad_bucket.params[seg.index]) in written:
                    at = seg.flat_offset - sb.start
                    sb.master.narrow(0, at, seg.numel).copy_(local.narrow(0, at, seg.numel))
        self._versions = now

    # ---- memory ------------------------------------------------------------------------------
    def persistent_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per category (params, grads, master params), padding included."""

        def nb(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "params": sum(nb(sb.flat_param) for sb in self.buckets),
            "grads": sum(nb(sb.grad_full) + nb(sb.grad_shard) for sb in self.buckets),
            "master_params": sum(nb(sb.master) for sb in self.buckets),
        }
