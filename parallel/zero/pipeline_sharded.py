"""ZeRO-1/2 on the dp axis of a pipeline: one pp rank's stages sharded over its dp peers.

[Note: ZeRO under a pipeline]
A pipeline rank holds a few stages (every chunk of the interleaved schedule, and its copies of
parameters tied to other stages); the ranks of its dp group hold the *same* stages and train
other rows of the batch. :class:`PipelineShardedDataParallel` is a
:class:`~shardkit.parallel.ShardedDataParallel` (stage 1 or 2) over those stages and this dp
group, with two differences, both because :class:`~shardkit.parallel.PipelineParallel`
produces the gradients outside autograd's accumulation (``torch.autograd.grad`` per
micro-batch, summed in fp32, written into ``p.grad`` once, in its finalize):

* **who launches the reduction.** Autograd's post-accumulate hooks never fire, so
  :meth:`PipelineShardedDataParallel.reduce_gradients`, called after the pipeline step, runs
  the reducer's ``finalize_backward``: every bucket is packed from ``p.grad`` and
  reduce-scattered into this rank's shard, in bucket order (one collective per bucket; stage 2
  then frees ``p.grad``). The optimizer steps the shard and all-gathers the params, as without
  a pipeline. DeepSpeed's PipelineEngine allows ZeRO-1 only; stage 2 costs nothing more here
  because the pipeline's own fp32 accumulators already hold the step's gradient until then.
  Stage 3 is refused: its per-unit parameter gathers would have to be issued per micro-batch
  inside the schedule.
* **the global norm** spans the pipeline: the epilogue's Σg² of this rank's shards (tp-replicated
  params weighted 1/tp, as without a pipeline) minus the squares of the copies of
  cross-stage-tied parameters that another rank counts (a tie's gradient is the same on every
  copy), then one 8-byte all-reduce each over dp, tp and pp.
* **fp16 loss scaling**: with a ``loss_scaler`` the pipeline seeded its backward with ``S``
  times the loss, so the epilogue multiplies by ``1/(dp·S)`` (the dp average and the unscale in
  one pass) and the inf/nan flag rides in front of Σg² in the same all-reduces over dp, tp
  *and pp*: every rank of every stage reads the same overflow, skips the same step and updates
  the scale alike (:class:`~shardkit.parallel.zero.ZeroOptimizer`); a stage stepping alone
  would leave the model half-updated.

The wrapped :class:`ShardedDataParallel` sees a context with ``pp = 1``: this pp rank's dp × tp
slice of the mesh (:func:`stage_context`), the same dp and tp process groups, plus a size-1 pp
group. The full context stays in :attr:`PipelineShardedDataParallel.pipeline_ctx`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from shardkit.comm import AXES, CommStats, ParallelContext

from ..loss_scaler import DynamicLossScaler
from .sharded import ShardedDataParallel, _validate

__all__ = ["PipelineShardedDataParallel", "stage_context"]


def stage_context(ctx: ParallelContext) -> ParallelContext:
    """This pp rank's dp × tp slice of ``ctx``, as a context whose pp axis has size 1.

    Its dp and tp groups are ``ctx``'s own; the size-1 pp group is new (release it with the
    returned context's ``destroy()``). Collective on the world: every rank creates every rank's
    size-1 group, in the same order (``new_group``'s contract).

    Args:
        ctx: a context spanning the whole default group.

    Returns:
        A :class:`~shardkit.comm.ParallelContext` with ``size("pp") == 1`` and ``ctx``'s
        ``dp``/``tp`` sizes, ranks and groups.

    Raises:
        ValueError: ``ctx`` does not span the world.

    Example:
        >>> sub = stage_context(ctx)                     # ctx: pp=2, dp=2 on 4 ranks
        >>> sub.sizes, sub.group("dp") is ctx.group("dp")
        ({'pp': 1, 'dp': 2, 'cp': 1, 'tp': 1}, True)
    """
    if ctx.world_size != dist.get_world_size():
        raise ValueError(
            f"ctx: ZeRO under a pipeline needs the context to span the world ({dist.get_world_size()} ranks), "
            f"got {ctx.world_size}"
        )
    me = dist.get_rank()
    singletons = [dist.new_group([r], group_desc="shardkit_stage_pp") for r in range(dist.get_world_size())]
    layout = ctx.mesh.mesh[ctx.rank("pp")].unsqueeze(0).to(torch.int)  # [1, dp, cp, tp] global ranks
    groups = [singletons[me], *(ctx.group(a) for a in AXES[1:])]
    mesh = DeviceMesh.from_group(groups, ctx.mesh.device_type, mesh=layout, mesh_dim_names=AXES)
    dp_cp = ctx.group("dp_cp") if ctx.size("cp") > 1 else None
    return ParallelContext(mesh, [singletons[me]], _dp_cp=dp_cp)


class PipelineShardedDataParallel(ShardedDataParallel):
    """ZeRO stage 1 or 2 of one pipeline rank's stages over ``ctx``'s dp axis.

    See [Note: ZeRO under a pipeline]. Used by :func:`~shardkit.parallel.parallelize`
    (``dp="zero1"``/``"zero2"`` with ``pp``); :class:`~shardkit.parallel.zero.ZeroOptimizer`,
    ``memory_report``, ``full_state_dict`` (this rank's stages) work as on the base class.

    Args:
        stages: this pp rank's stages (e.g. an ``nn.ModuleList`` of them), the same module on
            every rank of its dp group.
        ctx: the full context (pp > 1 allowed; it must span the world).
        stage: 1 or 2.
        uncounted: parameters whose squares another rank counts in the global norm (this
            rank's copies of cross-stage-tied parameters, except on the tie's first owner).
        bucket_mb, offload, nvme_dir, grad_dtype, loss_scaler, stats, backend: as
            :class:`~shardkit.parallel.ShardedDataParallel` (the pipeline must scale its loss
            by ``loss_scaler.scale``: :func:`~shardkit.parallel.parallelize` does).

    Raises:
        ValueError: ``stage`` not 1 or 2 (named), before any collective.

    Example:
        >>> sdp = PipelineShardedDataParallel(nn.ModuleList(pipe.stages.values()), ctx, stage=2)
        >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4)
        >>> pipe.step(x, y); sdp.reduce_gradients(); sdp.clip_grad_norm_(1.0)
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        stages: nn.Module,
        ctx: ParallelContext,
        stage: int = 1,
        *,
        uncounted: Iterable[nn.Parameter] = (),
        bucket_mb: float = 25.0,
        offload: str | None = None,
        nvme_dir: str | None = None,
        grad_dtype: torch.dtype | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        stats: CommStats | None = None,
        backend: str = "auto",
    ) -> None:
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 or 2 under a pipeline, got {stage!r} (stage 3's per-unit gathers would have to "
                "be issued per micro-batch inside the schedule)"
            )
        if not isinstance(ctx, ParallelContext):
            raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
        # every argument check first: stage_context creates process groups (a collective)
        _validate(stages, ctx, stage, bucket_mb, None, True, offload, nvme_dir, grad_dtype, loss_scaler, pipeline=True)
        uncounted = list(uncounted)
        sub = stage_context(ctx)
        super().__init__(
            stages,
            sub,
            stage,
            bucket_mb=bucket_mb,
            offload=offload,
            nvme_dir=nvme_dir,
            grad_dtype=grad_dtype,
            loss_scaler=loss_scaler,
            stats=stats,
            backend=backend,
        )
        self.pipeline_ctx = ctx
        self._uncounted = {p for p in uncounted if p.requires_grad}
        # the pipeline's backward may accumulate p.grad through autograd, once per micro-batch
        # ([Note: accumulating in param.grad]): the hooks must not reduce; reduce_gradients()
        # reduces once per step
        self._reducer.enabled = False
        self._accumulating = False  # inside no_sync(): reduce_gradients() waits for the last step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation over several pipeline steps, stages 1 and 2 alike: inside the
        block :meth:`reduce_gradients` does nothing (each pipeline step adds its gradients to
        ``p.grad``), so the first call outside reduces their sum once, with no communication
        before it.

        Example:
            >>> with sdp.no_sync():
            ...     pipe.step(x1, y1); sdp.reduce_gradients()     # no collective
            >>> pipe.step(x2, y2); sdp.reduce_gradients()          # reduces x1's + x2's grads
        """
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def reduce_gradients(self) -> None:
        """Reduce-scatter the full ``p.grad`` of every bucket into this rank's shard, in bucket
        order (after the pipeline step wrote ``p.grad``; stage 2 frees ``p.grad``). Collective
        on dp; call once per optimizer step, outside :meth:`no_sync` (inside it does nothing)."""
        if self._accumulating:
            return
        with record_function("shardkit::reduce_scatter"):
            self._reducer.finalize_backward()

    def _norm_groups(self) -> list[Any]:
        """dp, then tp and pp: every stage takes one overflow decision for the whole model (the
        per-param gradient flags ride the dp all-reduce only: the other axes hold other params)."""
        ctx = self.pipeline_ctx
        return [self._group] + [ctx.group(axis) for axis in ("tp", "pp") if ctx.size(axis) > 1]

    def _counted_sumsq(self, sumsq: torch.Tensor) -> torch.Tensor:
        """Each element counts once in the GLOBAL norm: this rank's copies of cross-stage-tied
        params that another rank counts are taken out."""
        return sumsq - self._uncounted_sumsq(sumsq.device) if self._uncounted else sumsq

    def _uncounted_sumsq(self, device: torch.device) -> torch.Tensor:
        """Σg² (already averaged) of this rank's pieces of :attr:`_uncounted`, with the weight the
        epilogue gave them (1/tp for tp-replicated params)."""
        out = torch.zeros(1, device=device)
        for sb in self._shards.buckets:
            g = sb.opt_grad if sb.opt_grad is not None else sb.reduced_shard
            for seg in sb.segments:
                p = sb.grad_bucket.params[seg.index]
                if p in self._uncounted:
                    w = 1.0 / self._tp if p in self._replicated else 1.0
                    out += w * g.narrow(0, seg.flat_offset - sb.start, seg.numel).float().square().sum()
        return out
