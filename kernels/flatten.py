"""Gradient buckets: copy many tensors into / out of one flat 1-D buffer in one launch.

Math, per tensor ``i`` with ``n_i`` elements at element offset ``o_i`` of the bucket ``flat``:

    flatten_into:    flat[o_i + k] = cast_flat(s * t_i[k])        k < n_i
    unflatten_from:  t_i[k]        = cast_t(s * flat[o_i + k])    k < n_i

``s`` is an optional multiplier (``1/world_size`` to average after an all-reduce, a loss-scale
inverse, a pre-divide factor), applied in fp32 in the same pass, so averaging costs no extra
read/write of the bucket. Without ``s`` the copy is exact (a cast when the dtypes differ).

[Note: bucket layout]
DataParallel and ZeRO share one layout, computed by the pure :func:`bucket_layout`: tensors in
order, each offset rounded up to ``align`` elements (``ALIGN_ELEMENTS`` = 16 keeps every slot on
a 16-byte boundary for fp32/fp16/bf16, so the kernels use 128-bit accesses), and the total
rounded up to ``pad_to_multiple_of`` (``world_size * ALIGN_ELEMENTS`` makes the bucket split into
equal, aligned reduce-scatter shards). Gaps and the tail padding are never written by these
kernels; :func:`flatten` allocates them zeroed and they must stay zero, so they add nothing to an
all-reduce, a norm, or an inf/nan check run over the whole bucket. :func:`shard_segments` maps a
ZeRO shard ``[start, stop)`` back to ``(tensor, range)`` pieces, and :func:`bucket_views` gives
per-tensor views of a bucket (``gradient_as_bucket_view``-style grads, or the per-parameter
inputs of :func:`shardkit.kernels.grad_epilogue.unscale_and_norm_`).

Shapes/dtypes: ``tensors`` are contiguous, on ``flat``'s device, all one dtype (fp32/fp16/bf16;
a launch specializes on it, so mixed-dtype models use one bucket per dtype, as torch DDP does).
``flat`` is a contiguous 1-D fp32/fp16/bf16 tensor, possibly of another dtype (the copy casts).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .runtime import Backend, multi_tensor_table, resolve_backend, torch_to_triton_dtype, triton_kernel
from .tl_helpers import load_chunk, program_chunk, role_ptr, store_chunk

__all__ = [
    "ALIGN_ELEMENTS",
    "Segment",
    "bucket_layout",
    "bucket_views",
    "shard_segments",
    "flatten",
    "flatten_into",
    "unflatten_from",
    "flatten_launch_config",
    "AOT_CONFIGS",
]

ALIGN_ELEMENTS = 16
"""Slot alignment (elements) that lets the copy kernels use 128-bit accesses for every dtype."""

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _flat_copy_kernel(
    ptrs_ptr,  # int64 [1, n_tensors]: data pointers of the tensors
    numels_ptr,  # int64 [n_tensors]
    chunk_tensor_ptr,  # int32 [grid]: tensor index of this program
    chunk_index_ptr,  # int32 [grid]: chunk of BLOCK elements within that tensor
    offsets_ptr,  # int64 [n_tensors]: element offset of each tensor's slot in flat
    flat_ptr,  # the 1-D bucket
    scale_ptr,  # fp32 [1]; read only when SCALE == 2
    scale: tl.float32,  # used only when SCALE == 1
    T_DTYPE: tl.constexpr,  # dtype of the tensors
    TO_FLAT: tl.constexpr,  # True: tensors -> flat; False: flat -> tensors
    SCALE: tl.constexpr,  # 0: plain copy, 1: multiply by `scale`, 2: multiply by *scale_ptr
    ALIGNED: tl.constexpr,  # tensor pointers and flat slots all 16-byte aligned
    BLOCK: tl.constexpr,
):
    t, _, offs, n, full = program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK)
    t_ptr = role_ptr(ptrs_ptr, 0, 0, t, T_DTYPE, ALIGNED)
    f_ptr = flat_ptr + tl.load(offsets_ptr + t)
    if ALIGNED:
        f_ptr = tl.multiple_of(f_ptr, 16)
    if TO_FLAT:
        src = t_ptr
        dst = f_ptr
    else:
        src = f_ptr
        dst = t_ptr
    # Full chunks are unmasked, so they vectorize whatever the tensor sizes are (a mask on an odd
    # size would make the whole launch scalar); only tails are masked.
    if SCALE == 0 and src.dtype == dst.dtype:  # a plain copy moves the bits, NaN payloads included
        if full:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
    else:  # through fp32 (exact for every dtype here), rounded once, to nearest even, on the store
        x = load_chunk(src, offs, n, full)
        if SCALE == 1:
            x = x * scale
        if SCALE == 2:
            x = x * tl.load(scale_ptr)
        store_chunk(dst, offs, x, n, full)


_FLAT_COPY = triton_kernel(_flat_copy_kernel)


class Segment(NamedTuple):
    """The part of tensor ``index`` that lies in a shard of a bucket (see :func:`shard_segments`).

    Elements ``[tensor_offset, tensor_offset + numel)`` of the flattened tensor sit at bucket
    elements ``[flat_offset, flat_offset + numel)``.
    """

    index: int
    tensor_offset: int
    flat_offset: int
    numel: int


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket_layout(numels: Sequence[int], *, align: int = 1, pad_to_multiple_of: int = 1) -> tuple[tuple[int, ...], int]:
    """Element offsets of tensors packed in order into one bucket, and the bucket size.

    ``o_0 = 0``, ``o_i = roundup(o_{i-1} + n_{i-1}, align)``,
    ``total = roundup(o_last + n_last, pad_to_multiple_of)``. See [Note: bucket layout].

    Args:
        numels: element count of each tensor (``>= 0``).
        align: every offset is a multiple of this many elements (``ALIGN_ELEMENTS`` for 128-bit
            kernel accesses; 1 packs densely, like ``torch._utils._flatten_dense_tensors``).
        pad_to_multiple_of: the total is a multiple of this (``world_size * align`` for a
            reduce-scatter into equal, aligned shards).

    Returns:
        ``(offsets, total)``: a tuple of int offsets, one per tensor, and the bucket length.

    Raises:
        ValueError: a negative numel, or ``align``/``pad_to_multiple_of`` below 1.

    Example:
        >>> bucket_layout([3, 20, 5], align=16, pad_to_multiple_of=64)
        ((0, 16, 48), 64)
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    offsets: list[int] = []
    end = 0
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}] must be >= 0, got {n}")
        offsets.append(_round_up(end, align))
        end = offsets[-1] + int(n)
    return tuple(offsets), _round_up(end, pad_to_multiple_of)


