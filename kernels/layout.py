"""The one home for the floating dtypes shardkit's kernels take and for dense-layout checks.

Multi-tensor kernels address every tensor they touch (param, grad, optimizer state, flat
buffers) as flat memory, so what matters about a tensor's layout is only whether its elements
fill ``numel()`` consecutive slots (``is_dense``) and whether two tensors walk that memory in
the same order (``same_layout``). Contiguous and permuted layouts such as channels_last are
both dense; strided slices are not.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_DTYPES", "is_dense", "same_layout"]

#: Floating dtypes every kernel family loads and stores (math is always fp32 inside).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``t.numel()`` consecutive slots in some dimension order.

    Args:
        t: any strided tensor, any dtype and shape (0-d and empty tensors are dense).

    Returns:
        Whether a kernel may treat ``t``'s storage from ``t.data_ptr()`` as ``t.numel()`` flat
        elements. Contiguous and permuted layouts (channels_last, transposes) qualify; strided
        slices do not.

    Example:
        >>> x = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
        >>> is_dense(x), is_dense(x[:, :, ::2])
        (True, False)
    """
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue  # a size-1 dim's stride is irrelevant
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def same_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it has ``like``'s strides, else a copy of ``t`` laid out like ``like``.

    Multi-tensor kernels address param, grad and state as flat memory, so all must share one
    memory order (contiguous, or e.g. channels_last for every one of them).

    Args:
        t: tensor with ``like``'s shape, any dtype (kept).
        like: dense tensor whose strides the result takes.

    Returns:
        ``t`` (no copy) or a new tensor of ``t``'s dtype with ``like``'s strides and ``t``'s values.

    Example:
        >>> p = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
        >>> g = same_layout(torch.ones(2, 3, 4, 5), p)
        >>> g.stride() == p.stride()
        True
    """
    return t if t.stride() == like.stride() else torch.empty_like(like, dtype=t.dtype).copy_(t)
