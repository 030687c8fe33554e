"""Multi-tensor SGD (with momentum / Nesterov) step: one launch per launch group.

Math (``torch.optim.SGD``; Sutskever et al. 2013 for the Nesterov form), per element, fp32:

    g   = grad / grad_scale             (if a GradScaler scale is given)
    g   = -g                            (if maximize)
    g   = g + wd * w                    (L2 weight decay, coupled as in torch)
    buf = g                             (first step with momentum: the buffer starts as g)
    buf = mu * buf + (1 - dampening) * g   (later steps)
    g   = g + mu * buf   (nesterov)   |   g = buf   (plain momentum)
    w   = w - lr * g

``w`` is the fp32 master copy when one is kept (bf16/fp16 params with ``master_weights``); the
param is then written as ``w`` rounded to its dtype in the same pass. With ``momentum == 0``
there is no buffer (nothing is read or written for it, as in torch).

Shapes/dtypes: every list has one tensor per parameter, contiguous, same numel in every list.
params fp32/fp16/bf16; grads fp32/fp16/bf16; momentum buffers fp32 when a master copy is kept,
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
from .tl_helpers import load_chunk, program_chunk, role_ptr, store_chunk

__all__ = ["sgd_step", "sgd_launch_config"]


def _sgd_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, [momentum_buffer], [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    lr: tl.float32,
    momentum: tl.float32,
    dampening: tl.float32,
    weight_decay: tl.float32,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # momentum buffer dtype
    HAS_MOMENTUM: tl.constexpr,  # momentum != 0: a buffer row follows the grads
    FIRST_STEP: tl.constexpr,  # buffers are uninitialised: write buf = g
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    MASTER_ROW: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every pointer 16-byte aligned ([Note: aligned full chunks])
    BLOCK: tl.constexpr,
):
    t, _, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    p_ptr = role_ptr(ptrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
    g_ptr = role_ptr(ptrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)

    g = load_chunk(g_ptr, offs, n, full)
    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w_ptr = role_ptr(ptrs_ptr, MASTER_ROW, n_tensors, t, tl.float32, ALIGNED)
        w = load_chunk(w_ptr, offs, n, full)
    else:
        w = load_chunk(p_ptr, offs, n, full)
    g = g + weight_decay * w

    if HAS_MOMENTUM:
        b_ptr = role_ptr(ptrs_ptr, 2, n_tensors, t, S_DTYPE, ALIGNED)
        if FIRST_STEP:
            buf = g
        else:
            buf = momentum * load_chunk(b_ptr, offs, n, full) + (1.0 - dampening) * g
        store_chunk(b_ptr, offs, buf, n, full)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    w = w - lr * g

    if HAS_MASTER:
        store_chunk(w_ptr, offs, w, n, full)
    store_chunk(p_ptr, offs, w, n, full)


_SGD = triton_kernel(_sgd_kernel)


def sgd_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for the SGD kernel; a pure function of device and size.

    CUDA: 1024 elements and 4 warps, as for Adam (8 fp32 per thread = two 128-bit accesses per
    tensor; SGD holds fewer live values, so no spills at sm_80/sm_90 — see ``AOT_CONFIGS``).
    Interpreter: it pays per program instance, so one large block per tensor up to 2^16.

    Example:
        >>> sgd_launch_config(torch.device("cuda"), 1 << 20)
        (1024, 4)
    """
    return elementwise_launch_config(device, max_numel)


