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

1. ``_lamb_moments_kernel``: update ``m``, ``v``; compute ``u``; add each program's partial
   ``sum(w^2)`` and ``sum(u^2)`` (a block reduction then ``tl.atomic_add``) into an fp32
   ``[2 * n_tensors]`` buffer that the launcher zeroes;
2. ``_lamb_apply_kernel``: recompute ``u`` from the stored ``m``, ``v`` and the unchanged ``w``
   (cheaper than a scratch copy of ``u``: it reads 12 B/element instead of writing and reading
   8) and apply ``w -= lr * trust * u``.

Phase 1 computes ``u`` from ``m``/``v`` *as stored* (rounded to their dtype), so both phases use
the same ``u``. An un-adapted group needs no norms: phase 1 applies the update itself, one
launch. The fp32 atomics make the norms' summation order, and so their last bit, vary from run
to run on a GPU (the interpreter runs programs in order).

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
    elementwise_launch_config,
    live_multi_tensor_table,
    resolve_backend,
    torch_to_triton_dtype,
    triton_kernel,
)

__all__ = ["lamb_step", "lamb_launch_config"]


def _lamb_moments_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, exp_avg, exp_avg_sq, [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    norms_ptr,  # fp32 [2 * n_tensors], zeroed: accumulates sum(w^2), sum(u^2) of tensor t at 2t, 2t+1
    lr,  # used only when not ADAPT
    beta1,
    beta2,
    eps,
    weight_decay,
    bc1,  # 1 - beta1**step (1 without bias correction)
    bc2_sqrt,  # sqrt(1 - beta2**step) (1 without bias correction)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    MAXIMIZE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAPT: tl.constexpr,  # accumulate norms (phase 2 applies) | apply w -= lr * u here
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    start = tl.load(chunk_index_ptr + pid).to(tl.int64) * BLOCK
    n = tl.load(numels_ptr + t)
    p_ptr = tl.load(ptrs_ptr + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(ptrs_ptr + n_tensors + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(ptrs_ptr + 2 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
    v_ptr = tl.load(ptrs_ptr + 3 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
    if ALIGNED:
        n = tl.multiple_of(n, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w_ptr = tl.load(ptrs_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = (beta1 * m + (1.0 - beta1) * g).to(S_DTYPE)
    v = (beta2 * v + (1.0 - beta2) * g * g).to(S_DTYPE)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = (m.to(tl.float32) / bc1) / (tl.sqrt(v.to(tl.float32)) / bc2_sqrt + eps) + weight_decay * w

    if ADAPT:
        u = tl.where(mask, u, 0.0)  # masked lanes: 0 / eps, or NaN when eps == 0
        # tl.reduce with tl.sum's own combine function, not tl.sum: tl.sum is a @triton.jit
        # helper bound to compiled mode, while the interpreter recognises this combine function
        # and reduces with numpy (see [Note: one kernel source, ...] in runtime.py).
        # Relaxed atomics: phase 2 is a later launch, so no ordering is needed here.
        w_sq = tl.reduce(w * w, 0, tl.standard._sum_combine)
        u_sq = tl.reduce(u * u, 0, tl.standard._sum_combine)
        tl.atomic_add(norms_ptr + 2 * t, w_sq, sem="relaxed")
        tl.atomic_add(norms_ptr + 2 * t + 1, u_sq, sem="relaxed")
    else:
        w = w - lr * u
        if HAS_MASTER:
            tl.store(w_ptr + offs, w, mask=mask)
        tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


def _lamb_apply_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad (unread), exp_avg, exp_avg_sq, [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors,
    norms_ptr,  # fp32 [2 * n_tensors]: sum(w^2), sum(u^2) per tensor, from phase 1
    lr,
    eps,
    weight_decay,
    bc1,  # 1 - beta1**step (1 without bias correction)
    bc2_sqrt,  # sqrt(1 - beta2**step) (1 without bias correction)
    weight_norm_min,  # phi's clamp of ||w||: the paper's gamma_l
    weight_norm_max,  # ... and gamma_u (inf: no upper clamp)
    max_trust_ratio,  # upper clamp of the trust ratio (inf: none)
    P_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    HAS_MASTER: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    start = tl.load(chunk_index_ptr + pid).to(tl.int64) * BLOCK
    n = tl.load(numels_ptr + t)
    p_ptr = tl.load(ptrs_ptr + t).to(tl.pointer_type(P_DTYPE))
    m_ptr = tl.load(ptrs_ptr + 2 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
    v_ptr = tl.load(ptrs_ptr + 3 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
    if ALIGNED:
        n = tl.multiple_of(n, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n

    if HAS_MASTER:
        w_ptr = tl.load(ptrs_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = (m / bc1) / (tl.sqrt(v) / bc2_sqrt + eps) + weight_decay * w

    w_norm = tl.sqrt(tl.load(norms_ptr + 2 * t))
    u_norm = tl.sqrt(tl.load(norms_ptr + 2 * t + 1))
    phi = tl.minimum(tl.maximum(w_norm, weight_norm_min), weight_norm_max)
    trust = tl.where((w_norm > 0.0) & (u_norm > 0.0), phi / u_norm, 1.0)
    trust = tl.minimum(trust, max_trust_ratio)
    w = w - (lr * trust) * u

    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


_LAMB_MOMENTS = triton_kernel(_lamb_moments_kernel)
_LAMB_APPLY = triton_kernel(_lamb_apply_kernel)


def lamb_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for both LAMB kernels; a pure function of device and size.

    CUDA: 1024 elements and 4 warps, as for Adam (8 fp32 per thread = two 128-bit accesses per
    tensor, no spills at sm_80/sm_90 — see ``AOT_CONFIGS``); the per-program partial norms then
    cost one atomic per 1024 elements per norm. Interpreter: it pays per program instance, so one
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
            params, grads, exp_avgs, exp_avg_sqs, masters, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bc1=bc1, bc2_sqrt=bc2_sqrt, lo=lo, hi=hi,
            max_trust_ratio=max_trust_ratio, adapt=adapt, maximize=maximize, grad_scale=grad_scale,
        )  # fmt: skip
        return
    roles = [params, grads, exp_avgs, exp_avg_sqs]
    if masters:
        roles.append(masters)
    built = live_multi_tensor_table(roles, lamb_launch_config)
    if built is None:
        return
    table, block, num_warps = built
    scale = grad_scale if grad_scale is not None else table.numels  # placeholder pointer, unread
    norms = torch.zeros(2 * table.n_tensors if adapt else 1, dtype=torch.float32, device=device)
    p_dtype = torch_to_triton_dtype(params[0].dtype)
    s_dtype = torch_to_triton_dtype(exp_avgs[0].dtype)
    grid = (table.n_chunks,)
    _LAMB_MOMENTS[grid](
        table.ptrs, table.numels, table.chunk_tensor, table.chunk_index, table.n_tensors, scale, norms,
        lr, beta1, beta2, eps, weight_decay, bc1, bc2_sqrt,
        P_DTYPE=p_dtype, G_DTYPE=torch_to_triton_dtype(grads[0].dtype), S_DTYPE=s_dtype,
        MAXIMIZE=maximize, HAS_MASTER=bool(masters), HAS_GRAD_SCALE=grad_scale is not None,
        ADAPT=adapt, ALIGNED=table.aligned, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    if not adapt:
        return
    _LAMB_APPLY[grid](
        table.ptrs, table.numels, table.chunk_tensor, table.chunk_index, table.n_tensors, norms,
        lr, eps, weight_decay, bc1, bc2_sqrt, lo, hi, float(max_trust_ratio),
        P_DTYPE=p_dtype, S_DTYPE=s_dtype, HAS_MASTER=bool(masters),
        ALIGNED=table.aligned, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def _lamb_step_torch(
    params, grads, exp_avgs, exp_avg_sqs, masters, *, lr, beta1, beta2, eps, weight_decay, bc1,
    bc2_sqrt, lo, hi, max_trust_ratio, adapt, maximize, grad_scale,
) -> None:  # fmt: skip
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
    head = {
        "ptrs_ptr": "*i64", "numels_ptr": "*i64", "chunk_tensor_ptr": "*i32", "chunk_index_ptr": "*i32",
        "n_tensors": "i32",
    }  # fmt: skip
    sig1 = dict(head, grad_scale_ptr="*fp32", norms_ptr="*fp32", lr="fp32", beta1="fp32", beta2="fp32",
                eps="fp32", weight_decay="fp32", bc1="fp32", bc2_sqrt="fp32")  # fmt: skip
    sig2 = dict(head, norms_ptr="*fp32", lr="fp32", eps="fp32", weight_decay="fp32", bc1="fp32",
                bc2_sqrt="fp32", weight_norm_min="fp32", weight_norm_max="fp32",
                max_trust_ratio="fp32")  # fmt: skip
    ptrs = ["ptrs_ptr", "numels_ptr", "chunk_tensor_ptr", "chunk_index_ptr", "norms_ptr"]
    block, num_warps = lamb_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(ALIGNED=True, BLOCK=block)
    p1 = dict(base, MAXIMIZE=False, HAS_GRAD_SCALE=False, ADAPT=True)
    fp32 = dict(P_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False)
    bf16 = dict(P_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True)
    # bytes per element, fp32: phase 1 reads p, g, m, v + writes m, v (24); phase 2 reads p, m, v
    # + writes p (16). bf16 + master: phase 1 reads g(2), m, v, w + writes m, v (22); phase 2
    # reads m, v, w + writes w, p(2) (18).
    return [
        dict(kernel=_LAMB_MOMENTS, name="lamb_moments_fp32", signature=sig1,
             constexprs=dict(p1, G_DTYPE=tl.float32, **fp32), num_warps=num_warps,
             pointer_args=ptrs + ["grad_scale_ptr"], elements_per_program=block, bytes_per_element=24),
        dict(kernel=_LAMB_APPLY, name="lamb_apply_fp32", signature=sig2, constexprs=dict(base, **fp32),
             num_warps=num_warps, pointer_args=ptrs, elements_per_program=block, bytes_per_element=16),
        dict(kernel=_LAMB_MOMENTS, name="lamb_moments_bf16_master", signature=sig1,
             constexprs=dict(p1, G_DTYPE=tl.bfloat16, **bf16), num_warps=num_warps,
             pointer_args=ptrs + ["grad_scale_ptr"], elements_per_program=block, bytes_per_element=22),
        dict(kernel=_LAMB_APPLY, name="lamb_apply_bf16_master", signature=sig2, constexprs=dict(base, **bf16),
             num_warps=num_warps, pointer_args=ptrs, elements_per_program=block, bytes_per_element=18),
    ]  # fmt: skip


AOT_CONFIGS = _aot_configs
