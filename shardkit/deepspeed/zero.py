"""``deepspeed.zero``: ``Init`` and ``GatheredParameters`` on shardkit's ZeRO-3.

DeepSpeed's ``zero.Init`` partitions each parameter as the model is built. shardkit shards at
``initialize``, when ``ShardedDataParallel(stage=3)`` wraps the model. So ``Init`` here builds
the model as usual, full on every rank, and the config decides the sharding. The difference is
peak host memory while the model is built, not the training.

``GatheredParameters(params, modifier_rank=r)`` gives the full parameters inside the block. With
``modifier_rank``, that rank's values afterwards become every rank's:

* a parameter sharded by ZeRO-3 (after ``initialize``): its units are gathered, and on exit the
  modifier's values are broadcast over the data-parallel group and written into every shard and
  fp32 master (:meth:`shardkit.parallel.ShardedDataParallel.gathered_params`);
* any other parameter (before ``initialize``, or at ZeRO 0-2 without tensor or pipeline
  parallelism): the parameters are full already; on exit the modifier's values are broadcast over
  the world and written through the parameter, so a ZeRO 1-2 wrapper re-reads the fp32 masters
  of what changed at its next step. Under DeepSpeed these parameters would be ZeRO-3 parameters
  built in ``zero.Init``, and its broadcast gives the same result.

Example:
    >>> import shardkit.deepspeed as deepspeed
    >>> with deepspeed.zero.Init(config_dict_or_path=ds_config):
    ...     model = MyModel()
    >>> with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
    ...     if deepspeed.comm.get_rank() == 0:
    ...         model.head.weight.zero_()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GatheredParameters", "Init"]

logger = logging.getLogger("shardkit.deepspeed")


class Init:
    """DeepSpeed's ``zero.Init`` context: the model built inside is an ordinary one, and
    ``shardkit.initialize`` shards it when the config asks for ZeRO-3. Every DeepSpeed argument
    is accepted (``enabled``, ``config_dict_or_path``, ``remote_device``, ``pin_memory``,
    ``dtype``, ...); none changes what is built. The config's precision decides the dtype at
    ``initialize``.

    Example:
        >>> with Init(config_dict_or_path="ds_config.json", enabled=True):
        ...     model = MyModel()                  # full on every rank until initialize
    """

    def __init__(self, module: nn.Module | None = None, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        self.module = module
        self.enabled = enabled

    def __enter__(self) -> Init:
        if self.enabled:
            logger.info("zero.Init: the model is built whole on each rank; ZeRO-3 shards it at initialize")
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters``: ``params`` are full inside the block; with
    ``modifier_rank``, that rank's values afterwards become every rank's (see the module
    docstring). Collective when a ZeRO-3 parameter is named or ``modifier_rank`` is set: every
    rank enters with the same params.

    Args:
        params: a parameter or an iterable of them (their order does not matter; None entries
            and ``params=None`` are skipped).
        modifier_rank: the rank whose writes are kept (a data-parallel rank for ZeRO-3
            parameters, a global rank otherwise), or None (read only: writes are discarded at
            ZeRO-3).
        fwd_module: accepted for DeepSpeed's external-parameter registration; it changes
            nothing here (shardkit's units gather what a forward reads).
        enabled: False makes the block a no-op.

    Raises:
        TypeError: ``params`` holds something that is not a tensor.
        ValueError: ``modifier_rank`` out of range.

    Example:
        >>> with GatheredParameters(list(engine.module.parameters())):
        ...     norm = sum(p.norm() ** 2 for p in engine.module.parameters()) ** 0.5   # full params
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter | None] | None,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if params is None:
            items = []
        else:  # None entries (a Linear without a bias) are skipped, as DeepSpeed skips them
            items = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        bad = [type(p).__name__ for p in items if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"params: tensors (parameters) expected, got {bad[:3]}")
        self.params = items
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._contexts: list[Any] = []

    def _owners(self) -> tuple[list[tuple[Any, list[nn.Parameter]]], list[torch.Tensor]]:
        by_owner: dict[int, tuple[Any, list[nn.Parameter]]] = {}
        plain: list[torch.Tensor] = []
        for p in self.params:
            ref = getattr(p, "_shardkit_zero3", None)
            owner = ref() if ref is not None else None
            if owner is None:
                plain.append(p)
            else:
                by_owner.setdefault(id(owner), (owner, []))[1].append(p)
        return list(by_owner.values()), plain

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        sharded, plain = self._owners()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if plain and self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(f"modifier_rank: a rank in [0, {world}), got {self.modifier_rank}")
        for owner, params in sharded:
            context = owner.gathered_params(params, modifier_rank=self.modifier_rank)
            context.__enter__()
            self._contexts.append(context)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        contexts, self._contexts = self._contexts, []
        for context in reversed(contexts):
            context.__exit__(exc_type, exc, tb)
        if exc_type is not None or self.modifier_rank is None:
            return
        _, plain = self._owners()
        if plain and dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for p in plain:
                    values = p.detach().clone()
                    dist.broadcast(values, src=self.modifier_rank)
                    # written through the parameter itself: its version moves, so a ZeRO 1-2
                    # wrapper re-reads the fp32 masters of what changed (a write to ``p.data``,
                    # the usual one in this block, would not tell it)
                    p.copy_(values)
