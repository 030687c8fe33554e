"""The DeepSpeed-config layer of shardkit: config parsing and DeepSpeed's LR schedules.

The application layer: it may import :mod:`shardkit.parallel`, :mod:`shardkit.kernels` and
:mod:`shardkit.comm`, never the reverse. Nothing here touches ``torch.distributed``: a config is
validated completely before any process group exists.

Example:
    >>> from shardkit.engine import WarmupDecayLR, load_config
    >>> cfg = load_config("ds_config.json", world_size=2, lr=3e-4, weight_decay=0.0)
    >>> sched = WarmupDecayLR(optimizer, **cfg.scheduler.params)
"""

from .schedulers import SCHEDULERS, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, make_scheduler

__all__ = ["SCHEDULERS", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "make_scheduler"]
