"""``parallelize``: data × tensor × pipeline parallelism on one ParallelContext, in one order.

A training loop written against the returned :class:`ParallelModel` reads the same whatever the
parallelism::

    par = parallelize(model, ctx, tp_plan=gpt_plan(), pp={"microbatches": 4}, dp="ddp",
                      blocks=gpt_blocks)
    opt = par.make_optimizer(FusedAdamW, par.parameters(), lr=3e-4)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = par.forward_backward(x, y)   # every micro-batch, every stage, dp reduction
        par.clip(1.0)                       # the GLOBAL norm over tp shards, pp stages (and dp)
        par.step(opt)

[Note: the order of parallelize]
As torchtitan's ``parallelize_llama``, the strategies are applied in one fixed order, each on
what the previous one produced:

1. **Tensor parallel** (``tp_plan`` over ctx's tp axis) converts modules in place. It comes
   first because the plan's patterns name modules of the user's (unsplit) model, and because
   the pipeline and data-parallel steps must see the final, TP-sharded parameters.
1a. **Context parallel** (``cp`` over ctx's cp axis): the plan's attention modules attend over
   the sequence shards and its position modules number this rank's tokens by their place in
   the full sequence (:func:`~shardkit.parallel.context.context_parallelize`); parameters are
   untouched, so the dp step below simply reduces over dp × cp (``ctx.group("dp_cp")``).
2. **Pipeline split** (``pp`` over ctx's pp axis): ``blocks(model)`` cuts the model into a
   sequence of blocks (embedding first, head last) and each pp rank keeps its stages.
3. **Activation checkpointing** per block: inside the stages (PipelineParallel's
   ``checkpointing=``) or, without a pipeline, on the blocks ``blocks(model)`` names.
4. **Data parallel** on the dp axis, last: it buckets exactly the parameters this rank ends up
   holding (TP shards of its stages). Without a pipeline the gradients are reduced by autograd
   hooks during backward (DataParallel / ZeRO, via :mod:`~shardkit.parallel.strategy`). With a
   pipeline, gradients reach ``p.grad`` in the pipeline's finalize rather than through autograd
   hooks, so the dp reduction runs after the pipeline step: ``"ddp"`` one coalesced all-reduce
   per dtype; ``"zero1"``/``"zero2"`` shard this rank's stages (every chunk, tied copies
   included) over dp and reduce-scatter each bucket's ``p.grad`` into this rank's shard, the
   optimizer then steps the shard and all-gathers the params (see [Note: ZeRO under a
   pipeline] in :mod:`~shardkit.parallel.zero.pipeline_sharded`). ``"zero3"`` is refused with
   pp: its per-unit gathers would have to run per micro-batch inside the schedule.

[Note: the global gradient norm]
Every element of the model's gradient must be counted exactly once: a tp-sharded parameter's
squares add over tp, a tp-replicated one is identical on every tp rank (counted ``1/tp`` per
rank, as :func:`~shardkit.parallel.tensor.clip_grad_norm_tp_`), stages add over pp (a parameter tied across stages counted on one of its copies only), and after
the dp reduction the replicas are equal (no dp sum). One fp32 all-reduce over tp and one over pp.
With ZeRO the gradients are sharded over dp, so the sum also runs over dp (ZeRO's finalize).

[Note: fp16 loss scaling through the pipeline]
With a ``loss_scaler`` and a pipeline, each step's backward is seeded with ``S`` times the loss
(:meth:`PipelineParallel.step`'s ``loss_scale``, with DeepSpeed's per-micro-batch magnitudes: see
[Note: fp16 loss scaling in the pipeline] in :mod:`~shardkit.parallel.pipeline.executor`), so
``p.grad`` holds ``S`` times the gradient on every stage. The overflow decision must be one decision: a stage that skipped alone would
leave the model half-updated. ``dp="ddp"``/``"none"``: :meth:`ParallelModel.clip` unscales
``p.grad`` by ``1/S`` (after the dp all-reduce, so the dp replicas already agree), flags
inf/nan in the same pass, and adds the flag to the norm's all-reduces over tp and pp (an
8-byte ``[found_inf, Σg²]`` instead of 4 bytes); :meth:`ParallelModel.step` skips the
optimizer on an overflow and updates the scaler (DeepSpeed's rule, on every rank alike).
``dp="zero1"``/``"zero2"``: the ZeRO epilogue unscales by ``1/(dp·S)`` and sums the flag over
dp, tp and pp (:meth:`~shardkit.parallel.zero.PipelineShardedDataParallel.finalize_gradients`);
:class:`~shardkit.parallel.zero.ZeroOptimizer` skips and updates the scaler. The
parameters may be fp32 or fp16 (DeepSpeed's ``model.half()``, with fp32 masters in the
optimizer); autocast inside the stages is not applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.profiler import record_function

from shardkit.comm import CommStats, ParallelContext, all_reduce

from .loss_scaler import DynamicLossScaler, step_unless_overflow
from .memory_report import replicated_memory_report
from .pipeline import PipelineParallel
from .strategy import Strategy, StrategyReport, make_strategy, report_memory
from .strategy_names import DP_STRATEGIES
from .tensor import (
    share_sequence_parallel_grads,
    tensor_parallelize,
    unscale_and_clip_model_parallel_,
    vocab_parallel_cross_entropy,
)
from .tensor.fused_head import FusedCrossEntropyHead, deferred_heads, fuse_lm_head_loss, heads_compute_loss
from .context.attention import check_ulysses_size
from .context.plan import ContextParallelOptions, context_parallelize, plan_modules
from .context.sequence_loss import SequenceShardedLoss
from .tensor.plan import VocabParallelLMHead
from .zero.units import select_units

__all__ = ["ParallelModel", "PipelineOptions", "axis_size", "parallelize"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_IGNORE_INDEX = -100  # the default of F.cross_entropy and vocab_parallel_cross_entropy
BlocksFn = Callable[[nn.Module], Sequence[nn.Module]]


@dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline (the arguments of :class:`~shardkit.parallel.PipelineParallel`).

    Attributes:
        microbatches: micro-batches per step (any value >= 1).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        virtual_stages: stages per rank (interleaved only).
        split: ``"layers"``, ``"params"``, ``"time"`` or explicit stage sizes.
        split_example: the first block's input for one micro-batch (required with
            ``split="time"``, which times the blocks on it), or ``(input, target)`` to time the
            loss with the last block.

    Example:
        >>> PipelineOptions(microbatches=8, schedule="interleaved", virtual_stages=2)
    """

    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: Any = "layers"
    split_example: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None


