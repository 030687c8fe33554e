"""``deepspeed.checkpointing``: activation checkpointing as DeepSpeed scripts call it.

``checkpoint(function, *args)`` recomputes ``function`` in the backward pass instead of keeping
its activations: ``torch.utils.checkpoint.checkpoint`` (non-reentrant), which restores the CPU and
CUDA random states for the recomputation, so dropout draws the same masks (and under tensor
parallelism shardkit's derived streams follow: [Note: tensor-parallel RNG streams] in
shardkit/parallel/tensor/rng.py). ``configure`` accepts DeepSpeed's options; the ones that change
where activations live (``partition_activations``, ``checkpoint_in_cpu``,
``contiguous_checkpointing``) are refused by name: shardkit offers keeping block inputs on the
CPU through ``checkpoint_blocks(..., offload_to_cpu=True)`` instead.

Example:
    >>> import shardkit.deepspeed as deepspeed
    >>> deepspeed.checkpointing.configure(None, num_checkpoints=4)
    >>> hidden = deepspeed.checkpointing.checkpoint(block, hidden)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_REFUSED = {
    "partition_activations": "activations split over tensor-parallel ranks",
    "checkpoint_in_cpu": "checkpointed activations kept on the CPU (use shardkit.parallel.checkpoint_blocks(..., offload_to_cpu=True))",
    "contiguous_checkpointing": "checkpointed activations copied into one buffer",
}


class _Settings:
    """What :func:`configure` was told (per process, as DeepSpeed's module state)."""

    configured = False


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Accept DeepSpeed's activation-checkpointing settings (``mpu_``, ``num_checkpoints``,
    ``synchronize``, ``profile`` have no effect here).

    Raises:
        NotImplementedError: ``partition_activations``, ``checkpoint_in_cpu`` or
            ``contiguous_checkpointing`` set to True, naming it.
    """
    for name, value in (
        ("partition_activations", partition_activations),
        ("checkpoint_in_cpu", checkpoint_in_cpu),
        ("contiguous_checkpointing", contiguous_checkpointing),
    ):
        if value:
            raise NotImplementedError(f"deepspeed.checkpointing.configure({name}=True): {_REFUSED[name]} is not offered")
    _Settings.configured = True


def is_configured() -> bool:
    """Whether :func:`configure` was called (and not :func:`reset` since)."""
    return _Settings.configured


def reset() -> None:
    """Forget :func:`configure` (DeepSpeed's ``reset`` also drops buffers; there are none here)."""
    _Settings.configured = False


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in the backward pass (random state restored).

    Example:
        >>> y = checkpoint(block, x)
        >>> y.sum().backward()       # block's forward runs again here
    """
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
