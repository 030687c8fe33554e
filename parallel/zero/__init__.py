"""Sharded data parallelism (ZeRO stages 1 and 2): :class:`ShardedDataParallel`, :class:`ZeroOptimizer`.

Example:
    >>> from shardkit.parallel.zero import ShardedDataParallel, ZeroOptimizer
    >>> sdp = ShardedDataParallel(model, ctx, stage=2)
    >>> opt = ZeroOptimizer(sdp, FusedAdamW, lr=3e-4)
"""

from .flat_shards import paper_comm_bytes
from .optimizer import ZeroOptimizer
from .sharded import ShardedDataParallel

__all__ = ["ShardedDataParallel", "ZeroOptimizer", "paper_comm_bytes"]