def _check_arguments(
    model: nn.Module,
    ctx: ParallelContext | None,
    loss_fn: LossFn | None,
    tp_plan: Mapping[str, Any] | None,
    pp: PipelineOptions | Mapping[str, Any] | None,
    dp: str,
    blocks: BlocksFn | None,
    checkpointing: bool | str,
    loss_scaler: DynamicLossScaler | None,
    autocast: Callable[[], Any] | None,
) -> PipelineOptions:
    """:func:`parallelize`'s every check, before any collective (ValueError/TypeError naming the
    argument; the annotations say what is expected, the checks hold callers to it). Returns the
    pipeline options (defaults without ``pp``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if ctx is None and dp != "none":
        raise ValueError(f"dp={dp!r} needs a ParallelContext (ctx=None is one process: dp='none')")
    if ctx is not None and not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext or None, got {type(ctx).__name__}")
    if dp == "none" and axis_size(ctx, "dp") > 1:
        raise ValueError(f"dp='none' but ctx has a dp axis of size {axis_size(ctx, 'dp')}: pick 'ddp' or a ZeRO stage")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if dp not in DP_STRATEGIES:
        raise ValueError(f"dp must be one of {list(DP_STRATEGIES)}, got {dp!r}")
    if checkpointing not in (False, True, "cpu"):
        raise ValueError(f"checkpointing must be False, True or 'cpu', got {checkpointing!r}")
    if blocks is not None and not callable(blocks):
        raise TypeError(f"blocks must be callable (model -> sequence of blocks) or None, got {type(blocks).__name__}")
    tp, pp_size = axis_size(ctx, "tp"), axis_size(ctx, "pp")
    if tp > 1 and tp_plan is None:
        raise ValueError(f"tp_plan is required: ctx has a tp axis of size {tp}")
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        raise TypeError(f"tp_plan must be a mapping of module patterns to styles, got {type(tp_plan).__name__}")
    if pp_size > 1 and pp is None:
        raise ValueError(f"pp is required (PipelineOptions or a dict): ctx has a pp axis of size {pp_size}")
    if pp is not None and pp_size == 1:
        raise ValueError("pp: the context's pp axis has size 1; build it with pp > 1 to pipeline")
    opts = PipelineOptions()
    if pp is not None:
        if isinstance(pp, Mapping):
            unknown = set(pp) - set(PipelineOptions.__dataclass_fields__)
            if unknown:
                raise ValueError(f"pp: unknown option(s) {sorted(unknown)}; known: {list(PipelineOptions.__dataclass_fields__)}")
            opts = PipelineOptions(**pp)
        elif isinstance(pp, PipelineOptions):
            opts = pp
        else:
            raise TypeError(f"pp must be PipelineOptions, a dict or None, got {type(pp).__name__}")
        if blocks is None and not isinstance(model, (nn.Sequential, nn.ModuleList)):
            raise ValueError(f"blocks is required to pipeline a {type(model).__name__} (model -> [embedding, *blocks, head])")
    if checkpointing and pp_size == 1 and blocks is None:
        raise ValueError("checkpointing without a pipeline needs blocks= (which modules to recompute)")
    if pp_size > 1 and dp == "zero3":
        raise ValueError(
            f"dp='zero3' with pp={pp_size}: ZeRO-3's per-unit parameter gathers would have to be issued per "
            "micro-batch inside the pipeline schedule; use dp='zero1' or 'zero2' (or 'ddp') with pipeline parallelism"
        )
    if pp_size > 1 and dp.startswith("zero") and ctx.world_size != dist.get_world_size():
        raise ValueError(f"ctx: dp={dp!r} with pp needs the context to span the world, got {ctx.world_size} ranks")
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}")
    if tp > 1 and loss_scaler is not None and not dp.startswith("zero"):
        raise ValueError(
            "loss_scaler (fp16) with tp needs a ZeRO dp strategy (its finalize agrees the overflow over "
            "dp and tp); use bf16 or fp32, or dp='zero1'/'zero2'/'zero3' with tp"
        )
    if pp_size > 1 and autocast is not None:
        raise ValueError(
            "autocast is not applied inside pipeline stages yet; pipeline in fp32, bf16 params, or fp16 params "
            "(model.half()) with loss_scaler= (fp32 masters in the optimizer)"
        )
    return opts


def axis_size(ctx: ParallelContext | None, axis: str) -> int:
    """The size of ``axis`` (1 without a context: one process).

    Example:
        >>> axis_size(None, "tp")
        1
    """
    return 1 if ctx is None else ctx.size(axis)


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default loss under a pipeline: ``(sum, count)`` over the non-ignored targets, so the
    micro-batches are weighted by their valid tokens ([Note: pipeline loss normalization])."""
    t = targets.flatten()
    return F.cross_entropy(logits.flatten(0, -2).float(), t, reduction="sum"), (t != _IGNORE_INDEX).sum()