def shard_segments(offsets: Sequence[int], numels: Sequence[int], *, start: int, stop: int) -> list[Segment]:
    """The pieces of each tensor that fall in bucket elements ``[start, stop)`` (a ZeRO shard).

    With ``shard = flat.numel() // world_size``, rank ``r`` owns ``[r * shard, (r + 1) * shard)``;
    its optimizer state covers exactly these segments (padding belongs to no tensor).

    Args:
        offsets, numels: the bucket layout (see :func:`bucket_layout`).
        start, stop: the shard, as bucket element indices, ``0 <= start <= stop``.

    Returns:
        One :class:`Segment` per tensor overlapping the shard, in order; empty tensors never
        appear.

    Example:
        >>> shard_segments((0, 16), (10, 10), start=8, stop=24)
        [Segment(index=0, tensor_offset=8, flat_offset=8, numel=2),
         Segment(index=1, tensor_offset=0, flat_offset=16, numel=8)]
    """
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    if len(offsets) != len(numels):
        raise ValueError(f"offsets has {len(offsets)} entries but numels has {len(numels)}")
    segments = []
    for i, (o, n) in enumerate(zip(offsets, numels)):
        lo, hi = max(o, start), min(o + n, stop)
        if lo < hi:
            segments.append(Segment(i, lo - o, lo, hi - lo))
    return segments