def sgd_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
    grad_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Apply one SGD step in place to a launch group of tensors.

    Args:
        params: parameters (fp32/fp16/bf16), all one dtype and device, dense (contiguous or
            e.g. channels_last; grads, states and masters laid out like their param).
        grads: gradients, one dtype, same shapes as ``params``.
        momentum_buffers: one buffer per param when ``momentum != 0`` (updated in place; on
            ``first_step`` their contents are ignored and overwritten with the gradient), else
            empty.
        masters: fp32 master copies when kept (then ``params`` are written as their rounding),
            else empty.
        first_step: the buffers have not been initialised yet (torch's ``momentum_buffer is
            None``).
        grad_scale: a 1-element fp32 tensor to divide grads by (``torch.amp.GradScaler``). The
            torch backend, like ``torch.optim.SGD(fused=True)``, unscales fp32 ``grads`` in place.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Example:
        >>> buf = torch.empty_like(p)
        >>> sgd_step([p], [p.grad], [buf], [], lr=0.1, momentum=0.9, dampening=0.0,
        ...          weight_decay=0.0, nesterov=True, maximize=False, first_step=True)
    """
    if not params:
        return
    has_momentum = momentum != 0.0
    if has_momentum and len(momentum_buffers) != len(params):
        raise ValueError(
            f"momentum={momentum} needs one momentum buffer per param: got {len(momentum_buffers)} "
            f"buffers for {len(params)} params"
        )
    device = params[0].device
    if resolve_backend(backend, device) == "torch":
        _sgd_step_torch(
            params,
            grads,
            momentum_buffers if has_momentum else [],
            masters,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            first_step=first_step,
            grad_scale=grad_scale,
        )
        return
    roles = [params, grads]
    if has_momentum:
        roles.append(momentum_buffers)
    master_row = len(roles)
    if masters:
        roles.append(masters)
    built = live_multi_tensor_table(roles, sgd_launch_config)
    if built is None:
        return
    table, block, num_warps = built
    scale = grad_scale if grad_scale is not None else table.numels  # placeholder pointer, unread
    s_dtype = momentum_buffers[0].dtype if has_momentum else params[0].dtype
    _SGD[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        table.n_tensors,
        scale,
        lr,
        momentum,
        dampening,
        weight_decay,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(s_dtype),
        HAS_MOMENTUM=has_momentum,
        FIRST_STEP=first_step,
        NESTEROV=nesterov,
        MAXIMIZE=maximize,
        HAS_MASTER=bool(masters),
        MASTER_ROW=master_row,
        HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=table.aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def _sgd_step_torch(
    params,
    grads,
    momentum_buffers,
    masters,
    *,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    maximize,
    first_step,
    grad_scale,
) -> None:
    """CPU/any-device fast path: ``torch._fused_sgd_`` on fp32 (master or upcast) tensors.

    torch 2.13's fused CPU SGD skips the update of every full SIMD vector of an fp16/bf16 tensor
    (pytorch/pytorch#191763, fixed by #192545 after 2.13), so it only ever sees fp32 here:
    fp16/bf16 params and buffers without a master copy are upcast and written back rounded, the
    kernel's own numerics.
    """
    targets = list(masters) if masters else list(params)
    bufs = list(momentum_buffers)
    w = targets if targets[0].dtype == torch.float32 else [t.float() for t in targets]
    b = bufs if not bufs or bufs[0].dtype == torch.float32 else [t.float() for t in bufs]
    gs = [g.float() for g in grads]
    torch._fused_sgd_(
        w,
        gs,
        b,
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
        is_first_step=first_step,
        grad_scale=grad_scale,
    )
    if b is not bufs:
        torch._foreach_copy_(bufs, b)
    if w is not targets:
        torch._foreach_copy_(targets, w)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = sgd_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(
        HAS_MOMENTUM=True, FIRST_STEP=False, NESTEROV=False, MAXIMIZE=False, HAS_GRAD_SCALE=False, ALIGNED=True, BLOCK=block
    )
    fp32 = dict(base, P_DTYPE=tl.float32, G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False, MASTER_ROW=3)
    bf16 = dict(base, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True, MASTER_ROW=3)
    common = dict(kernel=_SGD, pointers={"grad_scale_ptr": "*fp32"}, num_warps=num_warps, elements_per_program=block)
    # bytes per element: fp32 read p, g, buf + write p, buf = 20; bf16+master read g(2), buf, w
    # + write p(2), buf, w = 20.
    return [
        dict(common, name="sgd_momentum_fp32", constexprs=fp32, bytes_per_element=20),
        dict(common, name="sgd_momentum_bf16_master", constexprs=bf16, bytes_per_element=20),
    ]


AOT_CONFIGS = _aot_configs
