"""Multi-tensor Lion step: one launch per launch group.

Math (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2), per
element, fp32:

    g = grad / grad_scale             (if a GradScaler scale is given)
    g = -g                            (if maximize)
    c = b1 * m + (1 - b1) * g         (the update direction's interpolation)
    w = w * (1 - lr * wd) - lr * sign(c)     (decoupled weight decay; sign(0) = 0)
    m = b2 * m + (1 - b2) * g

``w`` is the fp32 master copy when one is kept (bf16/fp16 params with ``master_weights``); the
param is then written as ``w`` rounded to its dtype in the same pass.

Shapes/dtypes: every list has one tensor per parameter, contiguous, same numel in every list.
params fp32/fp16/bf16; grads fp32/fp16/bf16; exp_avg fp32 when a master copy is kept, else the
param dtype; masters fp32.
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
from .tl_helpers import load_chunk, program_chunk, role_ptr, store_chunk

__all__ = ["lion_step", "lion_launch_config"]


def _lion_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, exp_avg, [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    lr: tl.float32,
    beta1: tl.float32,
    beta2: tl.float32,
    weight_decay: tl.float32,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg dtype
    MAXIMIZE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every pointer 16-byte aligned ([Note: aligned full chunks])
    BLOCK: tl.constexpr,
):
    t, _, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    p_ptr = role_ptr(ptrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
    g_ptr = role_ptr(ptrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
    m_ptr = role_ptr(ptrs_ptr, 2, n_tensors, t, S_DTYPE, ALIGNED)

    g = load_chunk(g_ptr, offs, n, full)
    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w_ptr = role_ptr(ptrs_ptr, 3, n_tensors, t, tl.float32, ALIGNED)
        w = load_chunk(w_ptr, offs, n, full)
    else:
        w = load_chunk(p_ptr, offs, n, full)
    m = load_chunk(m_ptr, offs, n, full)

    c = beta1 * m + (1.0 - beta1) * g
    direction = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0))
    w = w * (1.0 - lr * weight_decay) - lr * direction
    m = beta2 * m + (1.0 - beta2) * g
    store_chunk(m_ptr, offs, m, n, full)

    if HAS_MASTER:
        store_chunk(w_ptr, offs, w, n, full)
    store_chunk(p_ptr, offs, w, n, full)


_LION = triton_kernel(_lion_kernel)


def lion_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for the Lion kernel; a pure function of device and size.

    CUDA: 1024 elements and 4 warps (8 fp32 per thread = two 128-bit accesses per tensor, no
    spills at sm_80/sm_90 — see ``AOT_CONFIGS``). Interpreter: it pays per program instance, so
    one large block per tensor up to 2^16 elements.

    Example:
        >>> lion_launch_config(torch.device("cuda"), 1 << 20)
        (1024, 4)
    """
    return elementwise_launch_config(device, max_numel)


def lion_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Apply one Lion step in place to a launch group of tensors.

    Args:
        params: parameters (fp32/fp16/bf16), all one dtype and device, dense (contiguous or
            e.g. channels_last; grads, states and masters laid out like their param).
        grads: gradients, one dtype, same shapes as ``params``.
        exp_avgs: the momentum ``m`` (updated in place).
        masters: fp32 master copies when kept (then ``params`` are written as their rounding),
            else empty.
        grad_scale: a 1-element fp32 tensor to divide grads by (``torch.amp.GradScaler``).
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`. The torch path runs
            ``torch._foreach_*`` ops in fp32 (fp16/bf16 tensors are upcast and written back),
            so it rounds like the kernel.

    Example:
        >>> m = torch.zeros_like(p)
        >>> lion_step([p], [p.grad], [m], [], lr=1e-4, beta1=0.9, beta2=0.99,
        ...           weight_decay=0.1, maximize=False)
    """
    if not params:
        return
    device = params[0].device
    if resolve_backend(backend, device) == "torch":
        _lion_step_torch(
            params,
            grads,
            exp_avgs,
            masters,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            maximize=maximize,
            grad_scale=grad_scale,
        )
        return
    roles = [params, grads, exp_avgs]
    if masters:
        roles.append(masters)
    built = live_multi_tensor_table(roles, lion_launch_config)
    if built is None:
        return
    table, block, num_warps = built
    scale = grad_scale if grad_scale is not None else table.numels  # placeholder pointer, unread
    _LION[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        table.n_tensors,
        scale,
        lr,
        beta1,
        beta2,
        weight_decay,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(exp_avgs[0].dtype),
        MAXIMIZE=maximize,
        HAS_MASTER=bool(masters),
        HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=table.aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def _lion_step_torch(
    params,
    grads,
    exp_avgs,
    masters,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    maximize,
    grad_scale,
) -> None:
    """CPU/any-device fast path: ``torch._foreach_*`` ops on fp32 (master or upcast) tensors."""
    targets = list(masters) if masters else list(params)
    stored = list(exp_avgs)
    w = targets if targets[0].dtype == torch.float32 else [t.float() for t in targets]
    m = stored if stored[0].dtype == torch.float32 else [t.float() for t in stored]
    g = [x.float() for x in grads]  # a copy when grads are fp16/bf16; never written in place
    if grad_scale is not None:
        g = torch._foreach_div(g, grad_scale.reshape(()))
    if maximize:
        g = torch._foreach_neg(g)
    c = torch._foreach_mul(m, beta1)
    torch._foreach_add_(c, g, alpha=1.0 - beta1)
    torch._foreach_sign_(c)
    if weight_decay != 0.0:
        torch._foreach_mul_(w, 1.0 - lr * weight_decay)
    torch._foreach_add_(w, c, alpha=-lr)
    torch._foreach_mul_(m, beta2)
    torch._foreach_add_(m, g, alpha=1.0 - beta2)
    if m is not stored:
        torch._foreach_copy_(stored, m)
    if w is not targets:
        torch._foreach_copy_(targets, w)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = lion_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(MAXIMIZE=False, HAS_GRAD_SCALE=False, ALIGNED=True, BLOCK=block)
    fp32 = dict(base, P_DTYPE=tl.float32, G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False)
    bf16 = dict(base, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True)
    common = dict(kernel=_LION, pointers={"grad_scale_ptr": "*fp32"}, num_warps=num_warps, elements_per_program=block)
    # bytes per element: fp32 read p, g, m + write p, m = 20; bf16+master read g(2), m, w + write
    # p(2), m, w = 20.
    return [
        dict(common, name="lion_fp32", constexprs=fp32, bytes_per_element=20),
        dict(common, name="lion_bf16_master", constexprs=bf16, bytes_per_element=20),
    ]


AOT_CONFIGS = _aot_configs
