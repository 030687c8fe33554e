"""Pipeline parallelism: schedules as data (pure), stage splitting, one P2P executor.

Example:
    >>> from shardkit.parallel.pipeline import PipelineParallel, build_schedule, simulate
    >>> simulate(build_schedule("1f1b", num_ranks=4, microbatches=8)).bubble_fraction
    0.375
    >>> pipe = PipelineParallel(blocks, ctx, schedule="zb-h1", microbatches=8, loss_fn=F.cross_entropy,
    ...                         checkpointing=True)   # head.weight = embed.weight is synchronized
    >>> checkpoint_blocks(model.layers, offload_to_cpu=True)   # without pipelining too
"""

from ..activation_checkpointing import checkpoint_blocks, is_checkpointed
from .executor import PipelineParallel
from .schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Kind,
    Schedule,
    SimResult,
    TimedAction,
    build_schedule,
    in_flight,
    simulate,
)
from .split import measure_block_times, partition, split_blocks
from .tied import find_ties

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Kind",
    "PipelineParallel",
    "Schedule",
    "SimResult",
    "TimedAction",
    "build_schedule",
    "checkpoint_blocks",
    "find_ties",
    "in_flight",
    "is_checkpointed",
    "measure_block_times",
    "partition",
    "simulate",
    "split_blocks",
]
