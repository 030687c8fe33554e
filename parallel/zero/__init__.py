"""Sharded data parallelism (ZeRO stages 1, 2 and 3) and the ZeRO memory planner.

:class:`ShardedDataParallel` and :class:`ZeroOptimizer` run the stages; :func:`plan_memory`,
:func:`plan_table` and :class:`MemoryPlan` predict their bytes per rank without allocating
(docs/planner.md).

Example:
    >>> from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer, plan_memory
    >>> sdp = ShardedDataParallel(model, ctx, stage=2)
    >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4)
    >>> plan_memory(model, dp=ctx.size("dp"), stage=2).memory_report()  # vs sdp.memory_report()
"""

from .flat_shards import paper_comm_bytes
from .optimizer import ZeroOptimizer
from .planner import MemoryPlan, plan_memory, plan_table
from .sharded import ShardedDataParallel
from .zero_strategies import Zero1Strategy, Zero2Strategy, Zero3Strategy

__all__ = [
    "MemoryPlan",
    "ShardedDataParallel",
    "Zero1Strategy",
    "Zero2Strategy",
    "Zero3Strategy",
    "ZeroOptimizer",
    "paper_comm_bytes",
    "plan_memory",
    "plan_table",
]
