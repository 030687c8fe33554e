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

__all__ = ["sgd_step", "sgd_launch_config"]


def _sgd_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, [momentum_buffer], [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    lr,
    momentum,
    dampening,
    weight_decay,
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
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    start = tl.load(chunk_index_ptr + pid).to(tl.int64) * BLOCK
    n = tl.load(numels_ptr + t)
    p_ptr = tl.load(ptrs_ptr + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(ptrs_ptr + n_tensors + t).to(tl.pointer_type(G_DTYPE))
    if ALIGNED:
        n = tl.multiple_of(n, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n

    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_MASTER:
        w_ptr = tl.load(ptrs_ptr + MASTER_ROW * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = g + weight_decay * w

    if HAS_MOMENTUM:
        b_ptr = tl.load(ptrs_ptr + 2 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
        if ALIGNED:
            b_ptr = tl.multiple_of(b_ptr, 16)
        if FIRST_STEP:
            buf = g
        else:
            buf = momentum * tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32) + (1.0 - dampening) * g
        tl.store(b_ptr + offs, buf.to(S_DTYPE), mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    w = w - lr * g

    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


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
            params, grads, momentum_buffers if has_momentum else [], masters, lr=lr,
            momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize, first_step=first_step, grad_scale=grad_scale,
        )  # fmt: skip
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
        table.ptrs, table.numels, table.chunk_tensor, table.chunk_index, table.n_tensors, scale,
        lr, momentum, dampening, weight_decay,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(s_dtype),
        HAS_MOMENTUM=has_momentum, FIRST_STEP=first_step, NESTEROV=nesterov, MAXIMIZE=maximize,
        HAS_MASTER=bool(masters), MASTER_ROW=master_row, HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=table.aligned, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def _sgd_step_torch(
    params, grads, momentum_buffers, masters, *, lr, momentum, dampening, weight_decay, nesterov,
    maximize, first_step, grad_scale,
) -> None:  # fmt: skip
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
        w, gs, b, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=first_step, grad_scale=grad_scale,
    )  # fmt: skip
    if b is not bufs:
        torch._foreach_copy_(bufs, b)
    if w is not targets:
        torch._foreach_copy_(targets, w)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    sig = {
        "ptrs_ptr": "*i64", "numels_ptr": "*i64", "chunk_tensor_ptr": "*i32", "chunk_index_ptr": "*i32",
        "n_tensors": "i32", "grad_scale_ptr": "*fp32", "lr": "fp32", "momentum": "fp32",
        "dampening": "fp32", "weight_decay": "fp32",
    }  # fmt: skip
    pointer_args = ["ptrs_ptr", "numels_ptr", "chunk_tensor_ptr", "chunk_index_ptr", "grad_scale_ptr"]
    block, num_warps = sgd_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(HAS_MOMENTUM=True, FIRST_STEP=False, NESTEROV=False, MAXIMIZE=False, HAS_GRAD_SCALE=False,
                ALIGNED=True, BLOCK=block)
    fp32 = dict(base, P_DTYPE=tl.float32, G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False, MASTER_ROW=3)
    bf16 = dict(base, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True, MASTER_ROW=3)
    # bytes per element: fp32 read p, g, buf + write p, buf = 20; bf16+master read g(2), buf, w
    # + write p(2), buf, w = 20.
    return [
        dict(kernel=_SGD, name="sgd_momentum_fp32", signature=sig, constexprs=fp32, num_warps=num_warps,
             pointer_args=pointer_args, elements_per_program=block, bytes_per_element=20),
        dict(kernel=_SGD, name="sgd_momentum_bf16_master", signature=sig, constexprs=bf16, num_warps=num_warps,
             pointer_args=pointer_args, elements_per_program=block, bytes_per_element=20),
    ]  # fmt: skip


AOT_CONFIGS = _aot_configs