def bucket_views(flat: torch.Tensor, offsets: Sequence[int], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like the bucket's tensors: ``flat[o_i : o_i + n_i].view(shape_i)``.

    Writes through a view land in the bucket: this is how a DDP gradient can *be* its bucket slot
    (``gradient_as_bucket_view``), and how a bucket is handed to a multi-tensor kernel per tensor.

    Example:
        >>> views = bucket_views(flat, offsets, [p.shape for p in params])
    """
    return [flat.narrow(0, o, s.numel()).view(s) for o, s in zip(offsets, map(torch.Size, shapes))]


def flatten_launch_config(device: torch.device, max_numel: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for the bucket copy kernel; a pure function of device and size.

    CUDA: 2048 elements and 4 warps — 16 fp32 per thread, four 128-bit loads in flight per
    thread for a pure copy (0 spills at sm_80/sm_90, see ``AOT_CONFIGS``). Interpreter: it pays
    per program instance, so one block per tensor up to 2^16 elements.
    """
    if device.type == "cuda":
        return 2048, 4
    return min(max(triton.next_power_of_2(max(max_numel, 1)), 1024), 65536), 4


@functools.lru_cache(maxsize=64)
def _device_offsets(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def _check_float(name: str, dtype: torch.dtype) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype}")


def _check_scale(scale: float | torch.Tensor | None, device: torch.device) -> None:
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(f"scale must be a 1-element float32 tensor, got {scale.dtype} {tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"scale is on {scale.device} but flat is on {device}")
    elif scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, a 1-element float32 tensor or None, got {type(scale)}")


def _check_bucket(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], *, writes_flat: bool) -> None:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a tensor, got {type(flat)}")
    _check_float("flat", flat.dtype)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat must be a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries but tensors has {len(tensors)}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a tensor, got {type(t)}")
        if t.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but flat is on {flat.device}")
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"tensors must share one dtype: tensors[0] is {tensors[0].dtype}, tensors[{i}] is {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] must be contiguous")
        o = offsets[i]
        if isinstance(o, bool) or not isinstance(o, numbers.Integral) or o < 0 or o + t.numel() > flat.numel():
            raise ValueError(f"offsets[{i}]={o!r} with numel {t.numel()} does not fit in flat of {flat.numel()} elements")
    if tensors:
        _check_float("tensors", tensors[0].dtype)
    if writes_flat:  # overlapping slots would race (and silently lose data)
        spans = sorted((offsets[i], offsets[i] + t.numel(), i) for i, t in enumerate(tensors) if t.numel())
        for (_, end, i), (begin, _, j) in zip(spans, spans[1:]):
            if begin < end:
                raise ValueError(f"slots of tensors[{i}] and tensors[{j}] overlap in flat (offsets must not overlap)")


