"""Fused gradient epilogue (unscale + inf/nan + Σg²) and norm clipping, interpreted Triton and torch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.kernels.aot import kernel_signature
from shardkit.kernels.flatten import bucket_layout, bucket_views
from shardkit.kernels.grad_epilogue import AOT_CONFIGS, clip_coef, clip_grads_, unscale_and_norm_
from shardkit.kernels.runtime import count_launches
from tolerances import FP32, assert_rounded_from, rounded_param

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["triton", "torch"]  # "triton" on CPU tensors = Triton's interpreter

# Unscaled grads are fp32(g) * fp32(inv_scale) rounded once to the stored dtype, checked exactly
# with tolerances.assert_rounded_from (round to nearest even, interpreted or not).
# Clipped grads go through a sqrt and a division: the shared fp32 / rounded-param tolerances.
#
# rtol of Σg² against fp64: fp32 accumulation. torch's CPU _foreach_norm sums sequentially, a
# random walk of ~sqrt(n)·2^-24 relative: ≈5e-5 for the 6e5-element BIG_SHAPES tensor.
SUMSQ_RTOL = 1e-4
# Shapes: one element, empty, odd, multi-dim, larger than the CUDA BLOCK (2048).
SHAPES = [(1,), (0,), (7,), (33, 5), (2100,)]
# Several chunks per tensor in the interpreter (its BLOCK caps at 2^16): the per-tensor
# fixed-order reduction loop then runs more than one step (interpreter RBLOCK is 8).
BIG_SHAPES = [(9 * 65536 + 5,), (3,)]


def _reference(grads, inv_scale, out_dtype=None):
    """Reference: the fp32 values the stored grads round from, and inf/nan counts per tensor."""
    s = torch.tensor(1.0 if inv_scale is None else float(inv_scale))
    dtype = out_dtype or grads[0].dtype
    outs = [g.float() * s for g in grads]
    bad = torch.tensor([(~torch.isfinite(o.to(dtype))).sum().item() for o in outs], dtype=torch.int64)
    return outs, bad


def _tol(dtype):
    return FP32 if dtype == torch.float32 else rounded_param(dtype)


def _grads(shapes, dtype, seed=0, scale=1024.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


def _check(stats, grads, ref_outs, ref_bad, *, backend):
    """Grads are the reference rounded; Σg² (vs fp64) and inf/nan counts of the stored grads."""
    for g, r in zip(grads, ref_outs):
        r = r.view_as(g)
        finite = torch.isfinite(r)
        assert torch.equal(g.isnan(), r.isnan()) and torch.equal(g[r.isinf()], r[r.isinf()].to(g.dtype))
        assert_rounded_from(g[finite], r[finite])
    # Σg² is defined on the stored values, so the reference is computed from them.
    sumsq = torch.tensor([g.double().square().sum().item() for g in grads], dtype=torch.float64)
    torch.testing.assert_close(stats.tensor_sumsq.double(), sumsq, rtol=SUMSQ_RTOL, atol=0, equal_nan=True)
    torch.testing.assert_close(stats.sumsq.double(), sumsq.sum().reshape(1), rtol=SUMSQ_RTOL, atol=0, equal_nan=True)
    assert stats.tensor_nonfinite.tolist() == ref_bad.tolist()
    assert stats.found_inf.item() == float(ref_bad.sum() > 0)
    assert stats.nonfinite_indices() == ref_bad.nonzero().flatten().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_scale", [None, 1 / 1024, "tensor"])
def test_unscale_and_norm_matches_reference(backend, dtype, inv_scale):
    grads = _grads(SHAPES, dtype)
    s = torch.tensor([1 / 3072]) if inv_scale == "tensor" else inv_scale
    ref = _reference(grads, s)
    with count_launches() as launches:
        stats = unscale_and_norm_(grads, inv_scale=s, backend=backend)
    _check(stats, grads, *ref, backend=backend)
    assert launches["_unscale_norm_kernel"] == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_above_block_size(backend, dtype):
    grads = _grads(BIG_SHAPES, dtype, seed=1)
    grads[0][-1] = float("nan")  # in the masked tail chunk
    ref = _reference(grads, 0.5)
    stats = unscale_and_norm_(grads, inv_scale=0.5, backend=backend)
    _check(stats, grads, *ref, backend=backend)
    clean = _grads(BIG_SHAPES, dtype, seed=1)
    stats = unscale_and_norm_(clean, backend=backend)
    _check(stats, clean, *_reference(clean, None), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 2, -1])  # which tensor: first, middle (after an empty one), last
def test_single_nonfinite_is_attributed(backend, dtype, bad, where):
    shapes = [(5,), (0,), (64, 3), (1,), (2100,)]
    grads = _grads(shapes, dtype, seed=2)
    victim = len(shapes) - 1 if where == -1 else where
    grads[victim].view(-1)[-1] = bad
    ref = _reference(grads, 1 / 1024)
    stats = unscale_and_norm_(grads, inv_scale=torch.tensor([1 / 1024]), backend=backend)
    _check(stats, grads, *ref, backend=backend)  # the other grads are still unscaled correctly
    assert stats.nonfinite_indices() == [victim] and not math.isfinite(stats.sumsq.item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_amp_unscale_and_foreach_norm(backend):
    grads = _grads([(17,), (300,), (4, 4)], torch.float16, seed=3)
    grads[1][10] = math.inf
    expected = [g.clone() for g in grads]
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, torch.tensor([2.0**-10]))
    stats = unscale_and_norm_(grads, inv_scale=torch.tensor([2.0**-10]), backend=backend)
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)  # power-of-two scale: exact
    torch.testing.assert_close(stats.found_inf, found)
    clean = [grads[0], grads[2]]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(clean, 2, dtype=torch.float32)))
    torch.testing.assert_close(unscale_and_norm_(clean, backend=backend).norm(), norm.reshape(1), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_accumulate_across_calls(backend):
    a, b = _grads([(40,)], torch.float32, seed=4), _grads([(9,)], torch.bfloat16, seed=5)
    found_inf, sumsq = torch.ones(1), torch.zeros(1)  # found_inf is never cleared, like torch's AMP
    unscale_and_norm_(a, found_inf=found_inf, sumsq=sumsq, backend=backend)
    stats = unscale_and_norm_(b, found_inf=found_inf, sumsq=sumsq, backend=backend)  # a second dtype group
    assert stats.sumsq is sumsq and stats.found_inf is found_inf and found_inf.item() == 1.0
    expected = a[0].double().square().sum() + b[0].double().square().sum()
    torch.testing.assert_close(sumsq.double(), expected.reshape(1), rtol=SUMSQ_RTOL, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_without_scale_and_out(backend):
    grads = _grads([(7,), (50,)], torch.bfloat16, seed=6)
    grads[1][3] = math.nan
    before = [g.clone() for g in grads]
    stats = unscale_and_norm_(grads, backend=backend)
    assert all(torch.equal(g.view(torch.int16), b.view(torch.int16)) for g, b in zip(grads, before))
    assert stats.nonfinite_indices() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bucket_views_to_param_grads_out_of_place(backend, out_dtype):
    """DDP after an all-reduce: read the fp32 bucket's views, write averaged+unscaled .grad."""
    shapes = [(3, 5), (0,), (16,), (2100,)]
    offsets, total = bucket_layout([torch.Size(s).numel() for s in shapes], align=16, pad_to_multiple_of=64)
    flat = torch.randn(total) * 512
    views = bucket_views(flat, offsets, shapes)
    views[2][4] = math.inf
    bucket = flat.clone()
    out = [torch.empty(s, dtype=out_dtype) for s in shapes]
    inv_scale = torch.tensor([1 / (512 * 4)])  # 1 / (loss_scale * world_size)
    with count_launches() as launches:
        stats = unscale_and_norm_(views, out=out, inv_scale=inv_scale, backend=backend)
    assert torch.equal(flat, bucket)  # the bucket is only read
    _check(stats, out, *_reference(views, inv_scale, out_dtype), backend=backend)
    assert stats.nonfinite_indices() == [2]
    assert sum(launches.values()) == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs_launch_nothing(backend):
    with count_launches() as launches:
        stats = unscale_and_norm_([], inv_scale=0.5, backend=backend)
        stats0 = unscale_and_norm_([torch.empty(0), torch.empty(3, 0)], backend=backend)
        coef = clip_grads_([torch.empty(0)], torch.tensor([4.0]), max_norm=1.0, backend=backend)
    assert sum(launches.values()) == 0
    assert stats.sumsq.item() == 0 and stats.found_inf.item() == 0 and stats.tensor_sumsq.numel() == 0
    assert stats0.tensor_nonfinite.tolist() == [0, 0] and stats0.sumsq.item() == 0
    torch.testing.assert_close(coef, torch.tensor([1 / (2 + 1e-6)]))


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=3), min_size=1, max_size=12),
    dtype=st.sampled_from(DTYPES),
    inv_scale=st.sampled_from([None, 0.125, 1 / 3, "tensor"]),
    poison=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 2000), st.sampled_from([math.inf, math.nan])), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_epilogue_property(shapes, dtype, inv_scale, poison, seed):
    base = _grads(shapes, dtype, seed=seed, scale=8.0)
    for t, k, v in poison:  # inject inf/nan at random places
        g = base[t % len(base)].view(-1)
        if g.numel():
            g[k % g.numel()] = v
    s = torch.tensor([0.3]) if inv_scale == "tensor" else inv_scale
    ref = _reference(base, s)
    for backend in BACKENDS:
        grads = [g.clone() for g in base]
        _check(unscale_and_norm_(grads, inv_scale=s, backend=backend), grads, *ref, backend=backend)


