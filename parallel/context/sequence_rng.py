"""Dropout on sequence shards: a random stream per cp rank.

[Note: dropout under context parallelism]
Every cp rank runs the same program from the same seed, so a dropout draws the same mask on
every rank: token ``i`` of rank 0's shard and token ``i`` of rank 1's shard would lose the same
features, and under Ulysses head group 0 and head group 1 the same attention weights. The dense
model draws one mask over all tokens and heads; a mask repeated across the shards of one
sequence is correlated dropout, not that model's (the same fault [Note: tensor-parallel RNG
streams] in :mod:`shardkit.parallel.tensor.rng` describes for sequence shards under tp).

So each random op on the shards draws from this rank's own stream: :func:`cp_rng_region`
(a :func:`~shardkit.parallel.tensor.rng.tp_rng_region` salted by the cp rank, begun sharded)
draws one number from the stream every rank shares, seeds the default generators with a mix of
it and the cp rank, and restores the shared stream, one draw further, on exit. Under cp every
activation is a shard (tokens, or Ulysses' heads), so :func:`context_parallelize` puts every
``nn.Dropout`` of the model in such a region while it trains (:func:`add_cp_dropout_hooks`),
and Ulysses attention draws its attention dropout in one. Activation checkpointing needs
nothing: a recomputed segment starts from the generator states saved at its start and derives
the same streams. Inside a TP region the stream is derived from the current TP stream, so ranks
that differ in tp or in cp draw apart and ranks that hold the same shard draw alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardkit.parallel.tensor.rng import tp_rng_region

__all__ = ["add_cp_dropout_hooks", "cp_rng_region"]


@contextlib.contextmanager
def cp_rng_region(group: dist.ProcessGroup, *, enabled: bool = True) -> Iterator[None]:
    """Random ops inside draw from this cp rank's own stream (see [Note: dropout under context
    parallelism]); a no-op on a group of one rank or with ``enabled=False``.

    Args:
        group: the cp process group (``ctx.group("cp")``).
        enabled: ``False`` makes the region a no-op (eval mode).

    Example:
        >>> with cp_rng_region(ctx.group("cp")):
        ...     h = F.dropout(h, 0.1)          # [B, S/cp, d]: this rank's tokens, its own mask
    """
    with tp_rng_region(group=group, sharded=True, enabled=enabled):
        yield


def add_cp_dropout_hooks(model: nn.Module, group: dist.ProcessGroup) -> list[RemovableHandle]:
    """Run every dropout module of ``model`` (``nn.Dropout`` and its kin) in a
    :func:`cp_rng_region` while it trains with ``p > 0``.

    Args:
        model: the model whose activations are sequence shards.
        group: the cp process group.

    Returns:
        The hook handles (``handle.remove()`` undoes them).

    Example:
        >>> handles = add_cp_dropout_hooks(model, ctx.group("cp"))   # done by context_parallelize
    """
    handles: list[RemovableHandle] = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            handles += _region_hooks(module, group)
    return handles


def _region_hooks(module: nn.modules.dropout._DropoutNd, group: dist.ProcessGroup) -> list[RemovableHandle]:
    open_regions: list[contextlib.ExitStack] = []

    def enter(mod: nn.Module, args: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(cp_rng_region(group, enabled=mod.training and module.p > 0))
        open_regions.append(stack)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        if open_regions:  # absent only if enter itself failed
            open_regions.pop().close()

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
