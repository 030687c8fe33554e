"""The ZeRO strategies (``"zero1"``, ``"zero2"``, ``"zero3"``) of :mod:`shardkit.parallel.strategy`.

They live beside :class:`ShardedDataParallel` (the registry's base classes do not import the ZeRO
runtime); importing :mod:`shardkit.parallel` registers them.

Example:
    >>> from shardkit.parallel.strategy import make_strategy
    >>> s = make_strategy("zero2", ctx=ctx, offload="cpu")
    >>> model = s.wrap(model); opt = s.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.profiler import record_function

from shardkit.comm import ParallelContext

from ..loss_scaler import DynamicLossScaler
from ..strategy import Strategy, StrategyReport, register_strategy, report_memory
from .optimizer import ZeroOptimizer
from .pipeline_sharded import PipelineShardedDataParallel
from .sharded import ShardedDataParallel, _validate

__all__ = ["Zero1Strategy", "Zero2Strategy", "Zero3Strategy"]


class _ZeroStrategy(Strategy):
    """ZeRO over ``ctx``'s dp axis on :class:`~shardkit.parallel.zero.ShardedDataParallel`.

    ``wrap`` shards, :meth:`make_optimizer` returns a
    :class:`~shardkit.parallel.zero.ZeroOptimizer` (the loop's per-group lr updates reach the
    shard optimizer through its ``param_groups``), ``clip`` finalizes the gradient shards (one
    fused pass: average, unscale, inf/nan, Σg²; one 8-byte all-reduce for the overflow flag and
    the GLOBAL norm), ``step`` steps the shard and all-gathers, and ``report`` gives
    ``memory_report()``'s persistent bytes (optimizer state = fp32 master shards + moments, the
    paper's KΨ/N) plus the peak of transient buffers.

    Args:
        ctx: the parallel context (dp must span the world).
        loss_scaler: fp16 loss scaler, or None.
        bucket_mb: bucket capacity in MiB.
        offload: None/"none", "cpu" or "nvme": the optimizer state and step off the device (docs/offload.md).
        nvme_dir: the directory for ``offload="nvme"``.
        offload_params: stage 3 with ``offload``: the parameter shards live in host memory too.
        forward_prefetch: stage 3: gather the next unit's parameters while this one computes.
        reshard_after_forward: stage 3: True, False or an int block size (hierarchical gathers:
            :class:`~shardkit.parallel.zero.ShardedDataParallel`).
    """

    needs_context = True
    stage: ClassVar[int]

    def __init__(
        self,
        *,
        ctx: ParallelContext | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        bucket_mb: float = 25.0,
        offload: Literal["none", "cpu", "nvme"] | None = None,
        nvme_dir: str | None = None,
        offload_params: bool = False,
        forward_prefetch: bool = False,
        reshard_after_forward: bool | int = True,
    ) -> None:
        super().__init__(ctx=ctx, loss_scaler=loss_scaler)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if offload not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"offload must be None, 'none', 'cpu' or 'nvme', got {offload!r}")
        self.bucket_mb = float(bucket_mb)
        self.offload = None if offload == "none" else offload
        self.nvme_dir = nvme_dir
        if (offload_params or forward_prefetch or reshard_after_forward is not True) and self.stage != 3:
            raise ValueError(
                "offload_params, forward_prefetch and reshard_after_forward are stage-3 options; "
                f"{self.name!r} is stage {self.stage}"
            )
        self.offload_params = bool(offload_params)
        self.forward_prefetch = bool(forward_prefetch)
        self.reshard_after_forward = reshard_after_forward

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = ShardedDataParallel(
            model,
            self.ctx,
            self.stage,
            bucket_mb=self.bucket_mb,
            loss_scaler=self.loss_scaler,
            offload=self.offload,
            nvme_dir=self.nvme_dir,
            offload_params=self.offload_params,
            forward_prefetch=self.forward_prefetch,
            reshard_after_forward=self.reshard_after_forward,
        )
        return self.model

    def check_stages(self, model: nn.Module) -> None:
        """:meth:`wrap_stages`' argument checks on the whole model, before the pipeline is built
        (its constructor and the stage context communicate): ValueError/TypeError naming the
        argument on every rank alike.

        Example:
            >>> s.check_stages(model)   # then PipelineParallel(...), then s.wrap_stages(...)
        """
        if self.stage == 3:
            raise ValueError(
                "dp='zero3' does not compose with the pipeline: its per-unit parameter gathers would have to be "
                "issued per micro-batch inside the schedule; use dp='zero1' or 'zero2' (or 'ddp') with pp"
            )
        args = (self.stage, self.bucket_mb, None, True, self.offload, self.nvme_dir, None, self.loss_scaler)
        _validate(model, self.ctx, *args, pipeline=True)

    def wrap_stages(self, stages: nn.Module, *, uncounted: Iterable[nn.Parameter] = ()) -> nn.Module:
        """Wrap one pipeline rank's stages (stages 1-2; see [Note: ZeRO under a pipeline] in
        :mod:`~shardkit.parallel.zero.pipeline_sharded`); the loop then calls the wrapper's
        ``reduce_gradients()`` after each pipeline step. With the strategy's ``loss_scaler`` the
        pipeline must seed its backward with ``loss_scaler.scale`` (``parallelize`` does); the
        epilogue unscales and agrees the overflow over dp, tp and pp.

        Example:
            >>> model = s.wrap_stages(nn.ModuleList(pipe.stages[k] for k in sorted(pipe.stages)))
        """
        self.check_stages(stages)
        self.model = PipelineShardedDataParallel(
            stages,
            self.ctx,
            self.stage,
            uncounted=uncounted,
            bucket_mb=self.bucket_mb,
            offload=self.offload,
            nvme_dir=self.nvme_dir,
            loss_scaler=self.loss_scaler,
        )
        return self.model

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> ZeroOptimizer:
        self._require_model()
        return ZeroOptimizer(self.model, optimizer_class, params, **kwargs)

    def clip(self, max_norm: float | None) -> torch.Tensor | None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        self._require_model()
        with record_function("shardkit::finalize"):
            self._overflow, norm = self.model.finalize_gradients(max_norm)
            self._finalized = True
        return norm

    def step(self, optimizer: Any) -> bool:
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(
                f"strategy {self.name!r} steps a ZeroOptimizer (strategy.make_optimizer), got {type(optimizer).__name__}"
            )
        if not self._finalized:
            self.clip(None)
        optimizer.step()  # skips on an agreed overflow and updates the loss scale itself
        self.skipped_steps += int(optimizer.last_step_skipped)
        self._overflow = False
        return not optimizer.last_step_skipped

    def report(self, optimizer: Any = None) -> StrategyReport:
        model = self._require_model()
        mem = model.memory_report()
        memory = {
            **report_memory(mem),
            "peak_transient": mem["peak_transient"],
            # offload: fp32 masters + optimizer state held off the device (CPU memory / NVMe files)
            "offloaded": sum(v for k, v in mem.get("offloaded", {}).items() if k in ("cpu", "nvme")),
        }
        return StrategyReport(
            memory=memory,
            comm=model.comm_stats.summary(),
            loss_scale=self.loss_scaler.scale if self.loss_scaler is not None else None,
            skipped_steps=self.skipped_steps,
        )


@register_strategy
class Zero1Strategy(_ZeroStrategy):
    """ZeRO stage 1 (``"zero1"``): optimizer state sharded; full gradients kept.

    Example:
        >>> s = make_strategy("zero1", ctx=ctx)
        >>> model = s.wrap(model); opt = s.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
    """

    name = "zero1"
    stage = 1


@register_strategy
class Zero2Strategy(_ZeroStrategy):
    """ZeRO stage 2 (``"zero2"``): optimizer state and gradients sharded.

    Example:
        >>> s = make_strategy("zero2", ctx=ctx, bucket_mb=25)
        >>> model = s.wrap(model); opt = s.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
    """

    name = "zero2"
    stage = 2


@register_strategy
class Zero3Strategy(_ZeroStrategy):
    """ZeRO stage 3 (``"zero3"``): optimizer state, gradients and parameters sharded; each block
    of the model (each child of a ``ModuleList``/``Sequential``) is gathered just before its
    forward and backward and freed after, the next one prefetched.

    Example:
        >>> s = make_strategy("zero3", ctx=ctx, bucket_mb=25)
        >>> model = s.wrap(model); opt = s.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
    """

    name = "zero3"
    stage = 3
