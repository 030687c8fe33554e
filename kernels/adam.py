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

__all__ = ["adam_step", "adam_launch_config"]


def _adam_kernel(
    ptrs_ptr,  # int64 [n_roles, n_tensors]: param, grad, exp_avg, exp_avg_sq, [max_exp_avg_sq], [master]
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    n_tensors,
    grad_scale_ptr,  # fp32 [1]; read only when HAS_GRAD_SCALE
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step_size,  # lr / (1 - beta1**step)
    bc2_sqrt,  # sqrt(1 - beta2**step)
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr,  # exp_avg / exp_avg_sq dtype
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
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
        w_ptr = tl.load(ptrs_ptr + MASTER_ROW * n_tensors + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DECOUPLED:
        w = w * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * w

    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(m_ptr + offs, m.to(S_DTYPE), mask=mask)
    tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)
    if AMSGRAD:
        vmax_ptr = tl.load(ptrs_ptr + 4 * n_tensors + t).to(tl.pointer_type(S_DTYPE))
        if ALIGNED:
            vmax_ptr = tl.multiple_of(vmax_ptr, 16)
        v = tl.maximum(tl.load(vmax_ptr + offs, mask=mask, other=0.0).to(tl.float32), v)
        tl.store(vmax_ptr + offs, v.to(S_DTYPE), mask=mask)
    w = w - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)

    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)


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
        grad_scale: a 1-element fp32 tensor to divide grads by (``torch.amp.GradScaler``).
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
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters,
            step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
        )  # fmt: skip
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
        table.ptrs, table.numels, table.chunk_tensor, table.chunk_index, table.n_tensors, scale,
        lr, beta1, beta2, eps, weight_decay, lr / bc1, bc2**0.5,
        P_DTYPE=torch_to_triton_dtype(params[0].dtype),
        G_DTYPE=torch_to_triton_dtype(grads[0].dtype),
        S_DTYPE=torch_to_triton_dtype(exp_avgs[0].dtype),
        DECOUPLED=decoupled, AMSGRAD=amsgrad, MAXIMIZE=maximize,
        HAS_MASTER=bool(masters), MASTER_ROW=master_row, HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=table.aligned, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def _adam_step_torch(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, *, step, lr, beta1, beta2,
    eps, weight_decay, decoupled, amsgrad, maximize, grad_scale,
) -> None:  # fmt: skip
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
        work[0], gs, work[1], work[2], work[3], steps, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
    )  # fmt: skip
    if lowp:
        for dst, src in zip(stored, work):
            if dst:
                torch._foreach_copy_(dst, src)
    if masters:
        torch._foreach_copy_(list(params), list(masters))


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    import triton.language as tl

    sig = {
        "ptrs_ptr": "*i64", "numels_ptr": "*i64", "chunk_tensor_ptr": "*i32", "chunk_index_ptr": "*i32",
        "n_tensors": "i32", "grad_scale_ptr": "*fp32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32",
        "eps": "fp32", "weight_decay": "fp32", "step_size": "fp32", "bc2_sqrt": "fp32",
    }  # fmt: skip
    block, num_warps = adam_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(DECOUPLED=True, AMSGRAD=False, MAXIMIZE=False, HAS_GRAD_SCALE=False, ALIGNED=True, BLOCK=block)
    fp32 = dict(base, P_DTYPE=tl.float32, G_DTYPE=tl.float32, S_DTYPE=tl.float32, HAS_MASTER=False, MASTER_ROW=4)
    bf16 = dict(base, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, S_DTYPE=tl.float32, HAS_MASTER=True, MASTER_ROW=4)
    return [
        dict(kernel=_ADAM, name="adamw_fp32", signature=sig, constexprs=fp32, num_warps=num_warps,
             pointer_args=["ptrs_ptr", "numels_ptr", "chunk_tensor_ptr", "chunk_index_ptr", "grad_scale_ptr"],
             elements_per_program=block, bytes_per_element=28),
        dict(kernel=_ADAM, name="adamw_bf16_master", signature=sig, constexprs=bf16, num_warps=num_warps,
             pointer_args=["ptrs_ptr", "numels_ptr", "chunk_tensor_ptr", "chunk_index_ptr", "grad_scale_ptr"],
             elements_per_program=block, bytes_per_element=28),
    ]  # fmt: skip


AOT_CONFIGS = _aot_configs
