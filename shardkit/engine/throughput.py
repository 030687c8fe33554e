"""``engine.tput_timer`` and ``engine.monitor``: the progress objects DeepSpeed scripts read.

``ThroughputTimer`` follows DeepSpeed's: each micro-step is timed from the engine's forward to
its ``step`` (data loading between steps is not counted). The first ``start_step`` optimizer steps
are warm-up and not counted. ``avg_samples_per_sec()`` is the global batch divided by the mean
timed step. ``Monitor`` is the ``engine.monitor`` a script calls ``write_events`` on. The config's
``tensorboard`` / ``wandb`` / ``csv_monitor`` sections are read and ignored (docs/engine.md), so
``enabled`` is False and events are logged at debug level only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Monitor", "ThroughputTimer"]

logger = logging.getLogger("shardkit.engine")


class ThroughputTimer:
    """Samples per second of training, timed over the steps after the first ``start_step``.

    Args:
        batch_size: samples per optimizer step over all data-parallel ranks.
        start_step: optimizer steps not timed (warm-up), DeepSpeed's default 2.
        steps_per_output: log the running average every this many optimizer steps (None: never).

    Example:
        >>> timer = ThroughputTimer(batch_size=32)
        >>> for _ in range(5):
        ...     timer.start(); train_one_step(); timer.stop(global_step=True)
        >>> timer.avg_samples_per_sec()         # 32 / mean seconds of steps 3-5
    """

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0

    def update_epoch_count(self) -> None:
        """Count an epoch (DeepSpeed's loaders call it at each new pass over the data)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin timing a micro-step (a no-op while one is already timed, or during warm-up)."""
        if self.started:
            return
        self.started = True
        self.start_time = time.perf_counter() if self.global_step_count >= self.start_step else 0.0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step begun by :meth:`start`; ``global_step``: it ended an optimizer step."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if self.start_time > 0:
            elapsed = time.perf_counter() - self.start_time
            self.total_elapsed_time += elapsed
            self.step_elapsed_time += elapsed
        if not global_step:
            return
        self.global_step_count += 1
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            logger.info(
                "epoch=%d/micro_step=%d/global_step=%d, RunningAvgSamplesPerSec=%.3f, CurrSamplesPerSec=%.3f",
                self.epoch_count,
                self.micro_step_count,
                self.global_step_count,
                self.avg_samples_per_sec(),
                self.batch_size / max(self.step_elapsed_time, 1e-9),
            )
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` / the mean timed optimizer step; ``-inf`` before a step was timed
        (DeepSpeed returns ``-inf`` before the first step)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)


class Monitor:
    """``engine.monitor``: ``enabled`` is False (the monitor backends are not offered) and
    :meth:`write_events` logs at debug level.

    Example:
        >>> if engine.monitor.enabled:
        ...     engine.monitor.write_events([("Train/loss", loss.item(), engine.global_samples)])
    """

    enabled = False

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        """Log ``(name, value, step)`` events at debug level."""
        for name, value, step in event_list:
            logger.debug("monitor event %s=%s at step %s", name, value, step)
