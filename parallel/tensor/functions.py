"""The conjugate tensor-parallel operators, as autograd Functions taking the tp group explicitly.

Megatron-LM (Shoeybi et al. 2019, §3; see ``docs/reference.md``, "Tensor parallel") writes a
column-then-row split of a transformer block with two conjugate operators: ``f`` — identity
forward, all-reduce backward (:func:`copy_to_tp_region`) — enters the parallel region, and ``g``
— all-reduce forward, identity backward (:func:`reduce_from_tp_region`) — leaves it. Sequence
parallelism (Korthikanti et al. 2022, §4) replaces ``f`` by an all-gather along the sequence
(backward: reduce-scatter, :func:`gather_from_sequence_region`) and ``g`` by a reduce-scatter
(backward: all-gather, :func:`reduce_scatter_to_sequence_region`): the same bytes on the wire,
while activations outside the matmuls hold ``1/tp`` of the sequence.

Every function takes ``group=`` (``ctx.group("tp")``) and an optional
:class:`~shardkit.comm.CommStats`. On a group of size 1 each returns its input unchanged: no
Function node, no collective. The sequence dimension is ``seq_dim`` (default ``-2``: ``[..., s,
hidden]`` covers both ``[batch, seq, hidden]`` and flattened ``[tokens, hidden]``). Split and
gather follow Megatron's and DTensor ``Shard(dim)``'s convention: rank ``r`` holds the ``r``-th
contiguous chunk.

[Note: only the gradients this backward pass uses]
``ctx.needs_input_grad`` is fixed when the forward runs: it says which inputs *can* take a
gradient, not which ones the running backward pass asks for. Autograd's own nodes compute only
the outputs the running pass uses, so a backward split into an input pass and a weight pass
(ZB-H1's BI and W, :mod:`~shardkit.parallel.pipeline.backward`) runs each half of a matmul's
backward once. A Function computing several gradients in one node must ask the engine itself,
or each pass computes both halves: :func:`wanted_input_grads` does (for the column-parallel
linear: BI computes ``dX`` and its all-reduce / reduce-scatter, W ``dW`` and ``db`` from the
saved input and the gradient BI captured, with no collective). Outside a split pass it returns
``ctx.needs_input_grad``: a plain backward computes every gradient, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardkit.comm import CommStats, all_gather, all_reduce, reduce_scatter

__all__ = [
    "wanted_input_grads",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sequence_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "split_along",
    "gather_along",
    "reduce_scatter_along",
]


def wanted_input_grads(ctx: Any, is_tensor: Sequence[bool]) -> tuple[bool, ...]:
    """Which inputs of a custom Function the running backward pass uses, called in ``backward``.

    See [Note: only the gradients this backward pass uses].

    Args:
        ctx: the Function's ``ctx`` in ``backward`` (the autograd node itself).
        is_tensor: per forward argument, whether it was a tensor (``ctx.next_functions`` holds
            one edge per tensor argument only, so a ``None`` bias shifts the others).

    Returns:
        One bool per forward argument: ``ctx.needs_input_grad[i]`` and the engine consumes that
        gradient in this pass (its next node runs, or it is an input the pass returns).

    Example:
        >>> need_x, need_w, need_b = wanted_input_grads(ctx, (True, True, ctx.has_bias, False))[:3]
    """
    edges = iter(ctx.next_functions)
    wanted = []
    for needs, tensor in zip(ctx.needs_input_grad, is_tensor, strict=True):
        node = next(edges)[0] if tensor else None
        if not needs or node is None:
            wanted.append(False)
            continue
        try:
            wanted.append(bool(torch._C._will_engine_execute_node(node)))
        except RuntimeError:
            # raised only for a leaf that torch.autograd.grad returns (it is captured, not
            # executed): that gradient is wanted
            wanted.append(True)
    return tuple(wanted)


def split_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a contiguous copy; local, no comm).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size.
    """
    n = group.size()
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tp size {n}")
    return x.chunk(n, dim)[group.rank()].contiguous()


def gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup, stats: CommStats | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (one all-gather)."""
    n = group.size()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    all_gather(out, x.contiguous(), group=group, stats=stats)
    return torch.cat(out.unbind(0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup, stats: CommStats | None = None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim`` (one reduce-scatter)."""
    n = group.size()
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tp size {n}")
    stacked = torch.stack(x.chunk(n, dim), 0).contiguous()  # rank r's chunk is row r of the flat input
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter(out, stacked, group=group, stats=stats)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        all_reduce(grad, group=ctx.group, stats=ctx.stats)
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, inplace: bool) -> torch.Tensor:
        # In place only when the caller vouches that nothing else reads ``x`` (the layers' own
        # fresh partial products: F.linear without bias and masked_fill save their inputs, not
        # their output). Otherwise a copy is needed: ``x`` may be the caller's tensor, a leaf
        # requiring grad (autograd forbids writing it), or saved by the op that produced it for
        # its backward (e.g. exp, sigmoid: the write would fail that backward's version check).
        # A non-contiguous input (a view) is copied either way: the collective needs one buffer.
        if inplace and x.is_contiguous() and x._base is None and not (x.is_leaf and x.requires_grad):
            ctx.mark_dirty(x)  # tell autograd x now holds the sum (bumps its version)
            all_reduce(x, group=group, stats=stats)
            return x
        out = x.contiguous() if not x.is_contiguous() else x.clone()
        all_reduce(out, group=group, stats=stats)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None, None


