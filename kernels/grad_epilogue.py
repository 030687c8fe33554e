"""Fused gradient epilogue: unscale + inf/nan check + sum of squares, and norm clipping.

Math, per gradient tensor ``i`` (elements ``g``), fp32, ``s`` the optional ``inv_scale``:

    out_i            = cast(s * g)                                   (in place unless ``out``)
    nonfinite_i      = #{k : out_i[k] is inf or nan}
    sumsq_i          = Σ_k out_i[k]²          (of the stored values, i.e. after rounding)
    found_inf        = 1.0 if Σ_i nonfinite_i > 0 (never cleared, like torch's AMP ops)
    sumsq           += Σ_i sumsq_i            (accumulates across calls / buckets)

and, in a second launch once ``sumsq`` is final (after the all-reduce of the per-rank partial
sums under ZeRO),

    coef = min(1, max_norm / (sqrt(sumsq) + eps)),      g = g * coef

which is ``torch.nn.utils.clip_grad_norm_`` computed on the device (no host sync). A non-finite
norm gives a non-finite ``coef``, as in torch. When ``coef == 1`` the clip launch reads nothing.

One API serves both users: per-parameter grads (loss scaling without DDP) are a list of tensors;
a DDP/ZeRO bucket is a one-tensor list, or the list of its per-parameter views
(:func:`shardkit.kernels.flatten.bucket_views`) when the loss scaler wants to know which
parameter produced an inf/nan. With ``out=`` the bucket views are read and the parameters'
``.grad`` written, so "average + unscale + check + norm + copy back" after an all-reduce is one
read and one write of the bucket.

[Note: deterministic grad norm]
``sumsq`` is reduced in a fixed order, not with float atomics: every program stores its chunk's
partial sum, and the program that finishes a tensor last (an int atomic counter per tensor, with
acquire/release semantics) adds that tensor's partials in chunk order; the program that finishes
the last tensor adds the per-tensor sums in tensor order. The result depends only on the sizes,
so DDP replicas, which hold bitwise-equal grads after the all-reduce, compute bitwise-equal norms
and clip coefficients and stay in sync; float atomics would let them drift apart by rounding.

Shapes/dtypes: ``grads`` contiguous, one device, one dtype (fp32/fp16/bf16); ``out`` the same
numels, one dtype; ``inv_scale``, ``found_inf``, ``sumsq``: fp32 ``[1]`` on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .runtime import Backend, multi_tensor_table, resolve_backend, torch_to_triton_dtype, triton_kernel
from .tl_helpers import load_chunk, ordered_sum, program_chunk, role_ptr, round_to, store_chunk, widen

__all__ = ["GradStats", "unscale_and_norm_", "clip_coef", "clip_grads_", "epilogue_launch_config", "AOT_CONFIGS"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _unscale_norm_kernel(
    ptrs_ptr,  # int64 [1 or 2, n_tensors]: grads, then out when HAS_OUT
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program (a tensor's chunks are consecutive)
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    n_live: tl.int32,  # tensors with at least one element
    inv_scale_ptr,  # fp32 [1]; read only when SCALE == 2
    inv_scale: tl.float32,  # used only when SCALE == 1
    partials_ptr,  # fp32 [grid]: scratch, Σ out² of each program's chunk
    counters_ptr,  # int32 [n_tensors + 1], zeroed: finished chunks per tensor, then finished tensors
    tensor_sumsq_ptr,  # fp32 [n_tensors], zeroed
    tensor_nonfinite_ptr,  # int64 [n_tensors], zeroed
    found_inf_ptr,  # fp32 [1]: set to 1.0 on any inf/nan
    sumsq_ptr,  # fp32 [1]: this call's total is added
    G_DTYPE: tl.constexpr,
    O_DTYPE: tl.constexpr,  # dtype of out (G_DTYPE when in place)
    HAS_OUT: tl.constexpr,
    SCALE: tl.constexpr,  # 0: none, 1: multiply by `inv_scale`, 2: multiply by *inv_scale_ptr
    ALIGNED: tl.constexpr,  # every grad/out pointer 16-byte aligned
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,  # lanes of the final fixed-order reductions
):
    t, c, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    g_ptr = role_ptr(ptrs_ptr, 0, n_tensors, t, G_DTYPE, ALIGNED)
    g = load_chunk(g_ptr, offs, n, full)
    if SCALE == 1:
        g = g * inv_scale
    if SCALE == 2:
        g = g * tl.load(inv_scale_ptr)
    if HAS_OUT or SCALE != 0:
        g = widen(round_to(g, O_DTYPE))  # check and measure what is stored
        if HAS_OUT:
            store_chunk(role_ptr(ptrs_ptr, 1, n_tensors, t, O_DTYPE, ALIGNED), offs, g, n, full)
        else:
            store_chunk(g_ptr, offs, g, n, full)

    # inf/nan <=> all exponent bits set; an integer test, immune to float compare folding
    bad = (g.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000
    n_bad = tl.sum(bad.to(tl.int32), 0)
    tl.atomic_add(tensor_nonfinite_ptr + t, n_bad.to(tl.int64), mask=n_bad > 0)
    tl.store(found_inf_ptr, 1.0, mask=n_bad > 0)

    # [Note: deterministic grad norm]
    pid = tl.program_id(0)
    tl.store(partials_ptr + pid, tl.sum(g * g, 0))
    tl.debug_barrier()  # the partial is written before this program's release below
    n_chunks = (n + BLOCK - 1) // BLOCK
    if tl.atomic_add(counters_ptr + t, 1, sem="acq_rel") == n_chunks - 1:
        tl.store(tensor_sumsq_ptr + t, ordered_sum(partials_ptr, pid - c, n_chunks, RBLOCK))
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + n_tensors, 1, sem="acq_rel") == n_live - 1:
            total = ordered_sum(tensor_sumsq_ptr, 0, n_tensors, RBLOCK)
            tl.store(sumsq_ptr, tl.load(sumsq_ptr) + total)


def _clip_kernel(
    ptrs_ptr,  # int64 [1, n_tensors]: grads
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]
    chunk_index_ptr,  # int32 [grid]
    sumsq_ptr,  # fp32 [1]: Σ g² over every gradient being clipped together
    coef_ptr,  # fp32 [1]: receives the clip coefficient
    max_norm: tl.float32,
    eps: tl.float32,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    coef = max_norm / (tl.sqrt_rn(tl.load(sumsq_ptr)) + eps)
    coef = tl.minimum(coef, 1.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, like torch.clamp
    if tl.program_id(0) == 0:
        tl.store(coef_ptr, coef)
    if coef != 1.0:  # below max_norm nothing is read or written
        t, _, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
        g_ptr = role_ptr(ptrs_ptr, 0, 0, t, G_DTYPE, ALIGNED)
        store_chunk(g_ptr, offs, load_chunk(g_ptr, offs, n, full) * coef, n, full)


_UNSCALE_NORM = triton_kernel(_unscale_norm_kernel)
_CLIP = triton_kernel(_clip_kernel)


@dataclass(frozen=True)
class GradStats:
    """Result of :func:`unscale_and_norm_`; every field is a device tensor (no host sync).

    Attributes:
        found_inf: fp32 ``[1]``, 1.0 if any gradient (of this or an earlier call sharing the
            tensor) held an inf/nan.
        sumsq: fp32 ``[1]``, accumulated Σ g² of the unscaled gradients.
        tensor_sumsq: fp32 ``[n_tensors]``, Σ g² per tensor of this call.
        tensor_nonfinite: int64 ``[n_tensors]``, inf/nan element count per tensor of this call.
    """

    found_inf: torch.Tensor
    sumsq: torch.Tensor
    tensor_sumsq: torch.Tensor
    tensor_nonfinite: torch.Tensor

    def norm(self) -> torch.Tensor:
        """The global L2 norm, ``sqrt(sumsq)``, fp32 ``[1]``."""
        return self.sumsq.sqrt()

    def nonfinite_indices(self) -> list[int]:
        """Indices of the tensors that produced an inf/nan (syncs with the device)."""
        return torch.nonzero(self.tensor_nonfinite).flatten().tolist()


def epilogue_launch_config(device: torch.device, max_numel: int) -> tuple[int, int, int]:
    """``(BLOCK, RBLOCK, num_warps)`` for the epilogue and clip kernels; a pure function.

    CUDA: BLOCK 2048 and 4 warps — 16 elements per thread (four fp32 or two bf16 128-bit
    loads) and one partial sum per 2048 elements for the fixed-order norm; RBLOCK 1024 lanes for
    the final reductions; 0 spills at sm_80/sm_90 (see ``AOT_CONFIGS``). Interpreter: it pays per
    program instance, so one block per tensor up to 2^16 elements, and RBLOCK 8 (cheap there) so
    that a handful of tensors already exercises the multi-step final reduction loops.
    """
    if device.type == "cuda":
        return 2048, 1024, 4
    return min(max(triton.next_power_of_2(max(max_numel, 1)), 1024), 65536), 8, 4


def _check_grads(name: str, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t)}")
        if t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device}, expected {device} (one device per call)")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name} must share one dtype: {name}[0] is {tensors[0].dtype}, {name}[{i}] is {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
    if tensors and tensors[0].dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {tensors[0].dtype}")


def _check_scalar_tensor(name: str, t: torch.Tensor | None, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{name} must be a 1-element float32 tensor, got {t!r:.80}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the gradients are on {device}")


def unscale_and_norm_(
    grads: Sequence[torch.Tensor],
    *,
    inv_scale: float | torch.Tensor | None = None,
    out: Sequence[torch.Tensor] | None = None,
    found_inf: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> GradStats:
    """Unscale gradients, flag inf/nan per tensor and accumulate Σ g², in one launch.

    ``out_i = cast(inv_scale * g_i)`` (``out`` defaults to ``grads``: in place), then on the
    stored values: ``tensor_nonfinite_i = #nonfinite``, ``tensor_sumsq_i = Σ out_i²``,
    ``found_inf = 1`` if any is non-finite, ``sumsq += Σ_i tensor_sumsq_i``. The norm is
    bitwise deterministic (see [Note: deterministic grad norm]). Without ``inv_scale`` and
    ``out`` the gradients are only read.

    Args:
        grads: contiguous gradients, one device, one dtype (fp32/fp16/bf16); a flat bucket is a
            one-tensor list, or its per-parameter views for per-parameter attribution.
        inv_scale: multiplier, e.g. ``1 / (loss_scale * world_size)``; a 1-element fp32 tensor
            on the device avoids a host sync (as ``GradScaler`` passes it).
        out: optional destinations (same numels, contiguous, one dtype) — e.g. the params'
            ``.grad`` when ``grads`` are views of an all-reduced bucket.
        found_inf: fp32 ``[1]`` flag to set (e.g. ``GradScaler``'s); default a new zero.
        sumsq: fp32 ``[1]`` accumulator (shared across buckets/dtype groups); default a new zero.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`. The torch path syncs with
            the device to count inf/nan per tensor, only when some tensor's norm is non-finite.

    Returns:
        :class:`GradStats` holding ``found_inf``, ``sumsq`` and this call's per-tensor results.

    Raises:
        TypeError: a non-float dtype, mixed dtypes, a badly typed scalar tensor.
        ValueError: device mismatch, non-contiguous input, ``out`` of the wrong length/numel.

    Example:
        >>> stats = unscale_and_norm_(grads, inv_scale=scaler_inv, found_inf=found_inf)
        >>> coef = clip_grads_(grads, stats.sumsq, max_norm=1.0)
        >>> stats.nonfinite_indices()  # on overflow: which parameters
        [3]
    """
    given = [t for t in (*grads[:1], found_inf, sumsq) if isinstance(t, torch.Tensor)]
    device = given[0].device if given else torch.device("cpu")
    _check_grads("grads", grads, device)
    if out is not None:
        if len(out) != len(grads):
            raise ValueError(f"out has {len(out)} tensors but grads has {len(grads)}")
        _check_grads("out", out, device)
        for i, (o, g) in enumerate(zip(out, grads)):
            if o.numel() != g.numel():
                raise ValueError(f"out[{i}] has {o.numel()} elements but grads[{i}] has {g.numel()}")
    if isinstance(inv_scale, torch.Tensor):
        _check_scalar_tensor("inv_scale", inv_scale, device)
    elif inv_scale is not None and not isinstance(inv_scale, (int, float)):
        raise TypeError(f"inv_scale must be a float, a 1-element float32 tensor or None, got {type(inv_scale)}")
    _check_scalar_tensor("found_inf", found_inf, device)
    _check_scalar_tensor("sumsq", sumsq, device)

    n = len(grads)
    stats = GradStats(
        found_inf=torch.zeros(1, device=device) if found_inf is None else found_inf,
        sumsq=torch.zeros(1, device=device) if sumsq is None else sumsq,
        tensor_sumsq=torch.zeros(n, device=device),
        tensor_nonfinite=torch.zeros(n, dtype=torch.int64, device=device),
    )
    live = [i for i, g in enumerate(grads) if g.numel() > 0]
    if not live:
        return stats
    dst = list(grads) if out is None else list(out)
    if resolve_backend(backend, device) == "torch":
        _unscale_and_norm_torch([grads[i] for i in live], [dst[i] for i in live], live, inv_scale, stats, in_place=out is None)
        return stats

    block, rblock, num_warps = epilogue_launch_config(device, max(grads[i].numel() for i in live))
    roles = [list(grads)] if out is None else [list(grads), dst]
    table = multi_tensor_table(roles, block)
    aligned = all(r[i].data_ptr() % 16 == 0 for r in roles for i in live)
    scale_mode = 0 if inv_scale is None else 2 if isinstance(inv_scale, torch.Tensor) else 1
    _UNSCALE_NORM[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        n,
        len(live),
        inv_scale if scale_mode == 2 else stats.sumsq,  # placeholder pointer, unread
        float(inv_scale) if scale_mode == 1 else 1.0,
        torch.empty(table.n_chunks, device=device),
        torch.zeros(n + 1, dtype=torch.int32, device=device),
        stats.tensor_sumsq,
        stats.tensor_nonfinite,
        stats.found_inf,
        stats.sumsq,
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        O_DTYPE=torch_to_triton_dtype(dst[0].dtype),
        HAS_OUT=out is not None,
        SCALE=scale_mode,
        ALIGNED=aligned,
        BLOCK=block,
        RBLOCK=rblock,
        num_warps=num_warps,
    )
    return stats


def _unscale_and_norm_torch(
    grads: list[torch.Tensor],
    dst: list[torch.Tensor],
    live: list[int],
    inv_scale: float | torch.Tensor | None,
    stats: GradStats,
    *,
    in_place: bool,
) -> None:
    """Torch fast path: foreach multiply (or copy), foreach fp32 norm, exact counts on suspicion."""
    if inv_scale is not None:  # a 0-dim fp32 tensor: a float would be rounded to fp16/bf16 first
        inv_scale = torch.as_tensor(inv_scale, dtype=torch.float32, device=dst[0].device).reshape(())
    if not in_place:
        wide = grads if inv_scale is None or grads[0].dtype == torch.float32 else [g.float() for g in grads]
        torch._foreach_copy_(dst, grads if inv_scale is None else torch._foreach_mul(wide, inv_scale))
    elif inv_scale is not None:
        torch._foreach_mul_(dst, inv_scale)
    norms = torch.stack(torch._foreach_norm(dst, 2, dtype=torch.float32))
    idx = torch.tensor(live, device=norms.device)
    stats.tensor_sumsq.index_copy_(0, idx, norms * norms)
    # A non-finite element makes its tensor's norm non-finite; the converse (overflow of Σ g²)
    # is possible, so count exactly, but only for suspects.
    suspects = (~torch.isfinite(norms)).nonzero().flatten().tolist()
    for j in suspects:
        stats.tensor_nonfinite[live[j]] = (~torch.isfinite(dst[j])).sum()
    stats.found_inf.masked_fill_(stats.tensor_nonfinite.sum() > 0, 1.0)
    stats.sumsq.add_(stats.tensor_sumsq.sum())


def clip_coef(sumsq: torch.Tensor, max_norm: float, *, eps: float = 1e-6) -> torch.Tensor:
    """``min(1, max_norm / (sqrt(sumsq) + eps))`` as an fp32 ``[1]`` device tensor (no sync).

    The coefficient of ``torch.nn.utils.clip_grad_norm_`` (same ``eps``); multiply it into a
    later kernel's scale (e.g. ``adam_step``'s ``grad_scale = 1 / coef``) to clip for free.

    Example:
        >>> coef = clip_coef(stats.sumsq, max_norm=1.0)
    """
    return torch.clamp(max_norm / (sumsq.reshape(1).sqrt() + eps), max=1.0)


def clip_grads_(
    grads: Sequence[torch.Tensor],
    sumsq: torch.Tensor,
    *,
    max_norm: float,
    eps: float = 1e-6,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Scale gradients in place by ``coef = min(1, max_norm / (sqrt(sumsq) + eps))``, one launch.

    ``coef`` is computed on the device from ``sumsq`` (no host sync); when it is 1 the launch
    reads and writes nothing. Same result as ``torch.nn.utils.clip_grad_norm_(grads, max_norm)``
    when ``sumsq`` is Σ g² over the same grads.

    Args:
        grads: contiguous gradients, one device, one dtype (fp32/fp16/bf16).
        sumsq: fp32 ``[1]``, Σ g² over all gradients clipped together (e.g. ``GradStats.sumsq``,
            all-reduced across ranks under ZeRO; shared by every dtype group).
        max_norm: the largest allowed global L2 norm.
        eps: added to the norm, as torch does (``1e-6``).
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Returns:
        ``coef``, fp32 ``[1]`` on the device.

    Raises:
        TypeError / ValueError: as for :func:`unscale_and_norm_`.

    Example:
        >>> stats = unscale_and_norm_(grads)
        >>> coef = clip_grads_(grads, stats.sumsq, max_norm=1.0)
    """
    device = sumsq.device if isinstance(sumsq, torch.Tensor) else torch.device("cpu")
    _check_scalar_tensor("sumsq", sumsq, device)
    _check_grads("grads", grads, device)
    live = [g for g in grads if g.numel() > 0]
    if not live or resolve_backend(backend, device) == "torch":
        coef = clip_coef(sumsq, max_norm, eps=eps)
        if live:
            torch._foreach_mul_(live, coef.reshape(()))
        return coef
    block, _, num_warps = epilogue_launch_config(device, max(g.numel() for g in live))
    table = multi_tensor_table([live], block)
    coef = torch.empty(1, device=device)
    _CLIP[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        sumsq,
        coef,
        float(max_norm),
        float(eps),
        G_DTYPE=torch_to_triton_dtype(live[0].dtype),
        ALIGNED=all(g.data_ptr() % 16 == 0 for g in live),
        BLOCK=block,
        num_warps=num_warps,
    )
    return coef


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, rblock, num_warps = epilogue_launch_config(torch.device("cuda"), 1 << 20)
    pointers = dict(
        inv_scale_ptr="*fp32",
        partials_ptr="*fp32",
        counters_ptr="*i32",
        tensor_sumsq_ptr="*fp32",
        tensor_nonfinite_ptr="*i64",
        found_inf_ptr="*fp32",
        sumsq_ptr="*fp32",
    )
    base = dict(HAS_OUT=False, SCALE=2, ALIGNED=True, BLOCK=block, RBLOCK=rblock)
    configs = [  # (name, grad dtype, out dtype, has out, bytes moved per element)
        ("unscale_norm_fp32", tl.float32, tl.float32, False, 8),
        ("unscale_norm_bf16", tl.bfloat16, tl.bfloat16, False, 4),
        ("unscale_norm_fp32_bucket_to_bf16", tl.float32, tl.bfloat16, True, 6),
    ]
    out = [
        dict(
            kernel=_UNSCALE_NORM,
            name=name,
            pointers=pointers,
            num_warps=num_warps,
            constexprs=dict(base, G_DTYPE=g, O_DTYPE=o, HAS_OUT=has_out),
            elements_per_program=block,
            bytes_per_element=nbytes,
        )
        for name, g, o, has_out, nbytes in configs
    ]
    for name, g, nbytes in [("clip_fp32", tl.float32, 8), ("clip_bf16", tl.bfloat16, 4)]:
        out.append(
            dict(
                kernel=_CLIP,
                name=name,
                pointers=dict(sumsq_ptr="*fp32", coef_ptr="*fp32"),
                num_warps=num_warps,
                constexprs=dict(G_DTYPE=g, ALIGNED=True, BLOCK=block),
                elements_per_program=block,
                bytes_per_element=nbytes,
            )
        )
    return out


AOT_CONFIGS = _aot_configs