def _copy(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    offsets: Sequence[int],
    scale: float | torch.Tensor | None,
    backend: Backend,
    to_flat: bool,
) -> None:
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if not live:
        return
    ts = [tensors[i] for i in live]
    if resolve_backend(backend, flat.device) == "torch":
        views = bucket_views(flat, [offsets[i] for i in live], [t.shape for t in ts])
        dst, src = (views, ts) if to_flat else (ts, views)
        _scaled_copy_torch(dst, src, scale)
        return
    offs = tuple(int(offsets[i]) for i in live)
    block, num_warps = flatten_launch_config(flat.device, max(t.numel() for t in ts))
    table = multi_tensor_table([ts], block)
    aligned = (
        flat.data_ptr() % 16 == 0
        and all(o * flat.element_size() % 16 == 0 for o in offs)
        and all(t.data_ptr() % 16 == 0 for t in ts)
    )
    scale_mode = 0 if scale is None else 2 if isinstance(scale, torch.Tensor) else 1
    _FLAT_COPY[(table.n_chunks,)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_index,
        _device_offsets(offs, flat.device),
        flat,
        scale if scale_mode == 2 else table.numels,  # placeholder pointer, unread
        float(scale) if scale_mode == 1 else 1.0,
        T_DTYPE=torch_to_triton_dtype(ts[0].dtype),
        TO_FLAT=to_flat,
        SCALE=scale_mode,
        ALIGNED=aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def _scaled_copy_torch(dst: list[torch.Tensor], src: list[torch.Tensor], scale: float | torch.Tensor | None) -> None:
    """Torch fast path: ``dst = cast(scale * src)`` with foreach ops, multiplying at fp32 precision.

    Like the kernel, the product is rounded once, to ``dst``'s dtype. The scale is passed as a
    0-dim fp32 tensor: a Python float would be rounded to fp16/bf16 first by half-precision
    foreach multiplies.
    """
    if scale is not None:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=dst[0].device).reshape(())
    if scale is None:
        torch._foreach_copy_(dst, src)
    elif dst[0].dtype == src[0].dtype:
        # one pass (read src, write dst) instead of copy + in-place multiply: on a DDP bucket this
        # is a whole extra sweep over the gradients; a loop of one op per tensor is far cheaper
        for d, s_ in zip(dst, src):
            torch.mul(s_, scale, out=d)
    elif dst[0].dtype == torch.float32:
        torch._foreach_copy_(dst, src)  # exact widening, then one rounding
        torch._foreach_mul_(dst, scale)
    else:  # narrowing or fp16 <-> bf16: multiply in fp32, round once on the copy
        wide = src if src[0].dtype == torch.float32 else [t.float() for t in src]
        torch._foreach_copy_(dst, torch._foreach_mul(wide, scale))


