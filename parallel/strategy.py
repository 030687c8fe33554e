"""The data-parallel plug-in behind :class:`~shardkit.parallel.ParallelModel`: wrap, backward,
clip, step, report for one dp layout (``"none"``, ``"ddp"``, ``"zero1"``-``"zero3"``).

Not the API a training loop uses: loops build with :func:`~shardkit.parallel.parallelize` and
talk to the ``ParallelModel`` it returns, which drives the strategy on the dp axis and adds
tensor and pipeline parallelism around it. The strategy is internal (it is not exported from
``shardkit.parallel``); what it does per phase::

    strategy = make_strategy("ddp", ctx=ctx, loss_scaler=scaler)   # parallelize does this
    model = strategy.wrap(model)
    optimizer = strategy.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
    strategy.backward(loss)          # loss scaling (fp16); gradient communication starts here
    strategy.clip(max_norm=1.0)      # finalize: unscale, inf/nan agreed over ranks, clip
    strategy.step(optimizer)         # skipped on overflow; loss-scale update
    strategy.report(optimizer)       # per-rank bytes by category, comm stats

Each phase runs under a profiler label ``shardkit::<phase>`` (backward, finalize, step). A dp
layout subclasses :class:`Strategy`, is decorated with :func:`register_strategy`, and overrides
the phases whose data path differs (ZeRO: what the wrapped model's post-backward launches, the
norm group in :meth:`Strategy.clip`, the sharded step). The built-in names are
:mod:`~shardkit.parallel.strategy_names`'.

Memory categories of :class:`StrategyReport` follow docs/reference.md, "ZeRO memory and
communication" (params, grads, optimizer state per rank), so a ZeRO stage can be checked against
its formula with the same report.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import torch
from torch import nn
from torch.profiler import record_function

from shardkit.comm import ParallelContext

from .data_parallel import DataParallel
from .grad_utils import clip_grad_norm_
from .loss_scaler import DynamicLossScaler, step_unless_overflow
from .memory_report import replicated_memory_report
from .strategy_names import DP_STRATEGIES, STRATEGY_MODULES

__all__ = [
    "DataParallelStrategy",
    "SingleProcessStrategy",
    "Strategy",
    "StrategyReport",
    "available_strategies",
    "get_strategy_class",
    "make_strategy",
    "register_strategy",
    "report_memory",
]


@dataclass
class StrategyReport:
    """What one rank holds and has communicated, as reported by :meth:`Strategy.report`.

    Attributes:
        memory: bytes on this rank by category: ``params``, ``grads`` (distinct storages, so a
            grad that is a view of a flat bucket counts once, and the buckets count too) and
            ``optimizer_state``.
        comm: ``CommStats.summary()`` of the strategy's collectives, or None (no communication).
        loss_scale: the current fp16 loss scale, or None without a loss scaler.
        skipped_steps: optimizer steps skipped because a gradient overflowed.
    """

    memory: dict[str, int]
    comm: dict[str, Any] | None = None
    loss_scale: float | None = None
    skipped_steps: int = 0


def report_memory(mem: dict[str, Any]) -> dict[str, int]:
    """:attr:`StrategyReport.memory` from a memory report (``replicated_memory_report`` or ZeRO's
    ``memory_report``): params, grads, and optimizer state with the fp32 masters counted in it.

    Example:
        >>> report_memory(replicated_memory_report(model.parameters(), optimizer))
        {'params': 4096, 'grads': 4096, 'optimizer_state': 8200}
    """
    return {
        "params": mem["params"],
        "grads": mem["grads"],
        "optimizer_state": mem["optimizer_state"] + mem["master_params"],
    }


class Strategy(ABC):
    """Base class of the parallel strategies: the phases of one training step.

    Subclasses set :attr:`name` (the registry key) and implement :meth:`wrap`; the default
    backward / clip / step / report phases are those of replicated training (every rank holds
    full parameters, gradients and optimizer state), which sharded strategies override.

    Call order per step: :meth:`backward` → :meth:`clip` (optional) → :meth:`step`. Without a
    :meth:`clip` call, :meth:`step` finalizes the gradients itself (fp16 gradients are always
    unscaled and checked for inf/nan before an optimizer sees them).

    Args:
        ctx: the parallel context (required when :attr:`needs_context`).
        loss_scaler: fp16 loss scaler, or None (fp32/bf16 need none: bf16 has fp32's range).
    """

    #: registry key, e.g. ``"ddp"``
    name: ClassVar[str]
    #: whether the strategy communicates (the application then builds a ParallelContext)
    needs_context: ClassVar[bool] = False

    def __init__(self, *, ctx: ParallelContext | None = None, loss_scaler: DynamicLossScaler | None = None) -> None:
        if self.needs_context and not isinstance(ctx, ParallelContext):
            raise TypeError(f"strategy {self.name!r} needs ctx=ParallelContext, got {type(ctx).__name__}")
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}")
        self.ctx = ctx
        self.loss_scaler = loss_scaler
        self.model: nn.Module | None = None
        self.skipped_steps = 0
        self._finalized = True  # no gradients yet: nothing to finalize
        self._overflow = False

    # ---- phases ----------------------------------------------------------------------------
    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the built, identically seeded model (already on its device); returns the module to train."""

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> Any:
        """Build the optimizer for the wrapped model (call after :meth:`wrap`).

        Replicated strategies build ``optimizer_class(params, **kwargs)``; sharded ones wrap it so
        that it steps on this rank's shard (``params``: the wrapped model's original parameters,
        or groups of them, as for a plain optimizer).

        Example:
            >>> opt = strategy.make_optimizer(FusedAdamW, model.parameters(), lr=3e-4)
        """
        return optimizer_class(params, **kwargs)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Backward of this rank's loss, scaled by the loss scaler when there is one.

        Args:
            loss: 0-d loss of this rank's micro-batch (fp32; fp16 autocast losses are fp32).
            retain_graph: keep the graph for another backward (``Tensor.backward``'s).
        """
        with record_function("shardkit::backward"):
            scaled = self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss
            scaled.backward(retain_graph=retain_graph)
        self._finalized = False

    def clip(self, max_norm: float | None) -> torch.Tensor | None:
        """Finalize the gradients and clip them to global L2 norm ``max_norm`` (None: no clipping).

        With a loss scaler: one fused pass unscales, finds inf/nan (agreed over
        :meth:`overflow_group`, so every rank skips the same step) and computes the norm.

        Returns:
            The pre-clip global gradient norm as a 0-d fp32 tensor (``inf`` on overflow), or None
            when neither clipping nor unscaling computed one.
        """
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        self._require_model()
        with record_function("shardkit::finalize"):
            norm: torch.Tensor | None = None
            if self.loss_scaler is not None:
                report = self.loss_scaler.unscale_(
                    list(self.model.named_parameters()), group=self.overflow_group(), max_norm=max_norm
                )
                self._overflow = report.overflow
                norm = torch.tensor(report.grad_norm)
            elif max_norm is not None:
                norm = clip_grad_norm_(self.model.parameters(), max_norm)  # replicated grads: the local norm is global
            self._finalized = True
        return norm

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Run the optimizer unless a gradient overflowed; advance the loss scale.

        Returns:
            True when the optimizer stepped, False when the step was skipped (fp16 overflow).
        """
        if not self._finalized:
            self.clip(None)
        stepped = step_unless_overflow(optimizer.step, self._overflow, self.loss_scaler)
        self.skipped_steps += int(not stepped)
        self._overflow = False
        return stepped

    def report(self, optimizer: torch.optim.Optimizer | None = None) -> StrategyReport:
        """This rank's memory by category and communication so far (see :class:`StrategyReport`)."""
        model = self._require_model()
        memory = report_memory(replicated_memory_report(model.parameters(), optimizer, self.grad_buffers()))
        stats = getattr(model, "comm_stats", None)
        return StrategyReport(
            memory=memory,
            comm=stats.summary() if stats is not None else None,
            loss_scale=self.loss_scaler.scale if self.loss_scaler is not None else None,
            skipped_steps=self.skipped_steps,
        )

    # ---- what subclasses vary --------------------------------------------------------------
    def overflow_group(self) -> Any:
        """Ranks that must agree on an fp16 overflow (None: this process alone)."""
        return None

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient storage held besides ``p.grad`` (e.g. flat communication buckets)."""
        return []

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"strategy {self.name!r}: call wrap(model) first")
        return self.model


_REGISTRY: dict[str, type[Strategy]] = {}
_S = TypeVar("_S", bound=type[Strategy])


def register_strategy(cls: _S) -> _S:
    """Class decorator: make ``cls`` available to :func:`make_strategy` under ``cls.name``.

    Example:
        >>> @register_strategy
        ... class MyStrategy(Strategy):
        ...     name = "mine"
        ...     needs_context = True
        ...     def wrap(self, model): ...
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a Strategy subclass, got {cls!r}")
    if cls.name in STRATEGY_MODULES and cls.__module__ != STRATEGY_MODULES[cls.name]:
        raise ValueError(f"strategy name {cls.name!r} is a built-in one ({STRATEGY_MODULES[cls.name]}); choose another")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_strategies() -> tuple[str, ...]:
    """The built-in strategy names (:data:`~shardkit.parallel.strategy_names.DP_STRATEGIES`),
    then any registered with :func:`register_strategy`.

    Example:
        >>> available_strategies()
        ('none', 'ddp', 'zero1', 'zero2', 'zero3')
    """
    return DP_STRATEGIES + tuple(n for n in _REGISTRY if n not in DP_STRATEGIES)


def get_strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name`` (e.g. to read :attr:`Strategy.needs_context` before building a context).

    A built-in name imports the module that defines it (:data:`~shardkit.parallel.strategy_names.STRATEGY_MODULES`).

    Raises:
        ValueError: unknown ``name``.

    Example:
        >>> get_strategy_class("zero2").needs_context
        True
    """
    if name not in _REGISTRY and name in STRATEGY_MODULES:
        importlib.import_module(STRATEGY_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; available: {list(available_strategies())}")
    return _REGISTRY[name]


def make_strategy(
    name: str,
    *,
    ctx: ParallelContext | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    **options: Any,
) -> Strategy:
    """Build the strategy registered as ``name``.

    Args:
        name: one of :func:`available_strategies`.
        ctx: the parallel context (required by strategies that communicate).
        loss_scaler: fp16 loss scaler, or None.
        **options: the strategy's own keyword options (e.g. ``bucket_mb`` for ``"ddp"``).

    Raises:
        ValueError: unknown ``name``.
        TypeError: missing ``ctx``, or an option the strategy does not take.

    Example:
        >>> s = make_strategy("ddp", ctx=ParallelContext.from_env(), bucket_mb=25)
        >>> model = s.wrap(model)
    """
    return get_strategy_class(name)(ctx=ctx, loss_scaler=loss_scaler, **options)


@register_strategy
class SingleProcessStrategy(Strategy):
    """No parallelism: this process trains the whole model (``"none"``).

    Example:
        >>> s = make_strategy("none")
        >>> model = s.wrap(model)
    """

    name = "none"

    def wrap(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        return model


@register_strategy
class DataParallelStrategy(Strategy):
    """Replicated data parallelism over ``ctx``'s dp axis, on :class:`~shardkit.parallel.DataParallel` (``"ddp"``).

    Gradients are averaged over dp during backward (bucketed all-reduces overlapped with
    autograd; with a loss scaler the unscale is fused into the same pass); fp16 overflows are
    agreed over the dp group. Replicas hold identical gradients
    after the all-reduce, so the clip norm needs no further communication.

    Args:
        ctx: the parallel context.
        loss_scaler: fp16 loss scaler, or None.
        bucket_mb: gradient bucket capacity in MiB.
        grad_buckets: ``"view"`` makes each grad a view of its bucket (gradients held once);
            ``"copy"`` keeps separate grads.

    Example:
        >>> s = make_strategy("ddp", ctx=ctx, bucket_mb=25, grad_buckets="view")
        >>> model = s.wrap(TinyGPT(59).to(ctx.device))
    """

    name = "ddp"
    needs_context = True

    def __init__(
        self,
        *,
        ctx: ParallelContext | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        bucket_mb: float = 25.0,
        grad_buckets: Literal["copy", "view"] = "copy",
    ) -> None:
        super().__init__(ctx=ctx, loss_scaler=loss_scaler)
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if grad_buckets not in ("copy", "view"):
            raise ValueError(f"grad_buckets must be 'copy' or 'view', got {grad_buckets!r}")
        self.bucket_mb = float(bucket_mb)
        self.grad_buckets = grad_buckets

    def wrap(self, model: nn.Module) -> nn.Module:
        # With a loss scaler, DataParallel fuses the unscale (and the inf/nan flag and Σg²) into
        # its post-all-reduce copy back; clip()'s scaler.unscale_ then only agrees the overflow.
        self.model = DataParallel(
            model,
            self.ctx,
            bucket_mb=self.bucket_mb,
            gradient_as_bucket_view=self.grad_buckets == "view",
            loss_scaler=self.loss_scaler,
        )
        return self.model

    def overflow_group(self) -> Any:
        # With DDP an inf already reaches every rank through the all-reduce; agreeing costs 4 bytes
        # and keeps the ranks in step even when a rank's local epilogue sees it first.
        return self.ctx.group("dp_cp")

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in getattr(self.model, "buckets", [])]
