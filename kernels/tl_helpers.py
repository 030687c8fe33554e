"""Device helpers shared by the multi-tensor kernels (see [Note: device helpers] in runtime.py).

Each is a plain function declared with :func:`~shardkit.kernels.runtime.triton_helper`: Triton
inlines it into the compiled kernel, and the interpreter calls it as Python, so both executors
run this one source. Call them by bare name from kernel source.

* :func:`program_chunk` — the multi-tensor preamble: which tensor and chunk this program owns
  (see [Note: multi-tensor launches] in runtime.py).
* :func:`role_ptr` — tensor ``t``'s typed pointer in one role of the pointer table.
* :func:`load_chunk` / :func:`store_chunk` — a chunk's access, unmasked for full chunks so that
  aligned pointers give 128-bit accesses, masked only in a tensor's tail chunk (see [Note: aligned full
  chunks] in runtime.py); stores round to the destination dtype with :func:`round_to`.
* :func:`round_to` — round-to-nearest-even downcast, identical compiled and interpreted;
  :func:`widen` — the exact upcast to fp32 (the interpreter flushes bf16 subnormals).
* :func:`ordered_sum` — a fixed-order sum of a span of partial results (deterministic norms).
"""

from __future__ import annotations

import triton.language as tl

from .runtime import triton_helper

__all__ = ["program_chunk", "role_ptr", "load_chunk", "store_chunk", "round_to", "widen", "ordered_sum"]


@triton_helper
def program_chunk(chunk_tensor_ptr, chunk_index_ptr, numels_ptr, BLOCK: tl.constexpr):
    """This program's ``(t, c, offs, n, full)``: tensor index, chunk index within the tensor,
    element offsets ``c * BLOCK + arange(BLOCK)`` (int64), the tensor's numel, and whether the
    whole chunk is in bounds."""
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    c = tl.load(chunk_index_ptr + pid).to(tl.int64)
    n = tl.load(numels_ptr + t)
    start = c * BLOCK
    offs = start + tl.arange(0, BLOCK)
    return t, c, offs, n, start + BLOCK <= n


@triton_helper
def role_ptr(ptrs_ptr, row, n_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor ``t``'s pointer in row ``row`` of the int64 pointer table, typed ``DTYPE``.

    With ``ALIGNED`` the launcher guarantees 16-byte alignment, and the hint says so."""
    p = tl.load(ptrs_ptr + row * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton_helper
def load_chunk(ptr, offs, n, full):
    """``ptr[offs]`` as fp32: unmasked when the chunk is ``full``, else lanes ``offs >= n`` read 0.

    The two loads sit in the two arms of a branch on ``full``, so the compiler vectorizes the
    unmasked one whatever ``n`` is (a mask on an arbitrary ``n`` forces scalar accesses)."""
    if full:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    return widen(x)


@triton_helper
def store_chunk(ptr, offs, x, n, full):
    """``ptr[offs] = round_to(x, ptr's dtype)``; unmasked when ``full``, else lanes < ``n``."""
    y = round_to(x, ptr.dtype.element_ty)
    if full:
        tl.store(ptr + offs, y)
    else:
        tl.store(ptr + offs, y, mask=offs < n)


@triton_helper
def round_to(x, DTYPE: tl.constexpr):
    """``x`` (fp32/fp16/bf16) rounded to nearest, ties to even, in ``DTYPE`` (fp32/fp16/bf16).

    Compiled code rounds to nearest even on every cast, but Triton 3.9's interpreter truncates
    fp32 -> bf16 (and its ``fp_downcast_rounding="rtne"`` rounds ties away from zero), so bf16
    is rounded here on the fp32 bits, the way torch does: add ``0x7FFF`` plus the lowest kept
    bit and drop the low 16 bits. The carry rolls a mantissa overflow into the exponent, so the
    largest values round to inf exactly when they should, and subnormals need nothing special
    (bf16 keeps fp32's exponent range). inf stays inf; NaN keeps its sign and top payload bits
    and is made quiet (the add could otherwise carry a NaN into inf). fp32 -> fp16 needs no
    help: the interpreter casts through numpy, which rounds to nearest even (subnormals and
    overflow to inf included), as compiled code does.
    """
    x = widen(x)
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        high = bits >> 16
        rounded = (bits + (0x7FFF + (high & 1))) >> 16
        return tl.where(x != x, high | 0x40, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton_helper
def widen(x):
    """``x`` (fp32/fp16/bf16) as fp32, exactly.

    bf16 is the top half of an fp32, so it widens by a 16-bit shift of its bits; done here
    because Triton 3.9's interpreter flushes bf16 subnormals to zero on ``.to(tl.float32)``
    (compiled code emits the same shift for the cast)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton_helper
def ordered_sum(ptr, first, count, RBLOCK: tl.constexpr):
    """``sum(ptr[first : first + count])`` (fp32) in an order fixed by ``count`` and ``RBLOCK``.

    Lanes accumulate strided elements in index order, then one tree reduction: the result
    depends only on the values and their positions, never on timing. Loads bypass L1
    (``.cg``): the values were written by other programs of the same launch.
    """
    acc = tl.full([RBLOCK], 0.0, tl.float32)
    for i in range(0, count, RBLOCK):
        r = i + tl.arange(0, RBLOCK)
        acc += tl.load(ptr + first + r, mask=r < count, other=0.0, cache_modifier=".cg")
    return tl.sum(acc, 0)