class _Scatter(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return gather_along(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: this rank's chunk (``reduce`` = False) or the
    reduce-scatter of the gradient (``reduce`` = True, the sequence-parallel ``f``)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, stats: CommStats | None, reduce: bool
    ) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.stats, ctx.reduce = dim, group, stats, reduce
        return gather_along(x, dim, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.reduce:
            return reduce_scatter_along(grad, ctx.dim, ctx.group, ctx.stats), None, None, None, None
        return split_along(grad, ctx.dim, ctx.group), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return reduce_scatter_along(x, dim, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return gather_along(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-D input of shape {tuple(x.shape)}")
    return dim % x.dim()


def copy_to_tp_region(x: torch.Tensor, *, group: dist.ProcessGroup, stats: CommStats | None = None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward.

    Use it where a replicated activation (or parameter) enters computation that each tp rank
    does on its own shard; the partial gradients of the ranks are summed.

    Args:
        x: any shape and dtype, replicated over ``group``.
        group: the tp process group (``ctx.group("tp")``).
        stats: optional CommStats for the backward all-reduce.

    Returns:
        ``x`` (a view; ``x`` itself when the group has one rank).

    Example:
        >>> h = copy_to_tp_region(x, group=ctx.group("tp"))
        >>> y_shard = h @ w_shard.t()
    """
    return x if group.size() == 1 else _CopyToTP.apply(x, group, stats)


def reduce_from_tp_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, stats: CommStats | None = None, inplace: bool = False
) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward.

    Args:
        x: this rank's partial result, same shape on every rank of ``group``.
        group, stats: as for :func:`copy_to_tp_region`.
        inplace: sum into ``x`` itself instead of a copy (saves one activation-sized copy). Only
            for a temporary nothing else reads: not a leaf, not a view, not saved for backward
            by the op that produced it (``F.linear``'s output qualifies). Leaves and views are
            copied regardless.

    Returns:
        The sum over the group: a new tensor, or ``x`` (summed) with ``inplace`` or one rank.

    Example:
        >>> y = reduce_from_tp_region(x_shard @ w_shard.t(), group=ctx.group("tp"), inplace=True)
    """
    return x if group.size() == 1 else _ReduceFromTP.apply(x, group, stats, inplace)


def scatter_to_tp_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, dim: int = -1, stats: CommStats | None = None
) -> torch.Tensor:
    """Keep this rank's chunk of the last dim (``dim``) forward; all-gather the gradient backward.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the tp size (before any collective).

    Example:
        >>> x_shard = scatter_to_tp_region(x, group=ctx.group("tp"))   # [..., h] -> [..., h/tp]
    """
    if group.size() == 1:
        return x
    dim = _dim(x, dim)
    if x.shape[dim] % group.size():
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tp size {group.size()}")
    return _Scatter.apply(x, dim, group, stats)


def gather_from_tp_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, dim: int = -1, stats: CommStats | None = None
) -> torch.Tensor:
    """All-gather the last dim (``dim``) forward; keep this rank's chunk of the gradient backward.

    Example:
        >>> y = gather_from_tp_region(y_shard, group=ctx.group("tp"))   # [..., o/tp] -> [..., o]
    """
    return x if group.size() == 1 else _Gather.apply(x, _dim(x, dim), group, stats, False)


def scatter_to_sequence_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, seq_dim: int = -2, stats: CommStats | None = None
) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's sequence chunk; all-gather backward.

    Raises:
        ValueError: the sequence length is not divisible by the tp size (before any collective).

    Example:
        >>> x_seq = scatter_to_sequence_region(x, group=ctx.group("tp"))   # [b, s, h] -> [b, s/tp, h]
    """
    return scatter_to_tp_region(x, group=group, dim=seq_dim, stats=stats)


def gather_from_sequence_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, seq_dim: int = -2, stats: CommStats | None = None
) -> torch.Tensor:
    """Sequence-parallel ``f``: all-gather the sequence forward, reduce-scatter the gradient backward.

    Example:
        >>> x_full = gather_from_sequence_region(x_seq, group=ctx.group("tp"))   # [b, s/tp, h] -> [b, s, h]
    """
    return x if group.size() == 1 else _Gather.apply(x, _dim(x, seq_dim), group, stats, True)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, *, group: dist.ProcessGroup, seq_dim: int = -2, stats: CommStats | None = None
) -> torch.Tensor:
    """Sequence-parallel ``g``: reduce-scatter along the sequence forward, all-gather backward.

    Raises:
        ValueError: the sequence length is not divisible by the tp size (before any collective).

    Example:
        >>> y_seq = reduce_scatter_to_sequence_region(partial, group=ctx.group("tp"))   # [b, s, h] -> [b, s/tp, h]
    """
    if group.size() == 1:
        return x
    dim = _dim(x, seq_dim)
    if x.shape[dim] % group.size():
        raise ValueError(f"sequence dimension {dim} of size {x.shape[dim]} is not divisible by the tp size {group.size()}")
    return _ReduceScatter.apply(x, dim, group, stats)
