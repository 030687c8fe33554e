"""``deepspeed.comm`` as DeepSpeed scripts use it: rank queries and a few collectives, passed to
``torch.distributed`` (shardkit's own collectives, with accounting and named groups, are
:mod:`shardkit.comm`).

Example:
    >>> from shardkit.deepspeed import comm as dist
    >>> if dist.get_rank() == 0:
    ...     print(f"{dist.get_world_size()} ranks")
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_initialized",
]


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 before any process group exists."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the world); 1 before any process group exists."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its machine (torchrun's ``LOCAL_RANK``; 0 without it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    """Wait for every rank of ``group``."""
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``tensor`` in place over ``group`` (``torch.distributed.all_reduce``)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Copy rank ``src``'s ``tensor`` to every rank of ``group`` (``torch.distributed.broadcast``)."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``tensor`` into ``tensor_list`` (``torch.distributed.all_gather``).

    Example:
        >>> out = [torch.zeros(2) for _ in range(get_world_size())]
        >>> all_gather(out, torch.ones(2))
    """
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
