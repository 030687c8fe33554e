"""The demo trainer behind ``shardkit train``, in four parts.

* :mod:`~shardkit.train.config` — :class:`TrainConfig`, whose fields define the CLI flags.
* :mod:`~shardkit.train.schedule` — :func:`lr_at`, warmup + cosine.
* :mod:`~shardkit.train.progress` — :class:`ProgressBar` and the summary formatters.
* :mod:`~shardkit.train.loop` — :func:`train`, one rank of a run, written against the
  strategy interface of :mod:`shardkit.parallel.strategy`.

Example:
    >>> from shardkit.train import TrainConfig, train
    >>> result = train(TrainConfig(steps=20, d_model=64, n_layers=2, device="cpu"))
"""

from .config import TrainConfig
from .loop import TrainResult, make_loss_scaler, resolve_device, train
from .progress import ProgressBar
from .schedule import lr_at

__all__ = ["ProgressBar", "TrainConfig", "TrainResult", "lr_at", "make_loss_scaler", "resolve_device", "train"]
