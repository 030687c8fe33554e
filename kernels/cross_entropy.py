"""Vocab-parallel cross-entropy: the per-shard statistics pass and the in-place gradient pass.

Each tensor-parallel rank holds a shard ``x`` = logits ``[T, Vs]`` of ``T`` tokens over its
``Vs`` contiguous classes ``[vocab_start, vocab_start + Vs)``; only the first ``n_valid`` columns
are real classes (the rest pad a vocabulary not divisible by tp and never take part). These
kernels do the two passes over the shard; the all-reduce of the small per-token statistics
between them happens one layer up (``shardkit.parallel.tensor.vocab_parallel_loss``), so this module
never communicates.

Math, per token ``i`` with target ``t_i`` (fp32 throughout), ``V`` the real vocabulary size,
``ε`` the label smoothing and ``z`` the z-loss weight:

* statistics pass (:func:`ce_shard_stats`), over this shard's valid columns ``c``::

      m_i = max_c x_ic        s_i = Σ_c exp(x_ic - m_i)        q_i = Σ_c x_ic
      x_t,i = x_i,t_i - vocab_start   if t_i is in this shard (and not ignore_index), else 0

  after the all-reduce over tp: ``M_i = max_r m_ri``, ``lse_i = M_i + log Σ_r s_ri exp(m_ri - M_i)``,
  and the loss (torch's label-smoothing definition, PaLM's z-loss)::

      loss_i = (1 - ε) (lse_i - x_t,i) + ε (lse_i - Σ_r q_ri / V) + z lse_i²

* gradient pass (:func:`ce_grad` into a separate buffer, :func:`ce_grad_` in place over the
  shard), with ``p_ic = exp(x_ic - lse_i)``
  and ``g_i`` the upstream gradient of ``loss_i`` (already divided by the token count for
  ``reduction="mean"``)::

      dloss_i/dx_ic = g_i [ p_ic (1 + 2 z lse_i) - (1 - ε) [c = t_i] - ε / V ]

  Pad columns and ignored tokens (``t_i == ignore_index``) get 0.

Shapes/dtypes: ``logits`` fp32 or bf16 (fp16 too), 2-D, unit column stride (any row stride);
``target`` int64 ``[T]``; statistics fp32 ``[4, T]`` (rows: m, s, x_t, q); ``lse`` and ``coef``
fp32 ``[T]``. Gradients are stored in the logits' dtype, rounded to nearest even.

[Note: full pieces]
A row is streamed in ``BLOCK``-column pieces: every piece but the last is full and is read (and,
for the gradient, written) without a mask, the tail piece masked — as the optimizers' [Note:
aligned full chunks] in runtime.py. With ``ALIGNED`` (the launcher checks that the base pointer
and the row stride in bytes are multiples of 16) the compiler knows each full piece starts on 16
bytes and emits 128-bit accesses; a mask on an arbitrary width would force scalar ones.

[Note: bounded working memory]
Neither pass materializes anything of size ``T x Vs`` besides the logits themselves: the
kernels stream each row in ``BLOCK``-column pieces (one program per token, an online max/sum-exp
as in Liger-Kernel's cross-entropy); the gradient goes to ``out`` — the logits themselves for
:func:`ce_grad_`, one ``[T, Vs]`` buffer of the logits' dtype for :func:`ce_grad`. The torch fast
path (CPU) works in fp32, so it processes ``chunk_elements // Vs`` tokens at a time, whatever
``T`` is: the stats pass holds one fp32 temporary of ``chunk_elements`` values (two for bf16
logits: the upcast chunk too), the gradient pass none for fp32 (it works in ``out``) and one
upcast chunk for bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import Backend, resolve_backend, triton_helper, triton_kernel
from .tl_helpers import round_to, widen

__all__ = ["ce_shard_stats", "ce_grad", "ce_grad_", "ce_launch_config", "DEFAULT_CHUNK_ELEMENTS", "AOT_CONFIGS"]

#: fp32 elements the torch fast path may hold at once (see [Note: bounded working memory]).
DEFAULT_CHUNK_ELEMENTS = 1 << 24

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton_helper
def _online_lse(m, d, x):
    """One piece of the online max / sum-exp: the running ``(m, d)`` after the values ``x``.

    ``exp(-inf - m_new) = 0`` rescales the empty initial sum; masked lanes hold ``-inf``."""
    m_new = tl.maximum(m, tl.max(x, 0))
    return m_new, d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)


@triton_helper
def _grad_piece(x, cols, local, lse, p_scale, hot, flat, n_valid, keep):
    """The gradient of one piece of a row (0 on pad columns and ignored tokens)."""
    g = tl.exp(x - lse) * p_scale - tl.where(cols == local, hot, 0.0) - flat
    return tl.where((cols < n_valid) & keep, g, 0.0)


def _ce_stats_kernel(
    x_ptr,  # [n_rows, >= n_valid] logits shard; unit column stride
    target_ptr,  # int64 [n_rows]: global class index (or ignore_index)
    stats_ptr,  # fp32 [4, n_rows] out: max, sum exp(x - max), target logit, sum x
    stride_xm: tl.int64,
    n_rows: tl.int32,
    n_valid: tl.int32,  # real classes in this shard: columns >= n_valid are vocab padding
    vocab_start: tl.int64,  # global class index of column 0
    ignore_index: tl.int64,
    ALIGNED: tl.constexpr,  # every row starts on 16 bytes (see [Note: full pieces])
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if ALIGNED:
        x_row = tl.multiple_of(x_row, 16)
    m = float("-inf")
    d = 0.0
    q = 0.0
    # [Note: full pieces] A shard without valid columns keeps m = -inf, d = 0, which the
    # cross-rank combination treats as "no contribution".
    n_full = (n_valid // BLOCK) * BLOCK
    for start in range(0, n_full, BLOCK):
        x = widen(tl.load(x_row + start + tl.arange(0, BLOCK)))
        m, d = _online_lse(m, d, x)
        q += tl.sum(x, 0)
    if n_full < n_valid:
        cols = n_full + tl.arange(0, BLOCK)
        x = widen(tl.load(x_row + cols, mask=cols < n_valid, other=float("-inf")))
        m, d = _online_lse(m, d, x)
        q += tl.sum(tl.where(cols < n_valid, x, 0.0), 0)
    t = tl.load(target_ptr + row)
    local = t - vocab_start
    hit = (t != ignore_index) & (local >= 0) & (local < n_valid)
    xt = widen(tl.load(x_row + local, mask=hit, other=0.0))
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n_rows + row, d)
    tl.store(stats_ptr + 2 * n_rows + row, xt)
    tl.store(stats_ptr + 3 * n_rows + row, q)


def _ce_grad_kernel(
    x_ptr,  # [n_rows, n_cols] logits shard; unit column stride
    g_ptr,  # [n_rows, n_cols] out: the gradient, logits' dtype; may be x_ptr itself (in place)
    target_ptr,  # int64 [n_rows]
    lse_ptr,  # fp32 [n_rows]: global log-sum-exp over all ranks' valid columns
    coef_ptr,  # fp32 [n_rows]: upstream gradient of each token's loss (g_i)
    stride_xm: tl.int64,
    stride_gm: tl.int64,
    n_cols: tl.int32,  # shard width, padding included (pad columns get 0)
    n_valid: tl.int32,
    vocab_start: tl.int64,
    ignore_index: tl.int64,
    smoothing: tl.float32,  # ε
    smooth_per_class: tl.float32,  # ε / V
    z_loss: tl.float32,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    g_row = g_ptr + row * stride_gm
    if ALIGNED:  # both rows: the launcher checks logits and gradient
        x_row = tl.multiple_of(x_row, 16)
        g_row = tl.multiple_of(g_row, 16)
    t = tl.load(target_ptr + row)
    local = t - vocab_start
    keep = t != ignore_index
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    p_scale = coef * (1.0 + 2.0 * z_loss * lse)  # d(lse + z lse²)/dx = p (1 + 2 z lse)
    hot = coef * (1.0 - smoothing)
    flat = coef * smooth_per_class
    dtype = g_ptr.dtype.element_ty
    n_full = (n_cols // BLOCK) * BLOCK  # [Note: full pieces]
    for start in range(0, n_full, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = widen(tl.load(x_row + cols))
        g = _grad_piece(x, cols, local, lse, p_scale, hot, flat, n_valid, keep)
        tl.store(g_row + cols, round_to(g, dtype))
    if n_full < n_cols:
        cols = n_full + tl.arange(0, BLOCK)
        x = widen(tl.load(x_row + cols, mask=cols < n_cols, other=0.0))
        g = _grad_piece(x, cols, local, lse, p_scale, hot, flat, n_valid, keep)
        tl.store(g_row + cols, round_to(g, dtype), mask=cols < n_cols)


_STATS = triton_kernel(_ce_stats_kernel)
_GRAD = triton_kernel(_ce_grad_kernel)


def ce_launch_config(device: torch.device, n_cols: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for both passes; a pure function of device and shard width.

    CUDA: one program per token streaming its row in pieces of up to 4096 columns with 8 warps
    (16 fp32 per thread: the online-softmax state stays in registers, 0 spills at sm_80/sm_90,
    see ``AOT_CONFIGS``); narrow shards use one piece. Interpreter: it pays per piece, but
    pieces of at most 1024 columns keep the multi-piece loop exercised by modest test shapes.

    Example:
        >>> ce_launch_config(torch.device("cuda"), 32000)
        (4096, 8)
    """
    block = triton.next_power_of_2(max(n_cols, 16))
    if device.type == "cuda":
        return min(block, 4096), 8 if block >= 2048 else 4
    return min(block, 1024), 4


