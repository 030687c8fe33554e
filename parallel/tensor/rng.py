"""Dropout under tensor parallelism: random streams that follow the tp layout.

[Note: tensor-parallel RNG streams]
Every tp rank runs the same program from the same seed, so a random op draws the same numbers on
every rank. That is right where an activation is *replicated* over tp (the residual stream
between a row-parallel layer's all-reduce and the next column-parallel layer): the ranks must
drop the same elements or their replicas diverge. It is wrong where each rank holds a different
*shard*: the attention probabilities of its heads (between the column-parallel QKV and the
row-parallel output projection), the MLP's hidden features, and every activation on sequence
shards under sequence parallelism. There the same draws give head ``j`` and head ``j + h/tp`` the
same mask, and every sequence chunk the same pattern: correlated dropout, not the dense model's.

A *region* (:func:`tp_rng_region`) makes random ops follow the layout. Inside one, each TP layer
switches the default generators (CPU, and the current CUDA device's once CUDA is initialized)
after computing its output (:func:`set_tp_rng_stream`): to this rank's *sharded stream* after a
layer whose output is sharded (ColumnParallelLinear without ``gather_output``; RowParallelLinear
and VocabParallelEmbedding with ``sequence_parallel``; the vocab-parallel LM head;
ScatterSequence), back to the *replicated stream* after one whose output is replicated. Leaving
the region returns to the replicated stream. :func:`~shardkit.parallel.tensor.tensor_parallelize`
puts a region in every module that directly holds a column- or row-parallel layer (attention,
MLP: :func:`add_tp_rng_region_`).

The sharded stream is derived, not kept: entering it draws one number ``s`` from the replicated
CPU stream (the same draw on every rank, so the replicated streams stay equal) and seeds the
generators with ``splitmix64(s, tp_rank)``, saving the replicated states to restore on the way
back. Megatron-Core keeps one persistent state per rank instead (``CudaRNGStatesTracker``), which
activation checkpointing must save and restore itself (Megatron's ``CheckpointFunction``). A
stream derived from the replicated state needs nothing: every checkpoint implementation
(``torch.utils.checkpoint``, reentrant or not; ``checkpoint_blocks``; HF's gradient
checkpointing) restores the CPU and CUDA generator states at the start of the segment it
recomputes, and the recomputation derives the same sharded streams from them. Cost per switch
into the sharded stream and back: the CPU generator's state (5 KB) copied twice, one draw, one
reseed; nothing in eval mode (a module's region is entered in training mode only).

A region begins and ends within one call (:func:`add_tp_rng_region_` opens it inside the module's
``forward``), so a checkpointed segment holds whole regions or lies inside one, and a switch made
outside every region is a no-op: nothing leaks past a forward pass or an exception. Limit: a
checkpointed segment that holds a TP layer but starts inside that layer's region (e.g. only
``attn.proj`` and the dropout after it, checkpointed from inside the attention module) is
recomputed outside the region and draws another mask; checkpoint whole blocks, attention or MLP
modules, or a core-attention function without TP layers in it. The CPU generator (mt19937) keeps
32 bits of a seed, so two derived CPU streams coincide with probability 2^-32; CUDA's Philox keeps
all 64.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import ParallelContext

__all__ = ["add_tp_rng_region_", "set_tp_rng_stream", "tp_rng_region"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int, salt: int) -> int:
    """A 63-bit seed from ``x`` and ``salt`` (Steele et al.'s SplitMix64 finalizer): distinct
    salts give unrelated seeds even for neighbouring ``x``."""
    z = (x + (salt + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class _Region:
    __slots__ = ("rank", "saved")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # the replicated states while in the sharded stream: (cpu, cuda generator, cuda state)
        self.saved: tuple[torch.Tensor, torch.Generator | None, torch.Tensor | None] | None = None


# The open regions of this thread, innermost last. Process-wide like the default generators
# they switch (per thread: a region opens and closes within one forward call on one thread).
_local = threading.local()


def _regions() -> list[_Region]:
    stack = getattr(_local, "regions", None)
    if stack is None:
        stack = _local.regions = []
    return stack


def _cuda_generator() -> torch.Generator | None:
    # only once CUDA is in use: asking for a generator would initialize CUDA in a CPU-only job
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.default_generators[torch.cuda.current_device()]
    return None


def _to_sharded(region: _Region) -> None:
    if region.saved is not None:  # already there: keep drawing from the same stream
        return
    s = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))  # the replicated CPU stream: same on every rank
    cuda = _cuda_generator()
    region.saved = (torch.default_generator.get_state(), cuda, None if cuda is None else cuda.get_state())
    seed = _splitmix64(s, region.rank)
    torch.default_generator.manual_seed(seed)
    if cuda is not None:
        cuda.manual_seed(seed)


def _to_replicated(region: _Region) -> None:
    if region.saved is None:
        return
    cpu, cuda, cuda_state = region.saved
    torch.default_generator.set_state(cpu)
    if cuda is not None:
        cuda.set_state(cuda_state)
    region.saved = None


@contextlib.contextmanager
def tp_rng_region(*, group: dist.ProcessGroup, sharded: bool = False, enabled: bool = True) -> Iterator[None]:
    """A region whose random ops follow the tp layout (see [Note: tensor-parallel RNG streams]).

    Inside, the default generators draw from this rank's own stream while the activations are
    sharded and from the stream shared by all tp ranks while they are replicated; the TP layers
    called inside switch between the two (:func:`set_tp_rng_stream`). On exit the replicated
    stream resumes, one draw further than where it was. With ``sharded=True`` and no TP layer
    inside it is Megatron's ``get_cuda_rng_tracker().fork()``, on CPU too, and needs no special
    activation checkpointing. Regions nest: an inner region's replicated stream is whatever
    stream was current when it began.

    Args:
        group: the tp process group (``ctx.group("tp")``); its rank salts the sharded stream.
            A group of one rank makes the region a no-op (the dense model's draws).
        sharded: begin in the sharded stream (the code inside starts on sharded activations,
            e.g. sequence shards); default: begin replicated.
        enabled: ``False`` makes the region a no-op (e.g. ``module.training`` is False: eval
            mode has no dropout to place).

    Example:
        >>> with tp_rng_region(group=ctx.group("tp"), sharded=True):
        ...     probs = F.dropout(probs, 0.1)      # [b, heads/tp, s, s]: this rank's heads, its own mask
        >>> h = F.dropout(h, 0.1)                  # replicated [b, s, d]: the same mask on every rank
    """
    if not enabled or group.size() == 1:
        yield
        return
    region = _Region(group.rank())
    stack = _regions()
    stack.append(region)
    try:
        if sharded:
            _to_sharded(region)
        yield
    finally:
        _to_replicated(region)
        stack.remove(region)


def set_tp_rng_stream(*, sharded: bool) -> None:
    """Switch the innermost :func:`tp_rng_region` to the stream of an activation's layout.

    The TP layers call it after computing their output (``sharded``: the output differs across
    tp ranks); a custom TP layer should too. Outside every region it does nothing.

    Args:
        sharded: ``True`` for this rank's own stream, ``False`` for the stream shared by the tp
            ranks.

    Example:
        >>> y = my_column_parallel_op(x)           # [..., out/tp]
        >>> set_tp_rng_stream(sharded=True)        # dropout on y: a mask per rank
    """
    stack = getattr(_local, "regions", None)
    if not stack:
        return
    if sharded:
        _to_sharded(stack[-1])
    else:
        _to_replicated(stack[-1])


class _TPRNGRegionModule:
    """Mixed into a module's class by :func:`add_tp_rng_region_`: its own ``forward`` runs in a
    :func:`tp_rng_region` (inside ``forward``, so a checkpoint of the module recomputes it)."""

    _tp_rng_group: dist.ProcessGroup
    _tp_rng_sharded_input: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        region = tp_rng_region(group=self._tp_rng_group, sharded=self._tp_rng_sharded_input, enabled=self.training)
        with region:
            return super().forward(*args, **kwargs)


@functools.cache
def _region_class(cls: type) -> type:
    # one subclass per class, not per instance: a model's 48 attention modules share it
    return type(f"TPRNGRegion{cls.__name__}", (_TPRNGRegionModule, cls), {})


def add_tp_rng_region_(module: nn.Module, *, ctx: ParallelContext, sharded_input: bool = False) -> nn.Module:
    """Run ``module``'s forward in a :func:`tp_rng_region` (training mode only), in place.

    The module's class is swapped for a subclass (FSDP2's trick, as ``make_sequence_parallel_``):
    parameter names, ``state_dict`` keys, hooks and ``isinstance`` checks are unchanged.
    ``tensor_parallelize`` calls it on every module that directly holds a column- or
    row-parallel layer; call it yourself on a module with dropout on sharded activations and no
    TP layer of its own (e.g. a block under sequence parallelism with dropout outside its
    attention and MLP). Calling it again updates ``sharded_input``.

    Args:
        module: the module (modified in place).
        ctx: the parallel context (the tp group).
        sharded_input: the module's input is sharded over tp (sequence shards under sequence
            parallelism), so its random ops start in the sharded stream.

    Returns:
        ``module``.

    Example:
        >>> add_tp_rng_region_(block.attn, ctx=ctx)                  # done by tensor_parallelize
        >>> add_tp_rng_region_(block, ctx=ctx, sharded_input=True)   # SP: the block's own dropout
    """
    if not isinstance(module, _TPRNGRegionModule):
        module.__class__ = _region_class(type(module))
    module._tp_rng_group = ctx.group("tp")
    module._tp_rng_sharded_input = bool(sharded_input)
    return module
