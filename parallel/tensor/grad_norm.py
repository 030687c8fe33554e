"""Gradient-norm clipping over tensor-parallel parameters.

With tensor parallelism a rank holds slices of the split parameters and full copies of the
replicated ones (LayerNorms, row-parallel biases, position embeddings). The global norm is

    ‖g‖² = Σ_r Σ_{sharded p on r} ‖g_p‖² + Σ_{replicated p} ‖g_p‖²

so each rank adds its sharded squares and ``1/tp`` of its replicated squares, and one all-reduce
of that fp32 scalar over tp gives every rank the same ``‖g‖²`` (the replicated gradients are
identical on every tp rank — the TP layers and ``SequenceParallelNorm`` make them so). Summing
everything over tp instead would count each replicated parameter ``tp`` times.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardkit.comm import CommStats, ParallelContext, all_reduce
from shardkit.kernels.grad_epilogue import clip_grads_, unscale_and_norm_
from shardkit.kernels.runtime import Backend

from .layers import is_tp_sharded

__all__ = ["clip_grad_norm_tp_"]


def _by_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    return list(groups.values())


def clip_grad_norm_tp_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    ctx: ParallelContext,
    backend: Backend = "auto",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Clip by the global L2 norm of a tensor-parallel model's gradients (see the module docstring).

    Equals ``torch.nn.utils.clip_grad_norm_`` on the dense model: same norm, same coefficient
    ``min(1, max_norm / (norm + 1e-6))``, applied to every local gradient. No host sync.

    Args:
        parameters: this rank's parameters (split ones marked by the TP layers, see
            :func:`~shardkit.parallel.tensor.layers.is_tp_sharded`); those without a grad are
            skipped. Call on every tp rank.
        max_norm: the largest allowed global norm (> 0).
        ctx: the parallel context; one 4-byte all-reduce over ``ctx.group("tp")``.
        backend: kernel backend.
        stats: optional CommStats for the all-reduce.

    Returns:
        The total norm before clipping, fp32 0-d tensor.

    Example:
        >>> loss.backward()
        >>> clip_grad_norm_tp_(model.parameters(), 1.0, ctx=ctx)
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    device = params[0].grad.device
    sharded = torch.zeros(1, device=device)
    replicated = torch.zeros(1, device=device)
    for acc, want in ((sharded, True), (replicated, False)):
        for grads in _by_dtype([p.grad for p in params if is_tp_sharded(p) == want]):
            unscale_and_norm_(grads, sumsq=acc, backend=backend)
    sumsq = sharded + replicated / ctx.size("tp")
    all_reduce(sumsq, group=ctx.group("tp"), stats=stats)
    for grads in _by_dtype([p.grad for p in params]):
        clip_grads_(grads, sumsq, max_norm=max_norm, backend=backend)
    return sumsq.sqrt().reshape(())
