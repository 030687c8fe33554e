"""Multi-tensor Adam / AdamW step: one launch updates every tensor of a launch group.

Math (Kingma & Ba 2015; Loshchilov & Hutter 2019 for the decoupled decay), per element, fp32:

    g  = grad / grad_scale            (if a GradScaler scale is given)
    g  = -g                           (if maximize)
    w  = w * (1 - lr * wd)            (AdamW, decoupled)   |   g = g + wd * w   (Adam, L2)
    m  = b1 * m + (1 - b1) * g
    v  = b2 * v + (1 - b2) * g^2
    v̂  = max(v̂, v)                    (amsgrad; v̂ is ``max_exp_avg_sq``)
    w  = w - lr / (1 - b1^t) * m / (sqrt(v or v̂) / sqrt(1 - b2^t) + eps)

``w`` is the fp32 master copy when one is kept (bf16/fp16 params with ``master_weights``); the
param is then written as ``w`` rounded to its dtype in the same pass.

Shapes/dtypes: every list has one tensor per parameter, contiguous, same numel in every list.
params fp32/fp16/bf16; grads fp32/fp16/bf16; exp_avg/exp_avg_sq/max_exp_avg_sq fp32 when a master
copy is kept, else the param dtype; masters fp32.
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

__all__ = ["adam_step", "adam_launch_config"]


def _adam_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, exp_avg, exp_avg_sq, [max_exp_avg_sq], [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors: tl.int32,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    lr: tl.float32,
    beta1: tl.float32,
    beta2: tl.float32,
    eps: tl.float32,
    weight_decay: tl.float32,
    step_size: tl.float32,  # lr / (1 - beta1**step)
    bc2_sqrt: tl.float32,  # sqrt(1 - beta2**step)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
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
    m_ptr = role_ptr(ptrs_ptr, 2, n_tensors, t, S_DTYPE, ALIGNED)
    v_ptr = role_ptr(ptrs_ptr, 3, n_tensors, t, S_DTYPE, ALIGNED)

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
    if DECOUPLED:
        w = w * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * w

    m = beta1 * load_chunk(m_ptr, offs, n, full) + (1.0 - beta1) * g
    v = beta2 * load_chunk(v_ptr, offs, n, full) + (1.0 - beta2) * g * g
    store_chunk(m_ptr, offs, m, n, full)
    store_chunk(v_ptr, offs, v, n, full)
    if AMSGRAD:
        vmax_ptr = role_ptr(ptrs_ptr, 4, n_tensors, t, S_DTYPE, ALIGNED)
        v = tl.maximum(load_chunk(vmax_ptr, offs, n, full), v)
        store_chunk(vmax_ptr, offs, v, n, full)
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)

    if HAS_MASTER:
        store_chunk(w_ptr, offs, w, n, full)
    store_chunk(p_ptr, offs, w, n, full)


_ADAM = triton_kernel(_adam_kernel)


def adam_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for the Adam kernel; a pure function of device and size.

    CUDA: 1024 elements and 4 warps (8 fp32 per thread = two 128-bit accesses per tensor, no
    spills at sm_80/sm_90; see ``perf/results/kernel_report.json``). Interpreter: the interpreter
    pays per program instance, so one large block per tensor up to 2^16 elements.
    """
    return elementwise_launch_config(device, max_numel)


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    *,
    step: float | torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Apply one Adam/AdamW step in place to a launch group of tensors.

    Args:
        params: parameters (fp32/fp16/bf16), all one dtype and device, dense (contiguous or
            e.g. channels_last; states and masters laid out like their param).
        grads: gradients, one dtype, same shapes as ``params``.
        exp_avgs, exp_avg_sqs: first/second moments (updated in place).
        max_exp_avg_sqs: running max of ``exp_avg_sq`` when ``amsgrad``, else empty.
        masters: fp32 master copies when kept (then ``params`` are written as their rounding),
            else empty.
        step: the step number *after* this update (1 on the first step), for bias correction;
            a 0-d float32 tensor holding it (e.g. the optimizer's ``state["step"]``) goes to
            torch's fused op as is, saving a tensor allocation per call.
        grad_scale: a 1-element fp32 tensor to divide grads by (``torch.amp.GradScaler``). The
            Triton kernel only reads ``grads``; the torch backend, like
            ``torch.optim.AdamW(fused=True)``, unscales fp32 ``grads`` in place.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Example:
        >>> adam_step([p], [p.grad], [m], [v], [], [], step=1, lr=1e-3, beta1=0.9,
        ...           beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
        ...           amsgrad=False, maximize=False)
    """
    if not params:
        return
    device = params[0].device
    # both executors (and torch's fused CPU op) address tensors as flat memory: a grad must share
    # its param's memory order (always true for autograd's grads of contiguous params)
    grads = [g if g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g) for g, p in zip(grads, params)]
    step_value = float(step)
    bc1 = 1.0 - beta1**step_value
    bc2 = 1.0 - beta2**step_value
    if resolve_backend(backend, device) == "torch":
        _adam_step_torch(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            masters,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
            amsgrad=amsgrad,
            maximize=maximize,
            grad_scale=grad_scale,
        )
        return
    roles = [params, grads, exp_avgs, exp_avg_sqs]
    if amsgrad:
        roles.append(max_exp_avg_sqs)
    master_row = len(roles)
    if masters:
        roles.append(masters)
    built = live_multi_tensor_table(roles, adam_launch_config)
    if built is None:
        return
    table, block, num_warps = built
    scale = grad_scale if grad_scale is not None else table.numels  # placeholder pointer, unread
    _ADAM[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        table.n_tensors,
        scale,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        lr / bc1,
        bc2**0.5,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(exp_avgs[0].dtype),
        DECOUPLED=decoupled,
        AMSGRAD=amsgrad,
        MAXIMIZE=maximize,
        HAS_MASTER=bool(masters),
        MASTER_ROW=master_row,
        HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=table.aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def _adam_step_torch(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    masters,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled,
    amsgrad,
    maximize,
    grad_scale,
) -> None:
    """CPU/any-device fast path: torch's own fused Adam(W) on fp32 (master or upcast) tensors.

    fp16/bf16 params and state without a master copy are upcast and written back rounded, as the
    kernel does; running the fused op on them directly would first round fp32 grads to the param
    dtype, which the kernel never does.
    """
    targets = list(masters) if masters else list(params)
    stored = [targets, list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs) if amsgrad else []]
    lowp = targets[0].dtype != torch.float32
    work = [[t.float() for t in role] for role in stored] if lowp else stored
    # a launch group has one grad dtype: the first grad decides for all
    gs = list(grads) if grads[0].dtype == work[0][0].dtype else [g.to(work[0][0].dtype) for g in grads]
    if not (isinstance(step, torch.Tensor) and step.device == targets[0].device):
        step = torch.tensor(float(step), device=targets[0].device)
    steps = [step] * len(targets)
    op = torch._fused_adamw_ if decoupled else torch._fused_adam_
    op(
        work[0],
        gs,
        work[1],
        work[2],
        work[3],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=grad_scale,
    )
    if lowp:
        for dst, src in zip(stored, work):
            if dst:
                torch._foreach_copy_(dst, src)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = adam_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(DECOUPLED=True, AMSGRAD=False, MAXIMIZE=False, HAS_GRAD_SCALE=False, ALIGNED=True, BLOCK=block)
    fp32 = dict(base, P_DTYPE=tl.float32, G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False, MASTER_ROW=4)
    bf16 = dict(base, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True, MASTER_ROW=4)
    common = dict(kernel=_ADAM, pointers={"grad_scale_ptr": "*fp32"}, num_warps=num_warps, elements_per_program=block)
    # bytes per element: fp32 read p, g, m, v + write p, m, v = 28; bf16+master read g(2), m, v,
    # w + write p(2), m, v, w = 28 (docs/reference.md, "Optimizer bytes per parameter").
    return [
        dict(common, name="adamw_fp32", constexprs=fp32, bytes_per_element=28),
        dict(common, name="adamw_bf16_master", constexprs=bf16, bytes_per_element=28),
    ]


AOT_CONFIGS = _aot_configs
