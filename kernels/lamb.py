"""Multi-tensor LAMB step: two launches per launch group (one when the group is not adapted).

Math (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2), per tensor (layer) ``w``, fp32:

    g  = grad / grad_scale             (if a GradScaler scale is given)
    g  = -g                            (if maximize)
    m  = b1 * m + (1 - b1) * g
    v  = b2 * v + (1 - b2) * g^2
    r  = (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)     (no division if not bias_correction)
    u  = r + wd * w
    trust = clamp(phi(||w||) / ||u||, max=max_trust_ratio)   if ||w|| > 0 and ||u|| > 0, else 1
    phi(z) = clamp(z, weight_norm_min, weight_norm_max)        (the paper's gamma_l, gamma_u)
    w  = w - lr * trust * u

``||.||`` is the L2 norm of the whole tensor, taken on ``w`` before the update. A group that is
not *adapted* (``adapt=False``: Apex's NVLAMB with ``weight_decay == 0`` and not
``always_adapt``) uses ``trust = 1``.

[Note: LAMB launches]
The trust ratio needs two per-tensor norms before any element of that tensor can be updated, so
where the other fused optimizers take one launch per launch group, LAMB takes two:

1. ``_lamb_moments_kernel``: update ``m``, ``v``; compute ``u``; reduce ``sum(w^2)`` and
   ``sum(u^2)`` per tensor in a fixed order (below) into an fp32 ``[2 * n_tensors]`` buffer;
2. ``_lamb_apply_kernel``: recompute ``u`` from the stored ``m``, ``v`` and the unchanged ``w``
   (cheaper than a scratch copy of ``u``: it reads 12 B/element instead of writing and reading
   8) and apply ``w -= lr * trust * u``.

Phase 1 computes ``u`` from ``m``/``v`` *as stored* (rounded to their dtype), so both phases use
the same ``u``. An un-adapted group needs no norms: phase 1 applies the update itself, one
launch.

The per-tensor norms are reduced in a fixed order, as the gradient epilogue's norm (see [Note:
deterministic grad norm] in grad_epilogue.py): every program writes its chunk's two partial sums,
and the program that finishes a tensor last (an int atomic counter per tensor, acquire/release)
adds that tensor's partials in chunk order. The trust ratios are then bitwise reproducible, so
DDP replicas holding equal grads stay bitwise equal (fp32 atomics made the last bit of each norm,
and so the replicas, depend on timing).

``w`` is the fp32 master copy when one is kept (bf16/fp16 params with ``master_weights``); the
param is then written as ``w`` rounded to its dtype in the same pass.

Shapes/dtypes: every list has one tensor per parameter, contiguous, same numel in every list.
params fp32/fp16/bf16; grads fp32/fp16/bf16; exp_avg/exp_avg_sq fp32 when a master copy is kept,
else the param dtype; masters fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .runtime import (
    Backend,
    MultiTensorTable,
    elementwise_launch_config,
    live_multi_tensor_table,
    resolve_backend,
    torch_to_triton_dtype,
    triton_kernel,
)
from .tl_helpers import load_chunk, ordered_sum, program_chunk, role_ptr, round_to, store_chunk, widen

__all__ = ["lamb_step", "lamb_launch_config", "lamb_reduce_block"]


def _lamb_moments_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, exp_avg, exp_avg_sq, [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    partials_ptr,  # fp32 [2, grid]: scratch, each program's sum(w^2) and sum(u^2)
    counters_ptr,  # int32 [n_tensors], zeroed: finished programs per tensor
    norms_ptr,  # fp32 [2 * n_tensors]: receives sum(w^2), sum(u^2) of tensor t at 2t, 2t+1
    lr: tl.float32,  # used only when not ADAPT
    beta1: tl.float32,
    beta2: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    bc1: tl.float32,  # 1 - beta1**step (1 without bias correction)
    bc2_sqrt: tl.float32,  # sqrt(1 - beta2**step) (1 without bias correction)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    MAXIMIZE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAPT: tl.constexpr,  # reduce norms (phase 2 applies) | apply w -= lr * u here
    ALIGNED: tl.constexpr,  # every pointer 16-byte aligned ([Note: aligned full chunks])
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,  # lanes of the fixed-order per-tensor reduction
):
    t, c, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    p_ptr = role_ptr(ptrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
    g_ptr = role_ptr(ptrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
    m_ptr = role_ptr(ptrs_ptr, 2, n_tensors, t, S_DTYPE, ALIGNED)
    v_ptr = role_ptr(ptrs_ptr, 3, n_tensors, t, S_DTYPE, ALIGNED)

    g = load_chunk(g_ptr, offs, n, full)
    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w_ptr = role_ptr(ptrs_ptr, 4, n_tensors, t, tl.float32, ALIGNED)
        w = load_chunk(w_ptr, offs, n, full)
    else:
        w = load_chunk(p_ptr, offs, n, full)

    m = round_to(beta1 * load_chunk(m_ptr, offs, n, full) + (1.0 - beta1) * g, S_DTYPE)
    v = round_to(beta2 * load_chunk(v_ptr, offs, n, full) + (1.0 - beta2) * g * g, S_DTYPE)
    store_chunk(m_ptr, offs, m, n, full)
    store_chunk(v_ptr, offs, v, n, full)
    u = (widen(m) / bc1) / (tl.sqrt(widen(v)) / bc2_sqrt + eps) + weight_decay * w

    if ADAPT:
        u = tl.where(offs < n, u, 0.0)  # masked lanes: 0 / eps, or NaN when eps == 0
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        tl.store(partials_ptr + pid, tl.sum(w * w, 0))
        tl.store(partials_ptr + grid + pid, tl.sum(u * u, 0))
        tl.debug_barrier()  # the partials are written before this program's release below
        n_chunks = (n + BLOCK - 1) // BLOCK
        if tl.atomic_add(counters_ptr + t, 1, sem="acq_rel") == n_chunks - 1:
            first = pid - c  # a tensor's chunks have consecutive program ids (MultiTensorTable)
            tl.store(norms_ptr + 2 * t, ordered_sum(partials_ptr, first, n_chunks, RBLOCK))
            tl.store(norms_ptr + 2 * t + 1, ordered_sum(partials_ptr + grid, first, n_chunks, RBLOCK))
    else:
        w = w - lr * u
        if HAS_MASTER:
            store_chunk(w_ptr, offs, w, n, full)
        store_chunk(p_ptr, offs, w, n, full)


def _lamb_apply_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad (unread), exp_avg, exp_avg_sq, [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    norms_ptr,  # fp32 [2 * n_tensors]: sum(w^2), sum(u^2) per tensor, from phase 1
    lr: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    bc1: tl.float32,  # 1 - beta1**step (1 without bias correction)
    bc2_sqrt: tl.float32,  # sqrt(1 - beta2**step) (1 without bias correction)
    weight_norm_min: tl.float32,  # phi's clamp of ||w||: the paper's gamma_l
    weight_norm_max: tl.float32,  # ... and gamma_u (inf: no upper clamp)
    max_trust_ratio: tl.float32,  # upper clamp of the trust ratio (inf: none)
    P_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    HAS_MASTER: tl.constexpr,
    ALIGNED: tl.constexpr,  # every pointer 16-byte aligned ([Note: aligned full chunks])
    BLOCK: tl.constexpr,
):
    t, _, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    p_ptr = role_ptr(ptrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
    m_ptr = role_ptr(ptrs_ptr, 2, n_tensors, t, S_DTYPE, ALIGNED)
    v_ptr = role_ptr(ptrs_ptr, 3, n_tensors, t, S_DTYPE, ALIGNED)

    if HAS_MASTER:
        w_ptr = role_ptr(ptrs_ptr, 4, n_tensors, t, tl.float32, ALIGNED)
        w = load_chunk(w_ptr, offs, n, full)
    else:
        w = load_chunk(p_ptr, offs, n, full)
    m = load_chunk(m_ptr, offs, n, full)
    v = load_chunk(v_ptr, offs, n, full)
    u = (m / bc1) / (tl.sqrt(v) / bc2_sqrt + eps) + weight_decay * w

    w_norm = tl.sqrt(tl.load(norms_ptr + 2 * t))
    u_norm = tl.sqrt(tl.load(norms_ptr + 2 * t + 1))
    phi = tl.minimum(tl.maximum(w_norm, weight_norm_min), weight_norm_max)
    trust = tl.where((w_norm > 0.0) & (u_norm > 0.0), phi / u_norm, 1.0)
    trust = tl.minimum(trust, max_trust_ratio)
    w = w - (lr * trust) * u

    if HAS_MASTER:
        store_chunk(w_ptr, offs, w, n, full)
    store_chunk(p_ptr, offs, w, n, full)


_LAMB_MOMENTS = triton_kernel(_lamb_moments_kernel)
_LAMB_APPLY = triton_kernel(_lamb_apply_kernel)


def lamb_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for both LAMB kernels; a pure function of device and size.

    CUDA: 1024 elements and 4 warps, as for Adam (8 fp32 per thread = two 128-bit accesses per
    tensor, no spills at sm_80/sm_90 — see ``AOT_CONFIGS``); the per-program partial norms then
    cost two 4-byte stores and one int atomic per 1024 elements. Interpreter: it pays per program instance, so one
    large block per tensor up to 2^16 elements.

    Example:
        >>> lamb_launch_config(torch.device("cuda"), 1 << 20)
        (1024, 4)
    """
    return elementwise_launch_config(device, max_numel)


