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

from collections.abc import Iterable, Sequence

import torch

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels.grad_epilogue import unscale_and_norm_
from shardkit.kernels.runtime import Backend

from ..grad_utils import agree_and_clip_
from .layers import is_tp_sharded

__all__ = ["clip_grad_norm_tp_", "unscale_and_clip_model_parallel_"]


def _by_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    return list(groups.values())


@torch.no_grad()
def unscale_and_clip_model_parallel_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    ctx: ParallelContext | None,
    axes: Sequence[str] = ("tp",),
    inv_scale: float | None = None,
    uncounted: Iterable[torch.Tensor] = (),
    backend: Backend = "auto",
    stats: CommStats | None = None,
) -> tuple[bool, torch.Tensor]:
    """Unscale (optional), measure and clip a model-parallel model's gradients by their GLOBAL norm.

    This rank's share of Σg² counts its tp-split gradients fully and ``1/tp`` of its
    tp-replicated ones (see the module docstring); ``uncounted`` gradients (this rank's copies of
    a parameter tied across pipeline stages that another rank counts) are unscaled and flagged
    but not counted. :func:`~shardkit.parallel.grad_utils.agree_and_clip_` then sums flag and
    squares over each of ``axes`` and clips unless an overflow.

    Args:
        parameters: this rank's parameters; those without a grad are skipped.
        max_norm: the largest allowed global norm (> 0), or None to measure (and unscale) only.
        ctx: the parallel context (None: one process).
        axes: the axes across which the model is split (``("tp", "pp")`` under a pipeline);
            size-1 axes cost nothing.
        inv_scale: ``1 / loss_scale`` to unscale by, with the inf/nan check; None: no loss scaler
            (no flag, no host sync).
        uncounted: parameters whose squares another rank counts.
        backend: kernel backend.
        stats: optional CommStats for the all-reduces.

    Returns:
        ``(overflow, norm)``: the agreed inf/nan decision (False without ``inv_scale``) and the
        pre-clip global norm (0-d fp32; ``inf`` on overflow).

    Example:
        >>> overflow, norm = unscale_and_clip_model_parallel_(
        ...     model.parameters(), 1.0, ctx=ctx, axes=("tp", "pp"), inv_scale=1 / scaler.scale)
    """
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in uncounted}
    device = params[0].grad.device if params else ctx.device if ctx is not None else torch.device("cpu")
    found_inf = torch.zeros(1, device=device) if inv_scale is not None else None
    sharded, replicated = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for acc, want in ((sharded, True), (replicated, False)):
        for grads in _by_dtype([p.grad for p in params if is_tp_sharded(p) == want and id(p) not in skip]):
            unscale_and_norm_(grads, inv_scale=inv_scale, found_inf=found_inf, sumsq=acc, backend=backend)
    if inv_scale is not None:  # uncounted copies: unscaled too, and their flag counts
        for grads in _by_dtype([p.grad for p in params if id(p) in skip]):
            unscale_and_norm_(grads, inv_scale=inv_scale, found_inf=found_inf, backend=backend)
    tp = ctx.size("tp") if ctx is not None else 1
    sumsq = sharded + replicated / tp
    groups = [ctx.group(a) for a in axes if ctx.size(a) > 1] if ctx is not None else []
    return agree_and_clip_(
        sumsq,
        found_inf,
        sum_over=groups,
        max_norm=max_norm,
        grads=_by_dtype([p.grad for p in params]),
        backend=backend,
        stats=stats,
    )


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
    return unscale_and_clip_model_parallel_(params, max_norm, ctx=ctx, backend=backend, stats=stats)[1]
