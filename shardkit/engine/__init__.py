"""The DeepSpeed-config layer of shardkit: config parsing, DeepSpeed's LR schedules, the engine.

The application layer: it may import :mod:`shardkit.parallel`, :mod:`shardkit.kernels` and
:mod:`shardkit.comm`, never the reverse. Nothing here touches ``torch.distributed``: a config is
validated completely before any process group exists. See docs/engine.md for the config keys.
``initialize`` and ``Engine`` (which need torch.distributed) load on first use.

Example:
    >>> from shardkit.engine import load_config
    >>> cfg = load_config("ds_config.json", world_size=2, lr=3e-4, weight_decay=0.0)
    >>> opt = cfg.optimizer.build(model.parameters())
    >>> sched = cfg.scheduler.build(opt)
"""

from typing import Any

from .config_reader import IGNORED_KEYS, UnfilledAutoError, load_config
from .resolved import (
    EngineConfig,
    LossScaleConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    PrecisionConfig,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from .schedulers import SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, make_scheduler

__all__ = [
    "IGNORED_KEYS",
    "SCHEDULERS",
    "EngineConfig",
    "LRRangeTest",
    "LossScaleConfig",
    "OffloadConfig",
    "OneCycle",
    "OptimizerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "UnfilledAutoError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "Engine",
    "initialize",
    "load_config",
    "make_scheduler",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the engine imports shardkit.parallel (torch.distributed); configs do not need it
    if name == "initialize":
        from .entry import initialize

        return initialize
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'shardkit.engine' has no attribute {name!r}")