def lamb_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    weight_norm_clip: tuple[float, float] = (0.0, float("inf")),
    max_trust_ratio: float = float("inf"),
    adapt: bool = True,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Apply one LAMB step in place to a launch group of tensors (see [Note: LAMB launches]).

    Args:
        params: parameters (fp32/fp16/bf16), all one dtype and device, dense (contiguous or
            e.g. channels_last; grads, states and masters laid out like their param).
        grads: gradients, one dtype, same shapes as ``params``.
        exp_avgs, exp_avg_sqs: first/second moments (updated in place).
        masters: fp32 master copies when kept (then ``params`` are written as their rounding),
            else empty.
        step: the step number *after* this update (1 on the first step), for bias correction.
        bias_correction: divide the moments by ``1 - beta**step``.
        weight_norm_clip: ``(min, max)`` clamp of ``||w||`` in the trust ratio (``phi``).
        max_trust_ratio: upper clamp of the trust ratio (``inf``: none).
        adapt: apply the trust ratio (``False``: plain Adam-with-L2-direction step, 1 launch).
        grad_scale: a 1-element fp32 tensor to divide grads by (``torch.amp.GradScaler``).
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`. The torch path runs
            ``torch._foreach_*`` ops in fp32 (fp16/bf16 tensors are upcast and written back).

    Example:
        >>> m, v = torch.zeros_like(p), torch.zeros_like(p)
        >>> lamb_step([p], [p.grad], [m], [v], [], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
        ...           eps=1e-6, weight_decay=0.01, weight_norm_clip=(0.0, 10.0))
    """
    if not params:
        return
    device = params[0].device
    bc1, bc2_sqrt = 1.0, 1.0
    if bias_correction:
        bc1, bc2_sqrt = 1.0 - beta1**step, (1.0 - beta2**step) ** 0.5
    lo, hi = (float(x) for x in weight_norm_clip)
    if resolve_backend(backend, device) == "torch":
        _lamb_step_torch(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            masters,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            bc1=bc1,
            bc2_sqrt=bc2_sqrt,
            lo=lo,
            hi=hi,
            max_trust_ratio=max_trust_ratio,
            adapt=adapt,
            maximize=maximize,
            grad_scale=grad_scale,
        )
        return
    launched = _launch_moments(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        masters,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        bc1=bc1,
        bc2_sqrt=bc2_sqrt,
        adapt=adapt,
        maximize=maximize,
        grad_scale=grad_scale,
    )
    if launched is None or not adapt:
        return
    table, block, num_warps, norms = launched
    _LAMB_APPLY[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        table.n_tensors,
        norms,
        lr,
        eps,
        weight_decay,
        bc1,
        bc2_sqrt,
        lo,
        hi,
        float(max_trust_ratio),
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        S_DTYPE=torch_to_triton_dtype(exp_avgs[0].dtype),
        HAS_MASTER=bool(masters),
        ALIGNED=table.aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def lamb_reduce_block(device: torch.device) -> int:
    """``RBLOCK``, the lanes of the fixed-order per-tensor norm reduction; a pure function.

    CUDA: 1024 (one pass covers a 1M-element tensor's partials at BLOCK=1024). Interpreter: 8,
    cheap there, so that a tensor of a few chunks already exercises the multi-step loop.
    """
    return 1024 if device.type == "cuda" else 8


def _launch_moments(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bc1,
    bc2_sqrt,
    adapt,
    maximize,
    grad_scale,
) -> tuple[MultiTensorTable, int, int, torch.Tensor] | None:
    """Phase 1 (see [Note: LAMB launches]): ``(table, BLOCK, num_warps, norms)``, None if empty.

    ``norms`` is fp32 ``[2 * n_live_tensors]``: ``sum(w^2)``, ``sum(u^2)`` of each live tensor,
    reduced in a fixed order (valid when ``adapt``).
    """
    roles = [params, grads, exp_avgs, exp_avg_sqs]
    if masters:
        roles.append(masters)
    built = live_multi_tensor_table(roles, lamb_launch_config)
    if built is None:
        return None
    table, block, num_warps = built
    device = params[0].device
    scale = grad_scale if grad_scale is not None else table.numels  # placeholder pointer, unread
    n_partials = 2 * table.n_chunks if adapt else 1
    norms = torch.empty(2 * table.n_tensors if adapt else 1, dtype=torch.float32, device=device)
    _LAMB_MOMENTS[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        table.n_tensors,
        scale,
        torch.empty(n_partials, dtype=torch.float32, device=device),
        torch.zeros(table.n_tensors if adapt else 1, dtype=torch.int32, device=device),
        norms,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        bc1,
        bc2_sqrt,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(exp_avgs[0].dtype),
        MAXIMIZE=maximize,
        HAS_MASTER=bool(masters),
        HAS_GRAD_SCALE=grad_scale is not None,
        ADAPT=adapt,
        ALIGNED=table.aligned,
        BLOCK=block,
        RBLOCK=lamb_reduce_block(device),
        num_warps=num_warps,
    )
    return table, block, num_warps, norms


def _lamb_step_torch(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    masters,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    bc1,
    bc2_sqrt,
    lo,
    hi,
    max_trust_ratio,
    adapt,
    maximize,
    grad_scale,
) -> None:
    """CPU/any-device fast path: ``torch._foreach_*`` ops on fp32 (master or upcast) tensors."""
    targets = list(masters) if masters else list(params)
    stored_m, stored_v = list(exp_avgs), list(exp_avg_sqs)
    lowp_state = stored_m[0].dtype != torch.float32
    w = targets if targets[0].dtype == torch.float32 else [t.float() for t in targets]
    m = [t.float() for t in stored_m] if lowp_state else stored_m
    v = [t.float() for t in stored_v] if lowp_state else stored_v
    g = [x.float() for x in grads]  # a copy when grads are fp16/bf16; never written in place
    if grad_scale is not None:
        g = torch._foreach_div(g, grad_scale.reshape(()))
    if maximize:
        g = torch._foreach_neg(g)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
    if lowp_state:  # round the moments to their dtype first, as the kernel does
        torch._foreach_copy_(stored_m, m)
        torch._foreach_copy_(stored_v, v)
        m = [t.float() for t in stored_m]
        v = [t.float() for t in stored_v]
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    u = torch._foreach_div(m, bc1)
    torch._foreach_div_(u, denom)
    if weight_decay != 0.0:
        torch._foreach_add_(u, w, alpha=weight_decay)
    if adapt:
        w_norm = torch.stack(torch._foreach_norm(w))
        u_norm = torch.stack(torch._foreach_norm(u))
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm.clamp(lo, hi) / u_norm, 1.0)
        trust = trust.clamp(max=max_trust_ratio)
        torch._foreach_mul_(u, list(trust.unbind()))
    torch._foreach_add_(w, u, alpha=-lr)
    if w is not targets:
        torch._foreach_copy_(targets, w)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = lamb_launch_config(torch.device("cuda"), 1 << 20)
    rblock = lamb_reduce_block(torch.device("cuda"))
    base = dict(ALIGNED=True, BLOCK=block)
    p1 = dict(base, MAXIMIZE=False, HAS_GRAD_SCALE=False, ADAPT=True, RBLOCK=rblock)
    fp32 = dict(P_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False)
    bf16 = dict(P_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True)
    moments = dict(
        kernel=_LAMB_MOMENTS,
        num_warps=num_warps,
        elements_per_program=block,
        pointers={"grad_scale_ptr": "*fp32", "partials_ptr": "*fp32", "counters_ptr": "*i32", "norms_ptr": "*fp32"},
    )
    apply = dict(kernel=_LAMB_APPLY, num_warps=num_warps, elements_per_program=block, pointers={"norms_ptr": "*fp32"})
    # bytes per element, fp32: phase 1 reads p, g, m, v + writes m, v (24); phase 2 reads p, m, v
    # + writes p (16). bf16 + master: phase 1 reads g(2), m, v, w + writes m, v (22); phase 2
    # reads m, v, w + writes w, p(2) (18).
    return [
        dict(moments, name="lamb_moments_fp32", constexprs=dict(p1, G_DTYPE=tl.float32, **fp32), bytes_per_element=24),
        dict(apply, name="lamb_apply_fp32", constexprs=dict(base, **fp32), bytes_per_element=16),
        dict(moments, name="lamb_moments_bf16_master", constexprs=dict(p1, G_DTYPE=tl.bfloat16, **bf16), bytes_per_element=22),
        dict(apply, name="lamb_apply_bf16_master", constexprs=dict(base, **bf16), bytes_per_element=18),
    ]


AOT_CONFIGS = _aot_configs