class ParallelModel:
    """What :func:`parallelize` returns: this rank's part of the model and one training step.

    Attributes:
        module: the module this rank trains (the DataParallel/ZeRO wrapper, or without dp the
            TP-converted model; with a pipeline the :class:`PipelineParallel`'s stages, or with
            ``dp="zero1"``/``"zero2"`` their blocks keyed by block index, as the unsplit
            ``nn.Sequential(*blocks)``, in a ZeRO wrapper).
        pipeline: the :class:`PipelineParallel`, or None.
        strategy: the dp :class:`~shardkit.parallel.strategy.Strategy` (no pipeline, or ZeRO
            under a pipeline), or None.
        loss_fn: the loss of logits and targets (vocab-parallel when the head is).
        stats: CommStats of the dp reduction and the norm all-reduces (pipeline and TP layers
            record into their own).
    """

    def __init__(
        self,
        ctx: ParallelContext | None,
        *,
        module: nn.Module,
        loss_fn: LossFn,
        strategy: Strategy | None,
        pipeline: PipelineParallel | None,
        dp: str,
        autocast: Callable[[], Any] | None,
        loss_scaler: DynamicLossScaler | None = None,
    ) -> None:
        self.ctx, self.module, self.loss_fn = ctx, module, loss_fn
        self.strategy, self.pipeline, self.dp = strategy, pipeline, dp
        self.stats = CommStats()
        self._autocast = autocast
        #: the fp16 loss scaler of every layout (the dp strategy's, or the one a pipeline scales its
        #: loss with: [Note: fp16 loss scaling through the pipeline]), or None. Save it with the
        #: checkpoint: ``save_checkpoint(dir, par, opt, scaler=par.loss_scaler)``.
        self.loss_scaler = loss_scaler
        self.skipped_steps = 0
        # pipeline + ddp + scaler: (overflow, norm) of this step once clip/step computed it
        self._pp_state: tuple[bool, torch.Tensor | None] | None = None
        # tp/pp: the norm spans shards and stages, which the dp strategies' clip does not know
        self._composite = axis_size(ctx, "tp") > 1 or axis_size(ctx, "pp") > 1
        self._accumulating = False  # inside no_sync() with a pipeline and dp="ddp"
        #: the LM heads whose loss is fused (``parallelize(fused_cross_entropy=True)``): deferred
        #: around forward, loss and backward (:meth:`loss_path`)
        self.fused_heads: list[FusedCrossEntropyHead] = []
        #: with cp > 1, shards each batch's sequences and forms their loss ([Note: the loss over
        #: cp shards]); None otherwise
        self.sequence: SequenceShardedLoss | None = None

    def loss_path(self, targets: torch.Tensor | None, *, reduction: str = "mean") -> contextlib.AbstractContextManager:
        """The context a forward + :attr:`loss_fn` (+ backward) runs in. With a fused head loss
        (``parallelize(fused_cross_entropy=...)``) the head forms the loss: from ``targets``
        inside its forward without a pipeline (the model then returns the loss, which
        :attr:`loss_fn` passes on), or, with a pipeline, from the hidden states it hands to the
        last stage's loss function (see :mod:`shardkit.parallel.tensor.fused_head`). Otherwise
        nothing. ``reduction``: the head's (``"mean"``, or ``"sum"`` for a loss that normalizes
        itself, as the cp loss does).

        Example:
            >>> with par.loss_path(y):
            ...     loss = par.loss_fn(par.module(x), y)
            ...     par.backward(loss)
        """
        if not self.fused_heads:
            return contextlib.nullcontext()
        if self.pipeline is not None:
            return deferred_heads(self.fused_heads)
        return heads_compute_loss(self.fused_heads, targets, reduction=reduction)

    def _cp_loss_path(self, targets: torch.Tensor) -> contextlib.AbstractContextManager:
        """:meth:`loss_path` under cp without a pipeline: a fused head forms the *sum* of this
        rank's token losses, which the cp loss divides by the replica's count ([Note: the loss
        over cp shards])."""
        return self.loss_path(targets, reduction="sum")

    def comm_stats(self) -> list[CommStats]:
        """Every :class:`~shardkit.comm.CommStats` this model's collectives record into: the dp
        wrapper's, then the one of the TP layers, the pipeline and the norm (:attr:`stats`). The
        order is the same on every rank (for :class:`~shardkit.comm.Heartbeat`'s progress).

        Example:
            >>> hb.track(*par.comm_stats())
        """
        inner = getattr(self.module, "comm_stats", None)
        out = [inner] if isinstance(inner, CommStats) else []
        return out + ([self.stats] if self.stats is not inner else [])

    def set_phase(self, label: str) -> None:
        """Label what this rank does now on every stats object of :meth:`comm_stats` (the
        :class:`~shardkit.comm.Heartbeat` shows the newest label in its verdicts); the layouts
        set finer labels themselves (a ZeRO-3 unit's all-gather, a gradient bucket's
        reduce-scatter, a pipeline receive).

        Example:
            >>> par.set_phase("forward"); out = par.module(x)
        """
        for stats in self.comm_stats():
            stats.set_phase(label)

    # ---- the step ------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (TP shards of its stages), for the optimizer."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> Any:
        """The optimizer over ``params`` (from :meth:`parameters`; ZeRO: a sharded ZeroOptimizer).

        Example:
            >>> opt = par.make_optimizer(FusedAdamW, par.parameters(), lr=3e-4)
        """
        if self.strategy is not None:
            return self.strategy.make_optimizer(optimizer_class, params, **kwargs)
        return optimizer_class(params, **kwargs)

    def forward_backward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """Forward, loss and backward of this dp rank's batch; gradients reduced over dp.

        Args:
            inputs: ``(B, ...)`` model inputs (read on the first pipeline stage only); with cp > 1
                the full ``(B, S)`` sequences, the same on every cp rank of the replica (each
                keeps its tokens: [Note: the loss over cp shards]).
            targets: ``(B, ...)`` targets (read on the last pipeline stage only); with cp, the
                full ``(B, S)`` next-token targets.

        Returns:
            The batch's mean loss, 0-d fp32 (detached; with a pipeline, the same on every pp rank;
            with cp, on every cp rank).
        """
        if self.pipeline is not None:
            self.set_phase("pipeline step")
            scale = self.loss_scaler.scale if self.loss_scaler is not None else None
            self._pp_state = None
            if self.sequence is not None:  # this cp rank's tokens (the first and last stages read them)
                inputs, targets = self.sequence.shard_if_held(inputs, targets)
            with record_function("shardkit::pipeline_step"), self.loss_path(targets):
                loss = torch.tensor(self.pipeline.step(inputs, targets, loss_scale=scale))
            if self.sequence is not None:  # the replica's loss, from every cp rank's sum and count
                loss = self.sequence.replica_loss(*self.pipeline.last_loss_sum_count, device=self.ctx.device).cpu()
            if self.strategy is not None:  # ZeRO: reduce-scatter each bucket into this rank's shard
                self.module.reduce_gradients()  # (nothing inside no_sync: see there)
            elif axis_size(self.ctx, "dp_cp") > 1 and not self._accumulating:
                self._reduce_over_dp()
            return loss
        self.set_phase("forward")
        if self.sequence is not None:  # this cp rank's tokens; the loss over the whole replica
            inputs, targets = self.sequence.shard(inputs, targets)
            with self._autocast() if self._autocast is not None else contextlib.nullcontext(), self._cp_loss_path(targets):
                for_backward, loss = self.sequence(self.module(inputs), targets)
            self.backward(for_backward)
            return loss
        with self.loss_path(targets):
            with self._autocast() if self._autocast is not None else contextlib.nullcontext():
                loss = self.loss_fn(self.module(inputs), targets)
            self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Backward of a loss the caller computed from :attr:`module`'s output (a loop that runs
        the forward itself, as DeepSpeed's ``engine(batch)`` then ``engine.backward(loss)``):
        scaled by the loss scaler when there is one; the dp reduction runs as in
        :meth:`forward_backward`. Not with a pipeline, whose schedule runs the backward.

        Args:
            loss: 0-d loss of this rank's micro-batch.
            retain_graph: keep the graph for another backward.

        Example:
            >>> loss = F.cross_entropy(par.module(x).flatten(0, 1), y.flatten())
            >>> par.backward(loss); par.clip(1.0); par.step(opt)
        """
        if self.pipeline is not None:
            raise RuntimeError("with a pipeline the schedule runs forward and backward: call forward_backward(inputs, targets)")
        self.set_phase("backward")
        if self.strategy is not None:
            self.strategy.backward(loss, retain_graph=retain_graph)
            return
        with record_function("shardkit::backward"):
            (self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss).backward(retain_graph=retain_graph)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: ``forward_backward`` calls inside the block add to the gradients
        without the dp reduction where the layout allows it, and the first call outside reduces
        their sum — as torch DDP's ``no_sync``, for every layout.

        * no pipeline: the dp wrapper's own ``no_sync`` (DataParallel and ZeRO-1 skip the
          communication; ZeRO-2/3, which never hold a full gradient, still reduce-scatter each
          backward into the shard); nothing to skip with ``dp="none"``.
        * with a pipeline: the dp reduction after each pipeline step is skipped (each step adds
          its gradients to ``p.grad``), for ``"ddp"``, ``"zero1"`` and ``"zero2"`` alike.

        Example:
            >>> opt.zero_grad()
            >>> with par.no_sync():
            ...     par.forward_backward(x1, y1)        # no dp collective
            >>> par.forward_backward(x2, y2)            # reduces the sum of both
            >>> par.clip(1.0); par.step(opt)
        """
        if self.pipeline is not None and self.strategy is None:
            previous, self._accumulating = self._accumulating, True
            try:
                yield
            finally:
                self._accumulating = previous
            return
        with self.module.no_sync() if hasattr(self.module, "no_sync") else contextlib.nullcontext():
            yield

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss of a batch without gradients (eval mode), the same on every rank of a replica.

        With a pipeline, one forward runs stage by stage (:meth:`PipelineParallel.evaluate`).
        """
        if self.pipeline is not None:
            if self.sequence is not None:
                inputs, targets = self.sequence.shard_if_held(inputs, targets)
            with self.loss_path(targets):
                value = self.pipeline.evaluate(inputs, targets)
            if self.sequence is not None:
                return float(self.sequence.replica_loss(*self.pipeline.last_loss_sum_count, device=self.ctx.device))
            return value
        was = self.module.training
        self.module.eval()
        try:
            if self.sequence is not None:
                inputs, targets = self.sequence.shard(inputs, targets)
                with self._autocast() if self._autocast is not None else contextlib.nullcontext(), self._cp_loss_path(targets):
                    return float(self.sequence(self.module(inputs), targets)[1])
            with self._autocast() if self._autocast is not None else contextlib.nullcontext(), self.loss_path(targets):
                return float(self.loss_fn(self.module(inputs), targets))
        finally:
            self.module.train(was)

    def clip(self, max_norm: float | None) -> torch.Tensor | None:
        """Clip to the GLOBAL gradient norm (see [Note: the global gradient norm]).

        With a pipeline and a loss scaler (``dp="ddp"``/``"none"``) this also unscales the
        gradients and agrees the overflow over tp and pp (see [Note: fp16 loss scaling through
        the pipeline]); on an overflow nothing is clipped and the norm is ``inf``.

        Returns:
            The pre-clip norm (0-d fp32), or None when nothing was computed.
        """
        self.set_phase("gradient clip")
        if self.strategy is not None and (not self._composite or self.dp.startswith("zero")):
            # ZeRO's finalize agrees the norm over dp and tp itself (its gradients are sharded)
            return self.strategy.clip(max_norm)
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        if self.pipeline is not None and self.loss_scaler is not None:
            if self._pp_state is None:
                self._pp_state = self._unscale_and_clip(max_norm)
            return self._pp_state[1]
        if max_norm is None:
            return None
        return self._unscale_and_clip(max_norm)[1]

    def _unscale_and_clip(self, max_norm: float | None) -> tuple[bool, torch.Tensor | None]:
        """``(overflow, norm)``: unscale ``p.grad`` by ``1/S`` (with a pipeline's loss scaler),
        then the global norm over tp and pp, each element counted once, and the clip unless an
        overflow (:func:`~shardkit.parallel.tensor.unscale_and_clip_model_parallel_`)."""
        scaler = self.loss_scaler if self.pipeline is not None else None
        uncounted = [] if self.pipeline is None else _uncounted_tie_copies(self.pipeline, self.ctx)
        return unscale_and_clip_model_parallel_(
            self.parameters(),
            max_norm,
            ctx=self.ctx,
            axes=("tp", "pp"),
            inv_scale=None if scaler is None else 1.0 / scaler.scale,
            uncounted=uncounted,
            stats=self.stats,
        )

    def step(self, optimizer: Any) -> bool:
        """Step the optimizer (skipped on an fp16 overflow agreed over dp, and with a pipeline
        over pp and tp too; the loss scaler then updated). Returns whether it stepped."""
        self.set_phase("optimizer step")
        if self.strategy is not None:
            stepped = self.strategy.step(optimizer)
        elif self.pipeline is not None and self.loss_scaler is not None:
            # [Note: fp16 loss scaling through the pipeline]: unscaled and agreed once per step
            overflow, _ = self._pp_state if self._pp_state is not None else self._unscale_and_clip(None)
            self._pp_state = None
            stepped = step_unless_overflow(optimizer.step, overflow, self.loss_scaler)
        else:
            stepped = step_unless_overflow(optimizer.step, False, None)
        self.skipped_steps += int(not stepped)  # every layout's count (the report's, too)
        return stepped

    def report(self, optimizer: Any = None) -> StrategyReport:
        """This rank's memory by category and communication so far."""
        if self.strategy is not None:
            report = self.strategy.report(optimizer)
            if self._composite or self.sequence is not None:  # plus the TP layers', the cp attention's and the norm's
                report.comm = _merge(report.comm or {}, self.stats.summary())
            return report
        memory = report_memory(replicated_memory_report(self.parameters(), optimizer))
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        return StrategyReport(memory=memory, comm=self.stats.summary(), loss_scale=scale, skipped_steps=self.skipped_steps)

    def close(self) -> None:
        """Release the process groups made for this model (the pipeline's tie groups, ZeRO's
        stage context under a pipeline); it must not train afterwards. Idempotent; local."""
        if self.pipeline is not None:
            self.pipeline.close()
            if self.strategy is not None:  # ZeRO's stage context: its size-1 pp groups
                self.module.ctx.destroy()

    @torch.no_grad()
    def _reduce_over_dp(self) -> None:
        """Average the stage gradients over dp (and cp: [Note: the dp_cp group]): one all-reduce
        of a flat buffer per grad dtype.

        Every trainable parameter has its place in the buffer (zeros where this rank has no
        grad), so the buffers agree in size on every dp rank, and one used flag per parameter
        follows the grads: a parameter no dp rank got a grad for (an MoE expert no token
        reached) keeps ``grad=None``, as in single-process training; one used on some ranks
        gets the sum over those ranks divided by the dp size.
        """
        dp = self.ctx.size("dp_cp")
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.parameters():
            by_dtype.setdefault(getattr(p, "grad_dtype", None) or p.dtype, []).append(p)
        with record_function("shardkit::all_reduce"):
            for dtype, params in by_dtype.items():
                has = [p.grad is not None for p in params]
                parts = [
                    p.grad.reshape(-1).to(dtype) if p.grad is not None else p.new_zeros(p.numel(), dtype=dtype) for p in params
                ]
                parts.append(torch.tensor(has, dtype=dtype, device=params[0].device))
                flat = torch.cat(parts)
                all_reduce(flat, group=self.ctx.group("dp_cp"), stats=self.stats)
                total = flat.numel() - len(params)
                used = flat[total:].tolist() if not all(has) else [1.0] * len(params)
                flat[:total].div_(dp)
                offset = 0
                for p, u in zip(params, used):
                    if u > 0:
                        src = flat[offset : offset + p.numel()].view_as(p)
                        if p.grad is None:
                            p.grad = src.clone()
                        else:
                            p.grad.copy_(src)
                    offset += p.numel()


def parallelize(
    model: nn.Module,
    ctx: ParallelContext | None,
    *,
    loss_fn: LossFn | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    pp: PipelineOptions | Mapping[str, Any] | None = None,
    dp: str = "ddp",
    blocks: BlocksFn | None = None,
    checkpointing: bool | str = False,
    loss_scaler: DynamicLossScaler | None = None,
    autocast: Callable[[], Any] | None = None,
    dp_options: Mapping[str, Any] | None = None,
    fused_cross_entropy: bool | str = False,
    cp: ContextParallelOptions | Mapping[str, Any] | None = None,
) -> ParallelModel:
    """Apply TP → CP → pipeline split → activation checkpointing → DP (see [Note: the order of parallelize]).

    Args:
        model: the full model, built identically (same seed) on every rank, on ``ctx.device``.
        ctx: the context whose ``dp``/``tp``/``pp`` axes to use (None: one process, ``dp="none"``).
        loss_fn: ``loss_fn(logits, targets) -> 0-d mean loss``; default token cross-entropy
            (logits ``(..., V)``, integer targets ``(...)``), vocab-parallel when the plan turns
            the head into a :class:`~shardkit.parallel.tensor.plan.VocabParallelLMHead`.
        tp_plan: a TP plan (:func:`~shardkit.parallel.tensor_parallelize`); required when tp > 1.
        pp: :class:`PipelineOptions` or a dict of its fields; required when pp > 1.
        dp: ``"none"``, ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` (ZeRO composes with tp;
            with pp, stages 1 and 2).
        blocks: ``blocks(model) -> [embedding, *blocks, head]`` (a sequence whose composition is
            the model); needed for pp > 1 unless ``model`` is an ``nn.Sequential``, and used by
            ``checkpointing`` without a pipeline.
        checkpointing: False, True (recompute each block in backward) or ``"cpu"`` (also keep
            the saved block inputs on the CPU).
        loss_scaler: fp16 loss scaler (with tp, a ZeRO dp strategy; with pp, any dp but
            ``"zero3"``: see [Note: fp16 loss scaling through the pipeline]).
        autocast: a context-manager factory for forward + loss (e.g. bf16 autocast); dp-only.
        dp_options: the dp strategy's options (``bucket_mb``, ``grad_buckets``...).
        fused_cross_entropy: compute the token cross-entropy from the LM head's input, chunk by
            chunk, without the logits of the whole batch
            (:func:`~shardkit.parallel.tensor.fused_linear_cross_entropy`): True finds the head
            (the plan's vocab-parallel head, else an ``nn.Linear`` named ``lm_head``/``head``),
            a string names it. The loss is then the head's (``loss_fn`` must be None); calling
            the model directly still returns logits.
        cp: how sequences split over ctx's cp axis:
            :class:`~shardkit.parallel.context.ContextParallelOptions` or a dict of its fields
            (``{"plan": gpt_cp_plan(), "mode": "ring"}``); checked and ignored when cp = 1; None
            with cp > 1 runs the whole batch on every cp rank (e.g. a second model without
            attention). :meth:`ParallelModel.forward_backward`
            then takes full sequences and runs this rank's tokens ([Note: the loss over cp
            shards]); the gradients are reduced over dp × cp. With pp, each stage runs this
            rank's tokens. Not with a user ``loss_fn``; with ``fused_cross_entropy`` the head forms
            the sum of this rank's token losses.

    Returns:
        A :class:`ParallelModel`.

    Raises:
        ValueError / TypeError: a bad or unsupported combination, named, before any collective.

    Example:
        >>> ctx = ParallelContext.from_env(tp=2, pp=2)                     # world 8: dp = 2
        >>> par = parallelize(TinyGPT(59), ctx, tp_plan=gpt_plan(), pp={"microbatches": 4},
        ...                   blocks=gpt_blocks)
    """
    opts = _check_arguments(model, ctx, loss_fn, tp_plan, pp, dp, blocks, checkpointing, loss_scaler, autocast)
    cp_opts = _check_context_parallel(model, ctx, cp, dp, loss_fn)
    if not isinstance(fused_cross_entropy, (bool, str)):
        raise TypeError(f"fused_cross_entropy must be a bool or the head's module name, got {type(fused_cross_entropy).__name__}")
    if fused_cross_entropy and loss_fn is not None:
        raise ValueError("fused_cross_entropy=True computes the loss from the LM head's input: leave loss_fn=None")
    tp, pp_size = axis_size(ctx, "tp"), axis_size(ctx, "pp")
    stats = CommStats()  # the TP layers', the pipeline's and the norm's collectives (ParallelModel.stats)
    # 1. tensor parallel (the plan names modules of the unsplit model)
    if tp_plan is not None and tp > 1:
        tensor_parallelize(model, ctx, dict(tp_plan), stats=stats)
    # 1a. context parallel: attention over the sequence shards, positions of this rank's tokens
    # (parameters untouched, so it may come before or after TP; after, its patterns name the TP modules)
    if cp_opts is not None:
        context_parallelize(
            model,
            ctx,
            cp_opts.plan,
            mode=cp_opts.mode,
            layout=cp_opts.layout,
            backend=cp_opts.backend,
            stats=stats,
            ulysses_size=cp_opts.ulysses_size,
        )
    # 1b. the fused head loss: the head hands its input to the loss ([Note: the deferred head
    # inside the head's forward] in parallel/tensor/fused_head.py)
    fused: list[FusedCrossEntropyHead] = []
    if fused_cross_entropy and pp_size > 1 and opts.schedule == "zb-h1":
        raise ValueError(
            "fused_cross_entropy with the 'zb-h1' schedule: its split backward (input gradients, then weight "
            "gradients) runs the loss's backward twice, and the fused loss forms its gradients once, in the "
            "forward pass; use another schedule"
        )
    if fused_cross_entropy:
        head_name = None if fused_cross_entropy is True else fused_cross_entropy
        fused = [fuse_lm_head_loss(model, head_name)]
    pipe_loss = loss_fn
    if fused:
        loss_fn, pipe_loss = _loss_from_the_head(fused[0]), _fused_head_loss(fused[0])
    elif loss_fn is None:
        heads = [m for m in model.modules() if isinstance(m, VocabParallelLMHead)]
        loss_fn = _vocab_parallel_loss(ctx, heads[0].vocab_size) if heads else _token_cross_entropy
        # a pipeline weights a mean by y.numel(), padding included: its defaults return (sum, count)
        pipe_loss = _vocab_parallel_loss(ctx, heads[0].vocab_size, pair=True) if heads else _token_cross_entropy_sum
    # 2. pipeline split, 3. activation checkpointing inside the stages
    if pp_size > 1:
        seq = list(blocks(model)) if blocks is not None else list(model)
        strategy = None
        if dp.startswith("zero"):  # its checks before the pipeline's collectives
            strategy = make_strategy(dp, ctx=ctx, loss_scaler=loss_scaler, **dict(dp_options or {}))
            strategy.check_stages(nn.ModuleList(seq))
        pipe = PipelineParallel(
            seq,
            ctx,
            schedule=opts.schedule,
            microbatches=opts.microbatches,
            loss_fn=pipe_loss,
            virtual_stages=opts.virtual_stages,
            split=opts.split,
            split_example=opts.split_example,
            checkpointing=checkpointing,
            stats=stats,
            normalize_over_dp=True,  # ddp and ZeRO average p.grad over dp after the step
        )
        if tp > 1:  # sum only this rank's stages' norm grads, each stage on its own ([Note:
            # sequence-parallel grads under ZeRO-3 and pipelines] in parallel/tensor/sequence_parallel.py)
            for s in sorted(pipe.stages):
                share_sequence_parallel_grads(pipe.stages[s])
        # 4. data parallel after each pipeline step: ddp a coalesced all-reduce (ParallelModel),
        # zero1/zero2 a reduce-scatter per bucket of this rank's stages (the ZeRO wrapper)
        stages = nn.ModuleList(pipe.stages[s] for s in sorted(pipe.stages))
        if strategy is not None:
            # keyed by block index: state_dict keys are the unsplit nn.Sequential(*blocks)'s,
            # distinct across pp ranks (checkpoints) and equal to pipe.full_state_dict()'s
            stages = strategy.wrap_stages(pipe.held_blocks(), uncounted=_uncounted_tie_copies(pipe, ctx))
        par = ParallelModel(
            ctx, module=stages, loss_fn=loss_fn, strategy=strategy, pipeline=pipe, dp=dp, autocast=None, loss_scaler=loss_scaler
        )
        par.stats = stats
        par.fused_heads = fused
        if cp_opts is not None:  # the pipeline's loss is already (sum, count): it normalizes over dp x cp
            par.sequence = SequenceShardedLoss(ctx, cp_opts.layout, pipe_loss, stats=stats)
        return par
    # 3. activation checkpointing on the blocks (no pipeline)
    if checkpointing:
        from .activation_checkpointing import checkpoint_blocks

        # a block holding a fused head is not recomputed: its loss would be formed twice, and a
        # backward outside ParallelModel.loss_path would recompute logits instead of the loss
        held = [b for b in blocks(model) if not any(m is h for m in b.modules() for h in fused)]
        checkpoint_blocks(held, offload_to_cpu=checkpointing == "cpu")
    # 4. data parallel
    if tp > 1 and (dp == "none" or (dp == "ddp" and axis_size(ctx, "dp_cp") == 1)):  # nothing to replicate over
        par = ParallelModel(
            ctx, module=model, loss_fn=loss_fn, strategy=None, pipeline=None, dp=dp, autocast=autocast, loss_scaler=loss_scaler
        )
    else:
        strategy = make_strategy(dp, ctx=ctx, loss_scaler=loss_scaler, **dict(dp_options or {}))
        if dp == "zero3" and tp > 1:  # a node per stage-3 unit (the strategy's default units): [Note:
            # sequence-parallel grads under ZeRO-3 and pipelines] in parallel/tensor/sequence_parallel.py
            share_sequence_parallel_grads(model, scopes=[spec.module for spec in select_units(model, None)[1:]])
        module = strategy.wrap(model)
        # the strategy scales and unscales; par.loss_scaler is the same object, for checkpoints and reports
        par = ParallelModel(
            ctx,
            module=module,
            loss_fn=loss_fn,
            strategy=strategy,
            pipeline=None,
            dp=dp,
            autocast=autocast,
            loss_scaler=loss_scaler,
        )
    par.stats = stats
    par.fused_heads = fused
    if cp_opts is not None:  # a fused head hands over its sum (ParallelModel._cp_loss_path)
        cp_loss = fused[0].sum_and_count if fused else pipe_loss
        par.sequence = SequenceShardedLoss(ctx, cp_opts.layout, cp_loss, stats=stats)
    return par


def _check_context_parallel(
    model: nn.Module,
    ctx: ParallelContext | None,
    cp: ContextParallelOptions | Mapping[str, Any] | None,
    dp: str,
    loss_fn: LossFn | None,
) -> ContextParallelOptions | None:
    """The cp options of :func:`parallelize`, checked before any collective."""
    size = axis_size(ctx, "cp")
    if cp is None:  # with cp > 1: every cp rank runs the whole batch (a model without attention, a
        return None  # second model beside a sequence-sharded one); its gradients agree over cp
    opts = ContextParallelOptions.of(cp)
    plan_modules(model, opts.plan)  # its patterns name modules of the model as given
    if size == 1:  # as a tp_plan at tp = 1: checked, then nothing to do (one script for any cp)
        return None
    if dp == "none":
        raise ValueError("dp='none' with cp > 1: the cp ranks' gradients must be summed; pick 'ddp' or a ZeRO stage")
    if loss_fn is not None:
        raise ValueError(
            "cp: the loss over sequence shards weighs every token of the replica alike ([Note: the loss over cp "
            "shards]); a custom loss_fn cannot be split that way: leave loss_fn=None (token cross-entropy)"
        )
    try:
        check_ulysses_size(opts.mode, opts.ulysses_size, size)
    except (TypeError, ValueError) as e:
        raise type(e)(f"cp: {e}") from None
    return opts


def _merge(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """Two ``CommStats.summary()`` dicts added op by op."""
    out = {op: {"calls": v["calls"], "bytes": v["bytes"], "groups": dict(v.get("groups", {}))} for op, v in a.items()}
    for op, v in b.items():
        cur = out.setdefault(op, {"calls": 0, "bytes": 0, "groups": {}})
        cur["calls"] += v["calls"]
        cur["bytes"] += v["bytes"]
        for label, g in v.get("groups", {}).items():
            old = cur["groups"].get(label, {"calls": 0, "bytes": 0})
            cur["groups"][label] = {"calls": old["calls"] + g["calls"], "bytes": old["bytes"] + g["bytes"]}
    return out


def _uncounted_tie_copies(pipe: PipelineParallel, ctx: ParallelContext) -> list[nn.Parameter]:
    """This rank's copies of parameters tied across pipeline stages whose squares another copy
    counts in the global norm: a tie's gradient is the same on every copy (the pipeline sums it
    over them), so only the first local copy on the tie's source rank counts."""
    me = ctx.rank("pp")
    out: list[nn.Parameter] = []
    for tie in pipe.tied.ties:
        counted = tie.local[:1] if me == tie.src else []
        out += [q for q in tie.local if not any(q is c for c in counted)]
    return out


def _loss_from_the_head(head: FusedCrossEntropyHead) -> Callable[..., Any]:
    """The loss a fused head formed inside the model's forward (ParallelModel.loss_path): the
    model must return the head's output itself."""

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        head.check_returned(out)
        return out

    return loss


def _fused_head_loss(head: FusedCrossEntropyHead) -> Callable[..., Any]:
    """A pipeline's last-stage loss for a deferred fused head: ``(sum, count)`` over the
    non-ignored targets of the hidden states it handed on (which the stage must return as is)."""

    def loss_and_count(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head.check_returned(hidden)
        return head.loss(hidden, targets, reduction="sum"), (targets != _IGNORE_INDEX).sum()

    return loss_and_count


def _vocab_parallel_loss(ctx: ParallelContext, vocab_size: int, *, pair: bool = False) -> Callable[..., Any]:
    """The vocab-parallel token cross-entropy: the mean, or (``pair``, for a pipeline) ``(sum,
    count)`` over the non-ignored targets."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, ctx=ctx, vocab_size=vocab_size, reduction="mean")

    def loss_and_count(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = vocab_parallel_cross_entropy(logits, targets, ctx=ctx, vocab_size=vocab_size, reduction="sum")
        return total, (targets != _IGNORE_INDEX).sum()

    return loss_and_count if pair else loss