def flatten_into(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    offsets: Sequence[int] | None = None,
    *,
    scale: float | torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Copy ``tensors`` into their slots of the preallocated bucket ``flat``, in one launch.

    ``flat[o_i : o_i + n_i] = cast(scale * t_i.flatten())`` for every tensor ``i``; elements of
    ``flat`` outside the slots are left untouched (see [Note: bucket layout]).

    Args:
        tensors: contiguous tensors on ``flat``'s device, one dtype (fp32/fp16/bf16).
        flat: contiguous 1-D fp32/fp16/bf16 bucket; may be of another dtype (values are cast).
        offsets: element offset of each tensor's slot (ints, slots must not overlap); default
            packed in order, ``bucket_layout(numels)[0]``.
        scale: optional multiplier applied in fp32 (e.g. a pre-divide ``1/world_size``); a
            1-element fp32 tensor on the device avoids a host sync.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Raises:
        TypeError: a non-float dtype, mixed dtypes in ``tensors``, a bad ``scale``.
        ValueError: device mismatch, non-contiguous input, a slot out of bounds or overlapping.

    Example:
        >>> offsets, total = bucket_layout([g.numel() for g in grads], align=ALIGN_ELEMENTS)
        >>> flat = torch.zeros(total, device=grads[0].device)
        >>> flatten_into(grads, flat, offsets)
    """
    if offsets is None:
        offsets = bucket_layout([t.numel() if isinstance(t, torch.Tensor) else 0 for t in tensors])[0]
    _check_bucket(tensors, flat, offsets, writes_flat=True)
    _check_scale(scale, flat.device)
    _copy(tensors, flat, offsets, scale, backend, to_flat=True)


def unflatten_from(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    scale: float | torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Copy each slot of the bucket ``flat`` back into its tensor, in one launch.

    ``t_i = cast(scale * flat[o_i : o_i + n_i]).view_as(t_i)``. With ``scale=1/world_size``
    this is the averaging step after a summing all-reduce, fused into the copy.

    Args:
        flat: contiguous 1-D fp32/fp16/bf16 bucket.
        tensors: contiguous destination tensors on ``flat``'s device, one dtype (fp32/fp16/bf16),
            not overlapping each other (a tensor may be the view of its own slot).
        offsets: element offset of each tensor's slot (as given to :func:`flatten_into`).
        scale: optional multiplier applied in fp32; a float or a 1-element fp32 tensor.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Raises:
        TypeError: a non-float dtype, mixed dtypes in ``tensors``, a bad ``scale``.
        ValueError: device mismatch, non-contiguous input, a slot out of bounds.

    Example:
        >>> dist.all_reduce(flat)
        >>> unflatten_from(flat, grads, offsets, scale=1.0 / world_size)
    """
    _check_bucket(tensors, flat, offsets, writes_flat=False)
    _check_scale(scale, flat.device)
    _copy(tensors, flat, offsets, scale, backend, to_flat=False)


def flatten(
    tensors: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    align: int = 1,
    pad_to_multiple_of: int = 1,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Allocate a bucket for ``tensors`` (layout from :func:`bucket_layout`) and fill it.

    Gaps and padding are zero (see [Note: bucket layout]).

    Args:
        tensors: at least one contiguous tensor, one device and dtype (fp32/fp16/bf16).
        dtype: the bucket's dtype; default ``tensors[0].dtype``.
        align, pad_to_multiple_of: see :func:`bucket_layout`.
        backend: see :func:`shardkit.kernels.runtime.resolve_backend`.

    Returns:
        ``(flat, offsets)``: the 1-D bucket on ``tensors[0].device`` and each tensor's offset.

    Example:
        >>> flat, offsets = flatten(grads, dtype=torch.float32, align=ALIGN_ELEMENTS)
        >>> unflatten_from(flat, grads, offsets)  # round trip
    """
    if not tensors:
        raise ValueError("flatten needs at least one tensor (the bucket's device comes from tensors[0])")
    dtype = tensors[0].dtype if dtype is None else dtype
    _check_float("dtype", dtype)
    offsets, total = bucket_layout([t.numel() for t in tensors], align=align, pad_to_multiple_of=pad_to_multiple_of)
    dense = total == sum(t.numel() for t in tensors)
    flat = (torch.empty if dense else torch.zeros)(total, dtype=dtype, device=tensors[0].device)
    flatten_into(tensors, flat, offsets, backend=backend)
    return flat, offsets


def _aot_configs() -> list[dict]:
    """Default launch configs to compile ahead of time (see :mod:`shardkit.kernels.aot`)."""
    block, num_warps = flatten_launch_config(torch.device("cuda"), 1 << 20)
    base = dict(ALIGNED=True, BLOCK=block)
    configs = [  # (name, tensor dtype, flat dtype, direction, scale mode, bytes moved per element)
        ("flatten_fp32", tl.float32, "*fp32", True, 0, 8),
        ("unflatten_fp32_avg", tl.float32, "*fp32", False, 2, 8),
        ("flatten_bf16_to_fp32", tl.bfloat16, "*fp32", True, 0, 6),
        ("unflatten_fp32_to_bf16_avg", tl.bfloat16, "*fp32", False, 1, 6),
        ("flatten_bf16", tl.bfloat16, "*bf16", True, 0, 4),
    ]
    return [
        dict(
            kernel=_FLAT_COPY,
            name=name,
            pointers={"offsets_ptr": "*i64", "flat_ptr": flat, "scale_ptr": "*fp32"},
            num_warps=num_warps,
            constexprs=dict(base, T_DTYPE=t_dtype, TO_FLAT=to_flat, SCALE=scale),
            elements_per_program=block,
            bytes_per_element=nbytes,
        )
        for name, t_dtype, flat, to_flat, scale, nbytes in configs
    ]


AOT_CONFIGS = _aot_configs
