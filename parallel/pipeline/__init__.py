"""Pipeline parallelism: schedules as data (pure), stage splitting, one P2P executor.

Example:
    >>> from shardkit.parallel.pipeline import build_schedule, simulate
    >>> simulate(build_schedule("1f1b", num_ranks=4, microbatches=8)).bubble_fraction
    0.375
"""

from .schedules import SCHEDULES, Action, DeadlockError, Kind, Schedule, SimResult, TimedAction, build_schedule, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Kind",
    "Schedule",
    "SimResult",
    "TimedAction",
    "build_schedule",
    "simulate",
]
