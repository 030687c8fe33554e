"""The resolved config: a frozen dataclass tree (what ``load_config`` returns).

Every field holds a final value: no "auto", no string booleans, integer sizes as ints. The
classes that build things (an optimizer, a scheduler, a loss scaler) import their targets
lazily, so reading a config imports no kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "ContextParallelConfig",
    "EngineConfig",
    "LossScaleConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "ZeroConfig",
]

Device = Literal["none", "cpu", "nvme"]
_MiB = 1 << 20


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class LossScaleConfig:
    """The ``fp16`` loss-scaling keys, named as ``DynamicLossScaler``'s constructor arguments."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def make(self) -> Any:
        """A :class:`shardkit.parallel.DynamicLossScaler` with these arguments."""
        from shardkit.parallel import DynamicLossScaler

        return DynamicLossScaler(**self.__dict__)


@dataclass(frozen=True)
class PrecisionConfig:
    """``fp16``/``bf16`` sections: the training dtype and, for fp16, the loss scaler; and
    ``torch_autocast``: the dtype the engine's forward autocasts to (None: no autocast).

    Attributes:
        dtype: the parameters' dtype.
        loss_scaler: the fp16 loss scaler's arguments (fp16 only).
        autocast: ``"bf16"`` when ``torch_autocast`` is enabled (the only dtype offered: fp16
            autocast needs a gradient scaler the engine does not apply to fp32 parameters).
    """

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scaler: LossScaleConfig | None = None  # fp16 only
    autocast: Literal["bf16"] | None = None

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element (DeepSpeed's bucket sizes count elements of this dtype)."""
        return 4 if self.dtype == "fp32" else 2

    def forward_context(self, device_type: str) -> AbstractContextManager[Any]:
        """The autocast context the engine's forward runs in, as DeepSpeed's ``autocast_if_enabled``.

        With ``torch_autocast`` enabled: ``torch.autocast(device_type, bfloat16)``, replacing any
        autocast the caller opened. Without it, a CUDA autocast the caller opened is switched off
        for the forward (DeepSpeed does the same, with one warning: its ``fp16``/``bf16``
        sections decide the precision); otherwise nothing.

        Example:
            >>> with cfg.precision.forward_context("cuda"):
            ...     out = model(x)
        """
        import torch

        global _WARNED_OUTER_AUTOCAST
        if self.autocast is not None:
            return torch.autocast(device_type, dtype=torch.bfloat16, enabled=True)
        if torch.is_autocast_enabled():  # DeepSpeed looks at CUDA's autocast only
            if not _WARNED_OUTER_AUTOCAST:
                _WARNED_OUTER_AUTOCAST = True
                logging.getLogger("shardkit.engine").warning(
                    "torch.autocast is enabled outside the engine but the config has no torch_autocast section "
                    "enabled: the engine's forward runs without autocast (as DeepSpeed's; the fp16/bf16 sections "
                    "decide the precision, or enable torch_autocast in the config)"
                )
            return torch.autocast(device_type, enabled=False)
        return nullcontext()


_WARNED_OUTER_AUTOCAST = False


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: DeepSpeed's type mapped onto a shardkit fused optimizer.

    Attributes:
        type: the type as written in the config (``"AdamW"``, ``"Adam"``, ``"SGD"``, ...).
        class_name: the ``shardkit.kernels`` class it maps to (``"FusedAdamW"``, ...).
        params: that class's keyword arguments, DeepSpeed's defaults filled in.
    """

    type: str
    class_name: str
    params: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    def optimizer_class(self) -> type:
        import shardkit.kernels as kernels

        return getattr(kernels, self.class_name)

    def build(self, params: Iterable[Any], **overrides: Any) -> Any:
        """``optimizer_class()(params, **self.params, **overrides)``."""
        return self.optimizer_class()(params, **{**self.params, **overrides})


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: a type of :data:`shardkit.engine.SCHEDULERS` and its constructor kwargs."""

    type: str
    params: Mapping[str, Any] = field(default_factory=lambda: _frozen({}))

    def build(self, optimizer: Any) -> Any:
        """The scheduler over ``optimizer`` (anything with ``param_groups``)."""
        from .schedulers import make_scheduler

        return make_scheduler(self.type, optimizer, dict(self.params))


@dataclass(frozen=True)
class OffloadConfig:
    """``offload_optimizer`` / ``offload_param``."""

    device: Device = "none"
    nvme_path: str | None = None
    pin_memory: bool = True  # DeepSpeed 0.19.8's default
    buffer_count: int | None = None

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``. Sizes are in elements, as DeepSpeed counts them."""

    stage: int = 0
    offload_optimizer: OffloadConfig = OffloadConfig()
    offload_param: OffloadConfig = OffloadConfig()
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    sub_group_size: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    gather_16bit_weights_on_model_save: bool = False
    #: ``zero_hpz_partition_size``: stage 3's backward gathers inside blocks of this many dp ranks
    #: (ZeRO++'s hpZ; ``ShardedDataParallel(reshard_after_forward=...)``); 1: off
    hpz_partition_size: int = 1

    def bucket_mb(self, grad_bytes: int) -> float:
        """``reduce_bucket_size`` as shardkit's ``bucket_mb`` (MiB of gradients of ``grad_bytes``)."""
        return self.reduce_bucket_size * grad_bytes / _MiB

    @property
    def offload(self) -> Device | None:
        """The planner's/``ShardedDataParallel``'s ``offload``: None, "cpu" or "nvme"."""
        return None if self.offload_optimizer.device == "none" else self.offload_optimizer.device


#: ``tensor_parallel.plan`` values: "auto" picks by the model's type (shardkit.engine.model_layout).
TP_PLANS = ("auto", "gpt", "hf_gpt2", "llama")


@dataclass(frozen=True)
class TensorParallelConfig:
    """shardkit's ``tensor_parallel`` section.

    Attributes:
        size: ranks per tensor-parallel group (1: no tensor parallelism).
        plan: the TP plan: ``"auto"`` (by the model's type: shardkit's TinyGPT → ``"gpt"``, a
            ``transformers`` GPT-2 → ``"hf_gpt2"``, a Llama → ``"llama"``) or one of those names;
            ``initialize(tp_plan={...})`` overrides it with a plan of its own.
        gather_logits: all-gather the vocabulary-parallel LM head's logits to the full
            vocabulary (True: the model's own loss, e.g. Hugging Face's ``labels=``, runs
            unchanged); False leaves ``[..., V/tp]`` shards for ``vocab_parallel_cross_entropy``.
    """

    size: int = 1
    plan: str = "auto"
    gather_logits: bool = True


@dataclass(frozen=True)
class FusedCrossEntropyConfig:
    """shardkit's ``fused_cross_entropy`` section: the token cross-entropy formed from the LM
    head's input chunk by chunk (:func:`~shardkit.parallel.tensor.fused_linear_cross_entropy`),
    on a Hugging Face model's ``engine(input_ids=..., labels=...)`` loss.

    Attributes:
        enabled: swap the LM head for a :class:`~shardkit.parallel.tensor.FusedCrossEntropyHead`.
        chunk_tokens: tokens per chunk (None: the op's default).
    """

    enabled: bool = False
    chunk_tokens: int | None = None


#: ``context_parallel.mode`` values (:func:`~shardkit.parallel.context.context_parallel_attention`)
CP_MODES = ("ulysses", "ring", "hybrid")


@dataclass(frozen=True)
class ContextParallelConfig:
    """The sequence split: DeepSpeed's top-level ``sequence_parallel_size`` and shardkit's
    ``context_parallel`` section (docs/engine.md, "Long sequences").

    Attributes:
        size: ranks that split each sequence (the cp axis; 1: none). dp = world / (tp × pp × size).
        mode: ``"ulysses"`` (all-to-all of heads, DeepSpeed's meaning of the key), ``"ring"``
            (K/V blocks around the ring: any head count) or ``"hybrid"`` (Ulysses within groups
            of ``ulysses_size`` ranks, the ring across them).
        layout: how a sequence is cut: ``"zigzag"`` (balanced causal work) or ``"contiguous"``.
        ulysses_size: ``"hybrid"``'s all-to-all group size (a divisor of ``size``), else None.
    """

    size: int = 1
    mode: str = "ulysses"
    layout: str = "zigzag"
    ulysses_size: int | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """shardkit's ``pipeline`` section (microbatches default: ``gradient_accumulation_steps``,
    as DeepSpeed's pipeline engine runs one micro-batch per accumulation step; ``train_batch``
    concatenates the accumulation steps' micro-batches and the schedule cuts that batch into
    ``microbatches``)."""

    stages: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1  # stages per rank ("interleaved")
    # how blocks are cut into stages: "layers", "params", or blocks per stage (a PipelineModule's
    # own cut, which initialize sets)
    partition: str | tuple[int, ...] = "layers"


@dataclass(frozen=True)
class EngineConfig:
    """A DeepSpeed-style config, resolved. Built by :func:`shardkit.engine.load_config`.

    Attributes:
        world_size: ranks in the job.
        dp_size: data-parallel ranks, ``world_size / (tensor_parallel.size × pipeline.stages ×
            sequence_parallel_size)``.
        train_batch_size: samples per optimizer step over all data-parallel ranks.
        train_micro_batch_size_per_gpu: samples per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        gradient_clipping: max global gradient norm; 0 = no clipping; absent from the config: 1.0
            (DeepSpeed 0.19.8's default).
        precision: dtype, loss scaler and the forward's autocast (``torch_autocast``).
        optimizer: None when the config has no ``optimizer`` (the client brings one).
        scheduler: None when the config has no ``scheduler``.
        zero: ``zero_optimization``.
        tensor_parallel: shardkit's ``tensor_parallel`` section.
        pipeline: shardkit's ``pipeline`` section.
        fused_cross_entropy: shardkit's ``fused_cross_entropy`` section.
        context_parallel: ``sequence_parallel_size`` and the ``context_parallel`` section.
        ignored: dotted keys accepted without effect, once each, in the order the parser met them.
        source: the config as given (after JSON loading), read-only.
    """

    world_size: int
    dp_size: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = ZeroConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    fused_cross_entropy: FusedCrossEntropyConfig = FusedCrossEntropyConfig()
    context_parallel: ContextParallelConfig = ContextParallelConfig()
    ignored: tuple[str, ...] = ()
    source: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), repr=False, compare=False)
