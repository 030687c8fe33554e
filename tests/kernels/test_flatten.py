"""Bucket layout and the multi-tensor flatten/unflatten kernels (interpreted Triton and torch path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.kernels.aot import kernel_signature
from shardkit.kernels.flatten import (
    ALIGN_ELEMENTS,
    AOT_CONFIGS,
    Segment,
    bucket_layout,
    bucket_views,
    flatten,
    flatten_into,
    shard_segments,
    unflatten_from,
)
from shardkit.kernels.runtime import count_launches
from tolerances import assert_rounded_from

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["triton", "torch"]  # "triton" on CPU tensors = Triton's interpreter

# Every copy computes ``scale * x`` in fp32 and rounds once to the destination dtype, so results
# are checked exactly with tolerances.assert_rounded_from against that fp32 value: round to
# nearest even, interpreted or not (tests/kernels/test_rounding.py covers ties, subnormals, inf/nan).

# Shapes: empty, one element, odd, multi-dim, empty multi-dim, larger than the CUDA BLOCK (2048).
SHAPES = [(0,), (1,), (7,), (33, 5), (4, 0, 3), (2100,)]
# Above the interpreter's BLOCK cap (2^16): several chunks per tensor, masked tail chunk.
BIG_SHAPES = [(65536 + 37,), (3,), (2 * 65536,)]


def _fp32(t, scale=None):
    """The fp32 value a copy rounds from: ``fp32(t) * fp32(scale)``."""
    return t.float() if scale is None else t.float() * torch.tensor(float(scale))


def _ref_flat(tensors, flat, offsets, scale):
    """fp32 reference of flatten_into: every slot written once, everything else untouched."""
    ref = flat.float()
    for t, o in zip(tensors, offsets):
        ref[o : o + t.numel()] = _fp32(t.flatten(), scale)
    return ref


# --------------------------------------------------------------------------------------- layout


def test_bucket_layout_examples():
    assert bucket_layout([3, 20, 5]) == ((0, 3, 23), 28)
    assert bucket_layout([3, 20, 5], align=16, pad_to_multiple_of=64) == ((0, 16, 48), 64)
    assert bucket_layout([0, 0]) == ((0, 0), 0)
    assert bucket_layout([]) == ((), 0)


@pytest.mark.parametrize("kwargs", [dict(align=0), dict(pad_to_multiple_of=0)])
def test_bucket_layout_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        bucket_layout([4], **kwargs)
    with pytest.raises(ValueError, match=r"numels\[1\]"):
        bucket_layout([4, -1])


@settings(max_examples=30, deadline=None)
@given(
    numels=st.lists(st.integers(0, 300), max_size=12),
    align=st.sampled_from([1, 4, ALIGN_ELEMENTS]),
    world=st.integers(1, 8),
)
def test_bucket_layout_properties(numels, align, world):
    pad = world * align
    offsets, total = bucket_layout(numels, align=align, pad_to_multiple_of=pad)
    assert len(offsets) == len(numels) and total % pad == 0
    end = 0
    for o, n in zip(offsets, numels):
        assert o % align == 0 and end <= o < end + align  # in order, aligned, no wasted slot
        end = o + n
    assert end <= total < end + pad
    # every shard of a padded bucket is aligned; the shards' segments tile every tensor exactly once
    shard = total // world
    assert shard % align == 0
    covered = [0] * len(numels)
    for r in range(world):
        for seg in shard_segments(offsets, numels, start=r * shard, stop=(r + 1) * shard):
            assert r * shard <= seg.flat_offset and seg.flat_offset + seg.numel <= (r + 1) * shard
            assert seg.flat_offset == offsets[seg.index] + seg.tensor_offset and seg.numel > 0
            covered[seg.index] += seg.numel
    assert covered == list(numels)


def test_shard_segments_example_and_errors():
    assert shard_segments((0, 16), (10, 10), start=8, stop=24) == [Segment(0, 8, 8, 2), Segment(1, 0, 16, 8)]
    assert shard_segments((0, 16), (10, 10), start=10, stop=16) == []
    with pytest.raises(ValueError, match="start"):
        shard_segments((0,), (1,), start=2, stop=1)
    with pytest.raises(ValueError, match="numels"):
        shard_segments((0,), (1, 2), start=0, stop=1)


def test_bucket_views_alias_the_bucket():
    flat = torch.arange(12.0)
    a, b = bucket_views(flat, (0, 4), [(2, 2), (3,)])
    assert a.shape == (2, 2) and b.shape == (3,)
    b.fill_(-1)
    assert flat[4:7].eq(-1).all() and a.data_ptr() == flat.data_ptr()


# ---------------------------------------------------------------------------- flatten / unflatten


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t_dtype", DTYPES)
@pytest.mark.parametrize("f_dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, "tensor"])
def test_flatten_into_matches_reference(backend, t_dtype, f_dtype, scale):
    torch.manual_seed(0)
    tensors = [torch.randn(s).to(t_dtype) for s in SHAPES]
    offsets, total = bucket_layout([t.numel() for t in tensors], align=ALIGN_ELEMENTS, pad_to_multiple_of=64)
    flat = torch.full((total,), 7.0, dtype=f_dtype)  # sentinel: gaps must stay untouched
    s = torch.tensor([1 / 3]) if scale == "tensor" else scale
    expected = _ref_flat(tensors, flat, offsets, s)
    with count_launches() as launches:
        flatten_into(tensors, flat, offsets, scale=s, backend=backend)
    assert_rounded_from(flat, expected)
    assert launches["_flat_copy_kernel"] == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t_dtype", DTYPES)
@pytest.mark.parametrize("f_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.1])
def test_unflatten_from_matches_reference(backend, t_dtype, f_dtype, scale):
    torch.manual_seed(1)
    shapes = SHAPES
    offsets, total = bucket_layout([torch.Size(s).numel() for s in shapes])  # packed: unaligned slots
    flat = torch.randn(total + 5).to(f_dtype)[2 : 2 + total]  # a view with a storage offset
    outs = [torch.full(s, 7.0, dtype=t_dtype) for s in shapes]
    with count_launches() as launches:
        unflatten_from(flat, outs, offsets, scale=scale, backend=backend)
    for out, o, shape in zip(outs, offsets, shapes):
        expected = _fp32(flat[o : o + out.numel()], scale).view(shape)
        assert_rounded_from(out, expected)
    assert launches["_flat_copy_kernel"] == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_above_block_size(backend, dtype):
    torch.manual_seed(2)
    tensors = [torch.randn(s).to(dtype) for s in BIG_SHAPES]
    flat, offsets = flatten(tensors, dtype=torch.float32, align=ALIGN_ELEMENTS, backend=backend)
    torch.testing.assert_close(flat, _ref_flat(tensors, torch.zeros_like(flat), offsets, None), rtol=0, atol=0)
    back = [torch.empty_like(t) for t in tensors]
    with count_launches() as launches:
        unflatten_from(flat, back, offsets, scale=torch.tensor([0.5]), backend=backend)
    for t, b in zip(tensors, back):
        torch.testing.assert_close(b, t * 0.5, rtol=0, atol=0)  # power of two: exact in any dtype
    assert launches["_flat_copy_kernel"] == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flatten_pads_with_zeros_and_defaults_to_packed(backend):
    tensors = [torch.ones(3), torch.full((5,), 2.0)]
    flat, offsets = flatten(tensors, align=4, pad_to_multiple_of=6, backend=backend)
    assert offsets == (0, 4) and flat.tolist() == [1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0]
    flat = torch.zeros(8, dtype=torch.bfloat16)
    flatten_into(tensors, flat, backend=backend)  # offsets default: packed in order
    assert flat.tolist() == [1, 1, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unflatten_in_place_into_own_views_averages(backend):
    numels = (16, 8, 10)
    offsets, total = bucket_layout(numels, align=ALIGN_ELEMENTS)
    flat = torch.arange(float(total))
    views = bucket_views(flat, offsets, [(4, 4), (8,), (2, 5)])
    unflatten_from(flat, views, offsets, scale=0.5, backend=backend)  # gradient_as_bucket_view case
    expected = torch.arange(float(total))
    for o, n in zip(offsets, numels):
        expected[o : o + n] *= 0.5
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs_launch_nothing(backend):
    flat = torch.zeros(4)
    with count_launches() as launches:
        flatten_into([], flat, backend=backend)
        unflatten_from(flat, [], [], backend=backend)
        flatten_into([torch.empty(0), torch.empty(2, 0)], flat, backend=backend)
        unflatten_from(flat, [torch.empty(0)], [4], backend=backend)
    assert sum(launches.values()) == 0 and flat.eq(0).all()


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=6),
    t_dtype=st.sampled_from(DTYPES),
    f_dtype=st.sampled_from(DTYPES),
    align=st.sampled_from([1, ALIGN_ELEMENTS]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(shapes, t_dtype, f_dtype, align, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen).to(t_dtype) for s in shapes]
    for backend in BACKENDS:
        flat, offsets = flatten(tensors, dtype=f_dtype, align=align, pad_to_multiple_of=4, backend=backend)
        back = [torch.empty_like(t) for t in tensors]
        unflatten_from(flat, back, offsets, backend=backend)
        assert_rounded_from(flat, _ref_flat(tensors, torch.zeros_like(flat), offsets, None))
        for t, b, o in zip(tensors, back, offsets):  # the cast to the bucket dtype is the only loss
            assert_rounded_from(b, flat[o : o + t.numel()].float().view_as(t))


# ----------------------------------------------------------------------------------- validation


def test_validation_errors_name_the_argument():
    x, flat = torch.ones(4), torch.zeros(8)
    with pytest.raises(TypeError, match="flat must be"):
        flatten_into([x], flat.long())
    with pytest.raises(ValueError, match="flat must be a contiguous 1-D"):
        flatten_into([x], flat.view(2, 4))
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        flatten_into([x, x.half()], flat)
    with pytest.raises(TypeError, match="tensors must be"):
        flatten_into([x.long()], flat)
    with pytest.raises(ValueError, match=r"tensors\[0\] must be contiguous"):
        flatten_into([torch.ones(2, 2).t()], flat)
    with pytest.raises(ValueError, match=r"tensors\[0\] is on meta"):
        flatten_into([torch.ones(4, device="meta")], flat)
    with pytest.raises(ValueError, match=r"offsets\[0\]=6"):
        flatten_into([x], flat, [6])
    with pytest.raises(ValueError, match=r"offsets\[0\]=-1"):
        unflatten_from(flat, [x], [-1])
    with pytest.raises(ValueError, match="overlap"):
        flatten_into([x, x], flat, [0, 2])
    with pytest.raises(ValueError, match="offsets has 1 entries"):
        flatten_into([x, x], flat, [0])
    with pytest.raises(TypeError, match="scale must be a 1-element float32"):
        unflatten_from(flat, [x], [0], scale=torch.ones(2))
    with pytest.raises(TypeError, match="scale must be"):
        unflatten_from(flat, [x], [0], scale="2")
    with pytest.raises(ValueError, match="backend"):
        flatten_into([x], flat, backend="cuda")
    with pytest.raises(ValueError, match="at least one tensor"):
        flatten([])
    unflatten_from(flat, [x, x], [0, 0])  # reading one slot twice is fine


def test_aot_configs_cover_every_kernel_argument():
    configs = AOT_CONFIGS()
    assert {c["name"] for c in configs} >= {"flatten_fp32", "unflatten_fp32_avg", "flatten_bf16_to_fp32"}
    for c in configs:
        # derived from the kernel's parameters (raises on a missing constexpr / pointer type)
        sig = kernel_signature(c["kernel"].fn, c["constexprs"], c.get("pointers"))
        assert list(sig) == c["kernel"].jit.arg_names, c["name"]
        assert {k for k, v in sig.items() if v == "constexpr"} == set(c["constexprs"]), c["name"]
        assert c["constexprs"]["BLOCK"] == c["elements_per_program"] and c["constexprs"]["ALIGNED"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_matches_torch_path(dtype):
    tensors = [torch.randn(n, device="cuda").to(dtype) for n in (1, 4095, 2048 * 3, 10, 1 << 20)]
    offsets, total = bucket_layout([t.numel() for t in tensors], align=ALIGN_ELEMENTS, pad_to_multiple_of=128)
    flats = {}
    for backend in BACKENDS:
        flat = torch.zeros(total, device="cuda")
        flatten_into(tensors, flat, offsets, scale=0.5, backend=backend)
        back = [torch.empty_like(t) for t in tensors]
        unflatten_from(flat, back, offsets, scale=torch.full((1,), 2.0, device="cuda"), backend=backend)
        for t, b in zip(tensors, back):
            torch.testing.assert_close(b, t, rtol=0, atol=0)  # powers of two: exact
        flats[backend] = flat
    torch.testing.assert_close(flats["triton"], flats["torch"], rtol=0, atol=0)