def _check(logits: torch.Tensor, target: torch.Tensor, n_valid: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [tokens, shard classes], got {getattr(logits, 'shape', logits)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have unit column stride, got strides {logits.stride()}")
    if not isinstance(target, torch.Tensor) or target.shape != logits.shape[:1]:
        raise ValueError(
            f"target must have shape [{logits.shape[0]}] (one class per logits row), got {getattr(target, 'shape', target)}"
        )
    if target.dtype != torch.int64:
        raise TypeError(f"target must be int64, got {target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}")
    if not 0 <= n_valid <= logits.shape[1]:
        raise ValueError(f"n_valid must be in [0, {logits.shape[1]}] (the shard width), got {n_valid}")


def _rows_aligned(logits: torch.Tensor) -> bool:
    """Every row of ``logits`` starts on a 16-byte boundary (see [Note: full pieces])."""
    return logits.data_ptr() % 16 == 0 and (logits.stride(0) * logits.element_size()) % 16 == 0


def _rows_per_chunk(n_cols: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(n_cols, 1))


def ce_shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    n_valid: int | None = None,
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Per-token max, sum-exp, target logit and logit sum over one rank's logits shard.

    See the module docstring for the math. Reads the shard once.

    Args:
        logits: ``[T, Vs]`` fp32/bf16/fp16, unit column stride: this rank's classes
            ``[vocab_start, vocab_start + Vs)``.
        target: int64 ``[T]``: global class indices, or ``ignore_index``.
        vocab_start: global index of this shard's first class (``tp_rank * Vs``).
        n_valid: real classes in this shard (columns ``>= n_valid`` are padding); default ``Vs``.
        ignore_index: targets equal to it have no target logit (``x_t = 0``).
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.
        chunk_elements: torch path only; see [Note: bounded working memory].

    Returns:
        fp32 ``[4, T]``: rows ``max`` (``-inf`` when ``n_valid == 0``), ``sum exp(x - max)``,
        target logit (0 when the target is not in this shard), sum of the valid logits.

    Example:
        >>> stats = ce_shard_stats(logits_shard, target, vocab_start=rank * logits_shard.shape[1])
        >>> m, s, x_t, q = stats
    """
    n_valid = logits.shape[1] if n_valid is None else int(n_valid)
    _check(logits, target, n_valid)
    n_rows = logits.shape[0]
    stats = torch.empty(4, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return stats
    if resolve_backend(backend, logits.device) == "triton":
        block, num_warps = ce_launch_config(logits.device, n_valid)
        args = (logits, target, stats, logits.stride(0), n_rows, n_valid, vocab_start, ignore_index)
        _STATS[(n_rows,)](*args, ALIGNED=_rows_aligned(logits), BLOCK=block, num_warps=num_warps)
        return stats
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < n_valid)
    index = torch.where(hit, local, 0).unsqueeze(1)
    step = _rows_per_chunk(n_valid, chunk_elements)
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        x = logits[lo:hi, :n_valid].float()
        if n_valid == 0:
            stats[0, lo:hi] = float("-inf")
            stats[1:, lo:hi] = 0.0
        else:
            m = x.amax(dim=1)
            stats[0, lo:hi] = m
            stats[1, lo:hi] = (x - m.unsqueeze(1)).exp_().sum(dim=1)  # one chunk-sized temporary
            stats[3, lo:hi] = x.sum(dim=1)
        if logits.shape[1] == 0:
            stats[2, lo:hi] = 0.0
        else:
            xt = logits[lo:hi].gather(1, index[lo:hi]).squeeze(1).float()
            stats[2, lo:hi] = torch.where(hit[lo:hi], xt, 0.0)
    return stats


def ce_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    n_valid: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The cross-entropy gradient of the logits shard (see the module docstring), into ``out``.

    Reads ``logits`` once and writes ``out`` once; ``logits`` is not modified unless ``out`` is
    ``logits`` itself (which is :func:`ce_grad_`).

    Args:
        logits: ``[T, Vs]`` as for :func:`ce_shard_stats`.
        target: int64 ``[T]``.
        lse: fp32 ``[T]``: each token's log-sum-exp over the whole (unpadded) vocabulary.
        coef: fp32 ``[T]``: upstream gradient of each token's loss (``grad_output / n`` for a
            mean over ``n`` tokens). Ignored tokens get 0 whatever their ``coef``.
        vocab_size: the real vocabulary size ``V`` (the smoothing term is ``ε / V``).
        vocab_start, n_valid, ignore_index: as for :func:`ce_shard_stats`.
        label_smoothing: ``ε`` in ``[0, 1]``, torch's definition.
        z_loss: weight ``z`` of the ``z * lse²`` term.
        out: ``[T, Vs]`` of the logits' dtype and device, unit column stride (any row stride);
            default a new contiguous tensor.
        backend, chunk_elements: as for :func:`ce_shard_stats`.

    Returns:
        ``out``, holding the gradient (pad columns 0).

    Example:
        >>> grad = ce_grad(logits_shard, target, lse, coef, vocab_size=50257, vocab_start=r * Vs)
    """
    n_valid = logits.shape[1] if n_valid is None else int(n_valid)
    _check(logits, target, n_valid)
    n_rows, n_cols = logits.shape
    for name, t in (("lse", lse), ("coef", coef)):
        if t.shape != (n_rows,) or t.dtype != torch.float32 or t.device != logits.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 [{n_rows}] tensor on {logits.device}")
    if out is None:
        out = torch.empty(n_rows, n_cols, dtype=logits.dtype, device=logits.device)
    elif (
        out.shape != logits.shape
        or out.dtype != logits.dtype
        or out.device != logits.device
        or (n_cols > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out must be a {logits.dtype} [{n_rows}, {n_cols}] tensor on {logits.device} with unit column stride, "
            f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
        )
    if n_rows == 0 or n_cols == 0:
        return out
    smooth = float(label_smoothing)
    if resolve_backend(backend, logits.device) == "triton":
        block, num_warps = ce_launch_config(logits.device, n_cols)
        args = (logits, out, target, lse, coef, logits.stride(0), out.stride(0), n_cols, n_valid, vocab_start, ignore_index)
        aligned = _rows_aligned(logits) and _rows_aligned(out)
        _GRAD[(n_rows,)](*args, smooth, smooth / vocab_size, float(z_loss), ALIGNED=aligned, BLOCK=block, num_warps=num_warps)
        return out
    inplace = out.data_ptr() == logits.data_ptr() and out.stride() == logits.stride()
    keep = target != ignore_index
    local = target - vocab_start
    hit = keep & (local >= 0) & (local < n_valid)
    coef = torch.where(keep, coef, 0.0)
    step = _rows_per_chunk(n_cols, chunk_elements)
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        c = coef[lo:hi].unsqueeze(1)
        src, dst = logits[lo:hi, :n_valid], out[lo:hi, :n_valid]
        # fp32: computed in ``out`` itself (no temporary; a copy of the logits first unless in
        # place); other dtypes go through one fp32 chunk
        if dst.dtype == torch.float32:
            g = dst if inplace else dst.copy_(src)
        else:
            g = src.float()
        g.sub_(lse[lo:hi].unsqueeze(1)).exp_()
        g.mul_(c * (1.0 + 2.0 * z_loss * lse[lo:hi].unsqueeze(1))).sub_(c * (smooth / vocab_size))
        rows = hit[lo:hi].nonzero().squeeze(1)
        g[rows, local[lo:hi][rows]] -= coef[lo:hi][rows] * (1.0 - smooth)
        if g is not dst:
            dst.copy_(g)
        del g  # before the next chunk's copy exists
        out[lo:hi, n_valid:] = 0
    return out


def ce_grad_(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    *,
    vocab_size: int,
    vocab_start: int = 0,
    n_valid: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    backend: Backend = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Overwrite the logits shard with the cross-entropy gradient: :func:`ce_grad` with
    ``out=logits`` (no second ``[T, Vs]`` buffer; the logits are gone afterwards).

    Args: as for :func:`ce_grad`; ``logits`` is overwritten.

    Returns:
        ``logits``, now holding the gradient (pad columns 0).

    Example:
        >>> grad = ce_grad_(logits_shard, target, lse, coef, vocab_size=50257, vocab_start=r * Vs)
    """
    return ce_grad(
        logits,
        target,
        lse,
        coef,
        vocab_size=vocab_size,
        vocab_start=vocab_start,
        n_valid=n_valid,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        out=logits,
        backend=backend,
        chunk_elements=chunk_elements,
    )


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = ce_launch_config(torch.device("cuda"), 32000)
    out = []
    for suffix, ty, size in (("fp32", "*fp32", 4), ("bf16", "*bf16", 2)):
        out.append(
            dict(
                kernel=_STATS,
                name=f"ce_stats_{suffix}",
                pointers=dict(x_ptr=ty, target_ptr="*i64", stats_ptr="*fp32"),
                num_warps=num_warps,
                constexprs=dict(ALIGNED=True, BLOCK=block),
                elements_per_program=block,
                bytes_per_element=size,  # read the logits once
            )
        )
        out.append(
            dict(
                kernel=_GRAD,
                name=f"ce_grad_{suffix}",
                pointers=dict(x_ptr=ty, g_ptr=ty, target_ptr="*i64", lse_ptr="*fp32", coef_ptr="*fp32"),
                num_warps=num_warps,
                constexprs=dict(ALIGNED=True, BLOCK=block),
                elements_per_program=block,
                bytes_per_element=2 * size,  # read the logits, write the gradient
            )
        )
    return out


AOT_CONFIGS = _aot_configs
