"""Stage-3 storage: only this rank's shard of each parameter bucket persists.

:class:`Stage3Shards` is :class:`~shardkit.parallel.zero.flat_shards.FlatShards` with the
parameters sharded too. Every bucket keeps the stage-1/2 layout (``bucket_layout(...,
pad_to_multiple_of=N * ALIGN_ELEMENTS)``, :func:`shard_segments`) and the stage-2 gradient path
(the reducer's launch packs a bucket and reduce-scatters it into the persistent ``[shard]``
gradient; the step epilogue and clip are unchanged). What differs is the parameter storage:

=====================  ===============================================================
tensor                 stage 3 (Ψ elements per bucket, b param bytes, g grad bytes)
=====================  ===============================================================
``param_shard``        bΨ/N, persistent: ``sb.local_param_shard()`` (in host memory with
                       ``offload_params``: [Note: offloaded parameter shards])
``flat_param``         bΨ only while its unit is gathered (storage resized to 0 otherwise);
                       the module's params are views of it
``grad_shard``         gΨ/N, persistent
master (b < 4)         4Ψ/N, persistent
=====================  ===============================================================

The optimizer updates ``master_shard()`` (``param_shard`` itself for fp32 params), and
:meth:`Stage3Shards.all_gather_params` — called by ``ZeroOptimizer`` after the step — only
writes the updated fp32 master back into ``param_shard``: the next forward gathers it, so no
all-gather is needed after the step. Frozen parameters get buckets of their own
(:attr:`Stage3Shards.frozen`): sharded and gathered with their unit, but no gradient, master or
optimizer view, and absent from :attr:`~FlatShards.buckets` (what the optimizer sees).

[Note: gathering into autograd's saved tensors]
Autograd saves the parameters a unit's forward used (views of ``flat_param``) for its backward.
Freeing the unit resizes the *storage* of ``flat_param`` to 0 bytes and gathering resizes it
back and all-gathers into it, so the saved views — the same storage — read the re-gathered
values in backward (FSDP2's scheme). The all-gather writes a tensor autograd saved; it is
issued under ``torch.autograd._unsafe_preserve_version_counter`` so that writing the same
values back is not mistaken for an in-place modification (the values are the ones forward used:
the optimizer only changes ``param_shard`` between steps).

[Note: offloaded parameter shards]
``ShardedDataParallel(stage=3, offload="cpu"|"nvme", offload_params=True)`` (ZeRO-Infinity's
``offload_param``) keeps ``param_shard`` of every bucket, trainable and frozen, in host memory
(pinned when the params are on CUDA, so that copies from it are asynchronous); the device holds
parameter bytes only for the units gathered at the moment. Copies per step and bucket, the
fewest this layout allows:

* gather (forward, backward, prefetch, ``full_state_dict``): ``param_shard`` → a device staging
  buffer ``[shard]``, then the all-gather reads the staging buffer (NCCL takes device inputs
  only). The host-to-device copy is issued inside :meth:`Stage3Shards.gather`, i.e. together with
  the all-gather it feeds: a prefetch copies and gathers while the current unit computes
  (``non_blocking`` from pinned memory on CUDA, queued before the all-gather on the same stream).
  The staging buffer is transient: released when the gather is waited, not held for the
  unit's lifetime. Only ``bΨ/N`` crosses the bus per gather, not the unit's ``bΨ``.
* after the step: none for fp32 params with ``offload="cpu"``, where the host ``param_shard`` IS
  the CPU master (:class:`~shardkit.parallel.zero.offload.CpuOffload` adopts it as its master,
  so the optimizer's in-place update is the write-back); low-precision params: one cast of the
  CPU master into the host ``param_shard``, on the host (half the bytes of an fp32 copy, no
  device round trip). ``offload="nvme"`` stages the new params in the dead host gradient buffer
  as before and copies them host-to-host into ``param_shard`` at commit.

The alternatives cost more: keeping a device copy of the shard (no saving), or copying the fp32
master to the device and casting there (twice the bus bytes for bf16). On a CPU-only run the
"host" and the "device" are the same memory, yet the staging copy is still made: one code path
for both, tested here, and the memory report and the planner count the same buffers. A write of
the host shards (loading params or a checkpoint) first waits for the staging copies still in
flight (:meth:`Stage3Shards.host_writable`).

[Note: hierarchical gathers]
``ShardedDataParallel(stage=3, reshard_after_forward=B)`` with an int ``B`` (FSDP2's
``reshard_after_forward=int``; DeepSpeed ZeRO++'s hpZ, ``zero_hpz_partition_size``) cuts the
dp_cp group into blocks of ``B`` consecutive ranks (:meth:`ParallelContext.dp_cp_blocks`); with
``B`` = the dp_cp ranks per machine, a block is a machine. The forward gathers a unit from the
primary shards over all N ranks, as always. When the unit is freed after its forward, each rank
keeps its piece of the gathered buffer for its place ``j`` in its block: elements
``[j·total/B, (j+1)·total/B)`` (``secondary_shard``; ``total`` is padded to a multiple of
``N · ALIGN``, so the pieces are equal and aligned). The backward's gather (and a recompute's
under activation checkpointing) then all-gathers those pieces inside the block, and the piece is
dropped. The gradients' reduce-scatter and everything after it (optimizer, checkpoints) still
use the primary shards over all N ranks.

Per step, of the 3Ψ payload ZeRO-3 moves (all-gather forward + backward, reduce-scatter), the
backward's all-gather Ψ no longer leaves the block: 2Ψ cross machines instead of 3Ψ. The cost is
memory: ``bΨ/B`` per rank from a unit's forward to its backward (counted in the transient
bytes), against ``bΨ/N`` for the primary shard. A piece lives only between a forward and the
backward that follows it: the next forward (the root's pre-forward), the end of backward, an
abandoned backward, and every write of the parameter shards (step, loading params, a
``GatheredParameters`` write) drop them all, so a gather never reads values older than the
primary shards. In a forward under ``no_grad`` (evaluation, ``generate``) no backward follows
and nothing is kept. Which group a gather uses is decided by the same hooks on every rank, so
every member of a block issues its gathers in the same order ([Note: stage-3 gather order]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardkit.comm import CommHandle, all_gather

from .flat_shards import FlatShards
from .sharded_bucket import ShardedBucket

__all__ = ["Stage3Shards"]


class Stage3Shards(FlatShards):
    """Stage-3 flat shards: trainable buckets (``buckets``) and frozen ones (``frozen``).

    Args:
        buckets: trainable parameters per bucket, in the reducer's launch order.
        frozen: frozen parameters per bucket (gathered with their unit, never reduced).
        offload_params: keep every ``param_shard`` in host memory and stage it to the device
            before each gather ([Note: offloaded parameter shards]); needs ``offload``.
        secondary: ``(block group, this rank's place in it, block size)`` to keep secondary
            shards after forward ([Note: hierarchical gathers]), or None (free entirely).
        **kwargs: as :class:`FlatShards` (``stage`` is 3).

    Example:
        >>> shards = Stage3Shards([[w, b]], [], group=dp, rank=0, size=2, stage=3,
        ...                       grad_dtype=torch.float32, stats=CommStats())
        >>> work = shards.gather(shards.buckets[0]); work.wait()   # w, b readable
        >>> shards.free(shards.buckets[0])                          # only the shard stays
    """

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        frozen: list[list[nn.Parameter]],
        *,
        offload_params: bool = False,
        secondary: tuple[Any, int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.offload_params = offload_params
        self.secondary = secondary
        self._staged: torch.cuda.Event | None = None  # the last host-to-device staging copy (CUDA)
        super().__init__(buckets, **kwargs)
        self.frozen = [self._build(-1, params, trainable=False) for params in frozen]

    @torch.no_grad()
    def _build(self, index: int, params: list[nn.Parameter], trainable: bool = True) -> ShardedBucket:
        sb = ShardedBucket.from_params(index, params, size=self.size, rank=self.rank, backend=self.backend)
        flat = sb.flat_param
        if self.offload_params:  # [Note: offloaded parameter shards]
            sb.param_shard = torch.empty(sb.shard, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
            sb.param_shard.copy_(flat.narrow(0, sb.start, sb.shard))
        else:
            sb.param_shard = flat.narrow(0, sb.start, sb.shard).clone()
        if trainable and flat.dtype != torch.float32 and not self.offload:
            sb.master = sb.param_shard.float()
        flat.untyped_storage().resize_(0)  # from now on only the shard persists
        _point_at_placeholders(params)
        if not trainable:
            return sb
        sb.grad_shard = torch.zeros(sb.shard, dtype=self.grad_dtype, device=flat.device)
        self._add_shard_params(sb)
        return sb

    # ---- gather / free -----------------------------------------------------------------------
    @staticmethod
    def is_gathered(sb: ShardedBucket) -> bool:
        """Whether the bucket's full buffer is allocated (gathered or being gathered)."""
        return sb.flat_param.untyped_storage().nbytes() > 0

    def gather(self, sb: ShardedBucket) -> CommHandle:
        """Allocate ``sb.flat_param`` and start all-gathering every rank's ``param_shard`` into it,
        or, when the bucket has a secondary shard, the block's secondary shards
        (async; see [Note: gathering into autograd's saved tensors] and [Note: hierarchical gathers])."""
        nbytes = sb.total * sb.flat_param.element_size()
        sb.flat_param.untyped_storage().resize_(nbytes)
        self._hold(nbytes)
        for p, v in zip(sb.grad_bucket.params, sb.param_views):
            p.data = v
        if sb.secondary_shard is not None:
            piece, sb.secondary_shard = sb.secondary_shard, None
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(sb.flat_param):
                work = all_gather(sb.flat_param, piece, group=self.secondary[0], async_op=True, stats=self.stats)
            return _StagedGather(work, piece.numel() * piece.element_size(), self._release)  # the piece goes when waited
        src = sb.param_shard
        if self.offload_params:  # the host shard into a device staging buffer: the all-gather's input
            src = torch.empty(sb.shard, dtype=src.dtype, device=sb.flat_param.device)
            src.copy_(sb.param_shard, non_blocking=src.is_cuda)
            if src.is_cuda:
                self._staged = torch.cuda.Event()
                self._staged.record()
            self._hold(src.numel() * src.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(sb.flat_param):
            work = all_gather(sb.flat_param, src, group=self.group, async_op=True, stats=self.stats)
        if src is sb.param_shard:
            return work
        return _StagedGather(work, src.numel() * src.element_size(), self._release)

    def host_writable(self) -> None:
        """Wait for the staging copies that may still read the host ``param_shard`` (CUDA,
        ``offload_params``): call before writing the host shards outside the step. Drops the
        secondary shards too: they would hold the values before the write."""
        self.drop_secondary()
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def free(self, sb: ShardedBucket, *, keep_secondary: bool = False) -> None:
        """Release the full buffer (its gather must have been waited). With ``keep_secondary``
        (a forward's free, when built with ``secondary``) first keep this rank's piece of it for
        the backward's gather inside the block ([Note: hierarchical gathers])."""
        if self.is_gathered(sb):
            if keep_secondary and self.secondary is not None and sb.secondary_shard is None:
                _, place, block = self.secondary
                piece = sb.total // block
                sb.secondary_shard = sb.flat_param.narrow(0, place * piece, piece).clone()
                self._hold(piece * sb.flat_param.element_size())
            sb.flat_param.untyped_storage().resize_(0)
            _point_at_placeholders(sb.grad_bucket.params)
            self._release(sb.total * sb.flat_param.element_size())

    def drop_secondary(self) -> None:
        """Drop every secondary shard ([Note: hierarchical gathers]): the next gathers read the
        primary shards. Called where a forward starts or a backward ends or is abandoned, and
        before every write of the parameter shards."""
        for sb in self.buckets + self.frozen:
            if sb.secondary_shard is not None:
                self._release(sb.secondary_shard.numel() * sb.secondary_shard.element_size())
                sb.secondary_shard = None

    # ---- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def all_gather_params(self) -> None:
        """After the step: write each updated fp32 master into ``param_shard`` (no communication:
        the next forward gathers the shards). fp32 params are updated in place already; with
        offload the optimizer wrote ``local_param_shard()`` itself."""
        self.drop_secondary()
        for sb in self.buckets:
            if sb.master is not None:
                sb.param_shard.copy_(sb.master)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-read the fp32 master shards from ``param_shard`` (after loading params)."""
        self.drop_secondary()
        for sb in self.buckets:
            if sb.master is not None:
                sb.master.copy_(sb.param_shard)

    def persistent_bytes(self) -> dict[str, int]:
        """Persistent device bytes: parameter shards (trainable and frozen; 0 with
        ``offload_params``: see :meth:`host_param_bytes`), gradient shards, masters."""

        def nb(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "params": 0 if self.offload_params else sum(nb(sb.param_shard) for sb in self.buckets + self.frozen),
            "grads": sum(nb(sb.grad_shard) for sb in self.buckets),
            "master_params": sum(nb(sb.master) for sb in self.buckets),
        }

    def host_param_bytes(self) -> int:
        """Bytes of the parameter shards held in host memory (``offload_params``; else 0)."""
        if not self.offload_params:
            return 0
        return sum(sb.param_shard.numel() * sb.param_shard.element_size() for sb in self.buckets + self.frozen)


class _StagedGather:
    """An all-gather handle that also owns its device staging buffer's accounting: the buffer
    (kept alive by the inner handle) is released from the transient count when it is waited."""

    __slots__ = ("_work", "_nbytes", "_release")

    def __init__(self, work: CommHandle, nbytes: int, release: Any) -> None:
        self._work, self._nbytes, self._release = work, nbytes, release

    @property
    def output(self) -> torch.Tensor:
        return self._work.output

    def wait(self) -> torch.Tensor:
        out = self._work.wait()
        if self._nbytes:
            self._release(self._nbytes)
            self._nbytes = 0
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _point_at_placeholders(params: list[nn.Parameter]) -> None:
    """Point freed params at a one-element placeholder expanded to their shape.

    A view of a storage resized to 0 bytes keeps its shape, so code that reads a parameter
    between steps (``p.sum()``, ``p in params``, ``print(p)``) would read freed memory and crash
    the process. The placeholder keeps ``shape``/``dtype``/``device`` (param groups by ``dim()``
    still work), reads return an arbitrary value instead of crashing, and an in-place write raises
    (one element is shared by all). The gather points the params back at their views of the
    gathered buffer. Autograd saves a leaf parameter as the Parameter itself, so backward reads
    whatever ``p.data`` is when it runs: it is correct because the unit's pre-backward hook
    gathers (and re-points ``p.data``) before any node that saved the unit's params runs.
    Read values through ``ShardedDataParallel.full_state_dict()`` (``module.state_dict()``
    raises between steps: see ``ShardUnits._guard_state_dict``).
    """
    with torch.no_grad():
        for p in params:
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
