"""``context_parallel_attention``: the one entry to attention over sequence shards.

It checks its arguments (before any communication) and hands the work to ring attention
([Note: ring attention]) or Ulysses ([Note: Ulysses attention]). With ``cp == 1`` it is plain
``F.scaled_dot_product_attention``, so a model written against it runs unchanged without
context parallelism.

Which mode: Ulysses moves a constant ``4 (cp-1)/cp`` of the activations per layer and runs the
stock (flash) attention, but needs the heads to split over cp; ring attention works for any
head count and overlaps its transfers with the blockwise compute, and its bytes grow with cp.
``"hybrid"`` does Ulysses within groups of ``ulysses_size`` cp ranks and the ring across them
([Note: hybrid attention]): all-to-all where it is cheap (inside a node), fewer ring steps, and
only ``ulysses_size`` must divide the heads. Megatron-Core names the same choice
``cp_comm_type`` (``"p2p"`` = ring, ``"a2a"`` = Ulysses, ``"a2a+p2p"`` = hybrid).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels.runtime import Backend

from .hybrid_attention import hybrid_attention
from .ring_attention import ring_attention
from .sequence_layout import LAYOUTS, SequenceLayout
from .ulysses_attention import check_ulysses_heads, ulysses_attention

__all__ = ["ContextParallelMode", "MODES", "check_ulysses_size", "context_parallel_attention"]

ContextParallelMode = Literal["ring", "ulysses", "hybrid"]
#: The modes (see the module docstring).
MODES: tuple[str, ...] = ("ring", "ulysses", "hybrid")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_ulysses_size(mode: object, ulysses_size: object, cp: int) -> None:
    """``ulysses_size`` must be given with ``mode="hybrid"`` only, as a positive divisor of ``cp``.

    Example:
        >>> check_ulysses_size("hybrid", 2, 4)
    """
    if mode != "hybrid":
        if ulysses_size is not None:
            raise ValueError(f"ulysses_size: applies to mode='hybrid' only, got mode={mode!r}")
        return
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int):
        raise TypeError(f"mode='hybrid' needs ulysses_size (ranks per all-to-all group), an int; got {ulysses_size!r}")
    if ulysses_size < 1 or (cp > 1 and cp % ulysses_size):  # checked, then unused, at cp = 1
        raise ValueError(f"ulysses_size must be a positive divisor of the cp size {cp}, got {ulysses_size}")


def _check(
    q: object,
    k: object,
    v: object,
    ctx: object,
    mode: object,
    causal: object,
    layout: object,
    scale: object,
    ulysses_size: object,
    dropout_p: object = 0.0,
) -> None:
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq/cp, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp32/bf16/fp16, got {t.dtype}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(
            f"k/v must be [batch={b}, kv_heads, seq/cp={s}, head_dim={d}] (self-attention over the same tokens), "
            f"got {tuple(k.shape)}"
        )
    if h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    cp = ctx.size("cp")
    if dropout_p and cp > 1 and mode != "ulysses":
        raise ValueError(
            f"dropout_p={dropout_p} with mode={mode!r}: attention dropout under cp needs mode='ulysses' (whole "
            "sequences on head shards, SDPA's own dropout); the blockwise ring/hybrid kernels have none"
        )
    if layout == "zigzag" and cp > 1 and s % 2:
        raise ValueError(
            f"layout='zigzag' gives each rank two chunks: the local sequence length must be even, got {s} "
            "(shard the sequence with shard_sequence(..., layout='zigzag'), which checks the full length)"
        )
    check_ulysses_size(mode, ulysses_size, cp)
    if mode == "ulysses" and cp > 1:
        check_ulysses_heads(h, k.shape[1], cp)
    if mode == "hybrid" and cp > 1:
        assert isinstance(ulysses_size, int)
        check_ulysses_heads(h, k.shape[1], ulysses_size, mode="hybrid")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: ParallelContext,
    mode: ContextParallelMode = "ring",
    causal: bool = True,
    layout: SequenceLayout = "zigzag",
    scale: float | None = None,
    backend: Backend = "auto",
    stats: CommStats | None = None,
    ulysses_size: int | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """This cp rank's part of ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` over
    the full sequence, from every rank's part of ``q``, ``k``, ``v``.

    Collective over ``ctx.group("cp")``: every cp rank calls it with its own tokens (as
    :func:`~shardkit.parallel.context.shard_sequence` gives them, same ``layout``).
    Differentiable: the gradients of ``q``, ``k``, ``v`` are this rank's part of the full
    attention's gradients.

    Args:
        q: ``[batch, heads, S/cp, head_dim]``, fp32/bf16/fp16.
        k, v: ``[batch, kv_heads, S/cp, head_dim]``, ``heads % kv_heads == 0`` (GQA/MQA).
        ctx: the context; its ``cp`` axis holds the sequence (size 1: plain attention).
        mode: ``"ring"`` ([Note: ring attention]), ``"ulysses"`` ([Note: Ulysses attention]) or
            ``"hybrid"`` ([Note: hybrid attention]).
        causal: causal mask over the *full* sequence's positions.
        layout: how the sequence is split ([Note: sequence layouts]); the positions the
            causal mask uses follow it.
        scale: score scale, default ``1/sqrt(head_dim)``.
        backend: ring mode's blockwise kernels (:mod:`shardkit.kernels.attention`): ``"auto"``
            is Triton on CUDA, torch on CPU.
        stats: optional :class:`~shardkit.comm.CommStats` for the transfers.
        ulysses_size: with ``mode="hybrid"``, the ranks of each all-to-all group (a divisor of
            cp; :meth:`ParallelContext.cp_split` creates the groups on first use, a collective
            over the world).
        dropout_p: attention dropout (pass 0 in eval, as SDPA's callers do); ``mode="ulysses"``
            only (at cp > 1). Each cp rank draws its heads' masks from its own stream ([Note:
            dropout under context parallelism]), so the masks are independent like the dense
            model's, not the same draws.

    Returns:
        ``[batch, heads, S/cp, head_dim]`` in ``q``'s dtype.

    Raises:
        TypeError/ValueError: bad shapes, dtypes or options (named), an odd local length under
            zigzag, or head counts Ulysses cannot split (see :func:`check_ulysses_heads`).

    Example:
        >>> ctx = ParallelContext.from_env(cp=2)                      # torchrun --nproc-per-node 2
        >>> q, k, v = (shard_sequence(t, ctx, dim=2) for t in (q_full, k_full, v_full))
        >>> out = context_parallel_attention(q, k, v, ctx=ctx, mode="ring")
        >>> full = gather_sequence(out, ctx, dim=2)                   # == SDPA(q_full, k_full, v_full, is_causal=True)
    """
    _check(q, k, v, ctx, mode, causal, layout, scale, ulysses_size, dropout_p)
    if ctx.size("cp") == 1:
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa)
    if mode == "ulysses":
        return ulysses_attention(q, k, v, ctx=ctx, causal=causal, layout=layout, scale=scale, stats=stats, dropout_p=dropout_p)
    if mode == "hybrid":
        assert ulysses_size is not None
        return hybrid_attention(
            q, k, v, ctx=ctx, ulysses_size=ulysses_size, causal=causal, layout=layout, scale=scale, backend=backend, stats=stats
        )
    return ring_attention(q, k, v, ctx=ctx, causal=causal, layout=layout, scale=scale, backend=backend, stats=stats)
