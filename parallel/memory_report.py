"""What one rank of replicated training holds, in bytes: the one memory report of every layout
that does not shard its model state (one process, DDP, tensor and pipeline parallelism).

ZeRO's :meth:`~shardkit.parallel.zero.ShardedDataParallel.memory_report` reports its shards with
the same keys, so a loop, the engine and the benchmarks read either the same way. Bytes are
counted per distinct storage: a gradient that is a view of a flat bucket, and the bucket, count
once; fp32 masters kept by a fused optimizer (``state["master_param"]``) are their own category.

Example:
    >>> from shardkit.parallel.memory_report import replicated_memory_report, storage_bytes
    >>> mem = replicated_memory_report(model.parameters(), optimizer)
    >>> mem["model_state"] == mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_state"]
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["replicated_memory_report", "storage_bytes"]


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard).

    Views of one flat buffer count once, so a flat bucket and the params viewing it are the
    same bytes. Non-tensors and None are ignored.

    Example:
        >>> flat = torch.zeros(10)
        >>> storage_bytes([flat[:4], flat[4:], None])
        40
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = getattr(t, "_local_tensor", t)  # DTensor -> this rank's shard
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def replicated_memory_report(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    grad_buffers: Iterable[torch.Tensor] = (),
) -> dict[str, Any]:
    """This rank's model-state bytes when every rank holds its params, grads and optimizer state.

    Args:
        params: the parameters this rank trains (its TP shards, its pipeline stages).
        optimizer: the optimizer stepping them (its ``state`` tensors are counted), or None.
        grad_buffers: gradient storage besides ``p.grad`` (flat communication buckets).

    Returns:
        ``{"unit": "bytes", "params", "grads", "master_params", "optimizer_state", "model_state",
        "peak_transient": 0, "offloaded": {}}``: the keys of
        :meth:`~shardkit.parallel.zero.ShardedDataParallel.memory_report`; ``model_state`` is the
        sum of the four categories.

    Example:
        >>> replicated_memory_report([torch.nn.Parameter(torch.zeros(3))])["params"]
        12
    """
    params = list(params)
    states = list(optimizer.state.values()) if optimizer is not None else []
    masters = [s["master_param"] for s in states if "master_param" in s]
    mem = {
        "params": storage_bytes(params),
        "grads": storage_bytes([p.grad for p in params] + list(grad_buffers)),
        "master_params": storage_bytes(masters),
        "optimizer_state": storage_bytes(v for s in states for k, v in s.items() if k != "master_param"),
    }
    return {"unit": "bytes", **mem, "model_state": sum(mem.values()), "peak_transient": 0, "offloaded": {}}
