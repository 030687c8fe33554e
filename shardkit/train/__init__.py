"""The demo trainer behind ``shardkit train``.

* :mod:`~shardkit.train.config` — :class:`TrainConfig`, whose fields define the CLI flags.
* :mod:`~shardkit.train.schedule` — :func:`lr_at`, warmup + cosine.
* :mod:`~shardkit.train.progress` — :class:`ProgressBar` and the summary formatters.
* :mod:`~shardkit.train.device` — :func:`resolve_device`, which device a rank trains on.
* :mod:`~shardkit.train.loop` — :func:`train`, one rank of a run, written against the
  strategy interface of :mod:`shardkit.parallel.strategy`.
* :mod:`~shardkit.train.run_checkpoints` — ``--ckpt-dir``/``--resume auto``: what a run saves and
  how a restart continues it.
* :mod:`~shardkit.train.worker_logs`, :mod:`~shardkit.train.fault_injection` and
  :mod:`~shardkit.train.process_lifetime` — the failure report that names the rank that failed
  first, ``--inject-fault`` drills, and no orphaned workers.

Example:
    >>> from shardkit.train import TrainConfig, train
    >>> result = train(TrainConfig(steps=20, d_model=64, n_layers=2, device="cpu"))
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import TrainConfig
from .device import resolve_device
from .schedule import lr_at

__all__ = ["ProgressBar", "TrainConfig", "TrainResult", "lr_at", "make_loss_scaler", "resolve_device", "train"]

# The loop and the progress bar import torch (the loop all of shardkit: seconds): loaded on first
# use, so that the `shardkit train --nproc N` launcher starts its workers without them.
_LAZY = {"TrainResult": ".loop", "make_loss_scaler": ".loop", "train": ".loop", "ProgressBar": ".progress"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