# ------------------------------------------------------------------------------------------ clip


def _ref_clip(grads, max_norm, eps=1e-6):
    norm = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    coef = min(1.0, max_norm / (norm + eps))
    return coef, [(g.double() * coef).to(g.dtype) for g in grads]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])  # clipping, and a no-op
def test_clip_matches_formula(backend, dtype, max_norm):
    grads = _grads(SHAPES, dtype, seed=7, scale=0.1)
    before = [g.clone() for g in grads]
    coef_ref, expected = _ref_clip(grads, max_norm)
    stats = unscale_and_norm_(grads, backend=backend)
    with count_launches() as launches:
        coef = clip_grads_(grads, stats.sumsq, max_norm=max_norm, backend=backend)
    torch.testing.assert_close(coef.double(), torch.tensor([coef_ref], dtype=torch.float64), **FP32)
    torch.testing.assert_close(clip_coef(stats.sumsq, max_norm), coef, **FP32)
    for g, e, b in zip(grads, expected, before):
        torch.testing.assert_close(g, e, **_tol(dtype))
        if coef_ref == 1.0:
            assert torch.equal(g, b)  # not clipped: untouched
    assert launches["_clip_kernel"] == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_matches_torch_clip_grad_norm(backend):
    grads = _grads([(8, 3), (100,), (1,)], torch.float32, seed=8)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=2.0)
    stats = unscale_and_norm_(grads, backend=backend)
    torch.testing.assert_close(stats.norm(), total.reshape(1), **FP32)
    clip_grads_(grads, stats.sumsq, max_norm=2.0, backend=backend)
    torch.testing.assert_close(grads, [p.grad for p in params], **FP32)


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # inf * 0
@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_with_nonfinite_norm_follows_torch(backend):
    grads = [torch.ones(5), torch.full((3,), math.inf)]
    coef = clip_grads_(grads, torch.tensor([math.inf]), max_norm=1.0, backend=backend)
    assert coef.item() == 0.0 and grads[0].eq(0).all() and grads[1].isnan().all()  # inf * 0
    grads = [torch.ones(4)]
    coef = clip_grads_(grads, torch.tensor([math.nan]), max_norm=1.0, backend=backend)
    assert coef.isnan().all() and grads[0].isnan().all()  # torch.clamp keeps NaN


# ------------------------------------------------------------------------------------ validation


def test_validation_errors_name_the_argument():
    g = [torch.ones(4)]
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        unscale_and_norm_([torch.ones(2), torch.ones(2).half()])
    with pytest.raises(TypeError, match="grads must be float32"):
        unscale_and_norm_([torch.ones(2, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"grads\[0\] must be contiguous"):
        unscale_and_norm_([torch.ones(3, 2).t()])
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        unscale_and_norm_([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(TypeError, match="inv_scale must be a 1-element float32"):
        unscale_and_norm_(g, inv_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="inv_scale must be a float"):
        unscale_and_norm_(g, inv_scale=[0.5])
    with pytest.raises(TypeError, match="found_inf must be"):
        unscale_and_norm_(g, found_inf=torch.zeros(2))
    with pytest.raises(ValueError, match="sumsq is on meta"):
        unscale_and_norm_(g, sumsq=torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="out has 2 tensors"):
        unscale_and_norm_(g, out=[torch.ones(4), torch.ones(4)])
    with pytest.raises(ValueError, match=r"out\[0\] has 3 elements"):
        unscale_and_norm_(g, out=[torch.ones(3)])
    with pytest.raises(TypeError, match="sumsq must be"):
        clip_grads_(g, torch.ones(1, dtype=torch.float16), max_norm=1.0)
    with pytest.raises(ValueError, match="backend"):
        clip_grads_(g, torch.ones(1), max_norm=1.0, backend="gpu")


def test_aot_configs_cover_every_kernel_argument():
    configs = AOT_CONFIGS()
    assert {c["name"] for c in configs} >= {"unscale_norm_fp32", "unscale_norm_bf16", "clip_fp32", "clip_bf16"}
    for c in configs:
        # derived from the kernel's parameters (raises on a missing constexpr / pointer type)
        sig = kernel_signature(c["kernel"].fn, c["constexprs"], c.get("pointers"))
        assert list(sig) == c["kernel"].jit.arg_names, c["name"]
        assert {k for k, v in sig.items() if v == "constexpr"} == set(c["constexprs"]), c["name"]
        assert c["constexprs"]["BLOCK"] == c["elements_per_program"] and c["constexprs"]["ALIGNED"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_torch_path_and_is_deterministic(dtype):
    shapes = [(1,), (4097,), (2048 * 600 + 3,), (0,), (31, 17)] + [(64,)] * 1500  # > RBLOCK tensors
    base = _grads(shapes, dtype, seed=9)
    base[2].view(-1)[-1] = math.inf
    base = [g.cuda() for g in base]
    inv = torch.tensor([1 / 1024], device="cuda")
    results = {}
    for backend in ["triton", "triton", "torch"]:
        grads = [g.clone() for g in base]
        stats = unscale_and_norm_(grads, inv_scale=inv, backend=backend)
        coef = clip_grads_(grads, stats.sumsq, max_norm=1.0, backend=backend)
        if backend in results:  # the second Triton run: bitwise-equal norm ([Note: deterministic grad norm])
            assert torch.equal(stats.tensor_sumsq, results[backend][0].tensor_sumsq)
            assert torch.equal(stats.sumsq, results[backend][0].sumsq)
        results[backend] = (stats, coef, grads)
    (st_t, _, g_t), (st_r, _, g_r) = results["triton"], results["torch"]
    assert st_t.nonfinite_indices() == st_r.nonfinite_indices() == [2]
    assert torch.equal(st_t.tensor_nonfinite, st_r.tensor_nonfinite)
    torch.testing.assert_close(st_t.tensor_sumsq, st_r.tensor_sumsq, rtol=SUMSQ_RTOL, atol=0, equal_nan=True)
    torch.testing.assert_close(g_t, g_r, **_tol(dtype), equal_nan=True)
