"""Blockwise attention kernels: the Triton kernels (interpreted here, compiled on CUDA) and the
torch path against ``F.scaled_dot_product_attention``, and against each other.

The reference is SDPA in fp64 on the same (rounded) inputs, with the visibility of every
``(q_pos, k_pos)`` pair as its boolean mask and the key/value heads repeated for GQA; its
log-sum-exp is written out (SDPA returns none). Context-parallel layouts (zigzag, an arbitrary
permutation of the sequence) run the key blocks one at a time, merge them with
``merge_attention_blocks`` and sum the blocks' gradients, as ring attention does.

Interpreted shapes are tiny (the interpreter pays per tile): the launch config takes 16 x 16
tiles there, so ``Sq=13, Sk=21`` already runs partial tiles, two key tiles and a two-piece scan
of the positions. The CUDA tests (skipped without a GPU) run the compiled kernels at model sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardkit.kernels.attention import (
    AOT_CONFIGS,
    _cuda_tiles,
    attention_block_backward,
    attention_block_forward,
    merge_attention_blocks,
)
from shardkit.kernels.runtime import count_launches
from tolerances import FP32

BACKENDS = ["triton", "torch"]  # "triton" on CPU tensors = Triton's interpreter

#: fp16/bf16 inputs vs the fp64 reference on the same rounded inputs. Scores and every product
#: are exact in fp32, but the kernels round the probabilities p (forward and backward) and ds
#: (backward) to the input dtype before their dot products, as flash attention does: half an ulp
#: (2^-9 bf16, 2^-12 fp16) of each O(1) term of sums of ~20 terms, observed up to ~0.007 (bf16)
#: on gradients of magnitude ~2. The torch path computes in fp32 throughout, so it passes FP32
#: against the same reference.
LOWP = {torch.bfloat16: dict(rtol=2.0**-6, atol=2.0**-6), torch.float16: dict(rtol=2.0**-9, atol=2.0**-9)}


def _inputs(b, h, h_kv, sq, sk, d, *, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=gen, device=device).to(dtype)
    k = torch.randn(b, h_kv, sk, d, generator=gen, device=device).to(dtype)
    v = torch.randn(b, h_kv, sk, d, generator=gen, device=device).to(dtype)
    dout = torch.randn(b, h, sq, d, generator=gen, device=device)
    return q, k, v, dout


def _reference(q, k, v, dout, q_pos, k_pos, *, causal=True):
    """fp64 ``(out, lse, dq, dk, dv)`` of q over all of k/v, through SDPA.

    Rows that see no key get out 0, lse -inf and no gradient: SDPA needs a visible key in every
    row, so those rows see all keys there and are then replaced by 0 (the ``where`` passes them
    no gradient either).
    """
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    visible = q_pos[:, None] >= k_pos[None, :] if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    seen = visible.any(1)[:, None]
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(qd, kr, vr, attn_mask=visible | ~seen)
    out = torch.where(seen, out, 0.0)
    out.backward(dout.double())
    scores = (qd @ kr.transpose(-1, -2)).detach() / math.sqrt(q.shape[-1])
    lse = scores.masked_fill(~visible, float("-inf")).logsumexp(-1)
    return out.detach(), lse, qd.grad, kd.grad, vd.grad


def _blockwise(q, k, v, dout, q_pos, k_pos, blocks, *, backend, causal=True):
    """Ring-attention arithmetic: each key block's forward merged into ``(out, lse)``, then each
    block's backward with the merged ``lse``/``delta``; dq summed, dk/dv scattered back."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], float("-inf"))
    for idx in blocks:
        merge_attention_blocks(
            out, lse, *attention_block_forward(q, k[:, :, idx], v[:, :, idx], q_pos, k_pos[idx], causal=causal, backend=backend)
        )
    delta = (dout * out).sum(-1)
    dq = torch.zeros(q.shape)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    for idx in blocks:
        grads = attention_block_backward(
            dout, q, k[:, :, idx], v[:, :, idx], lse, delta, q_pos, k_pos[idx], causal=causal, backend=backend
        )
        dq += grads[0]
        dk[:, :, idx], dv[:, :, idx] = grads[1], grads[2]
    return out, lse, dq, dk, dv


def _assert_all_close(got, want, **tol) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


def _run(q, k, v, dout, q_pos, k_pos, *, backend, causal=True):
    out, lse = attention_block_forward(q, k, v, q_pos, k_pos, causal=causal, backend=backend)
    delta = (dout * out).sum(-1)
    return (out, lse, *attention_block_backward(dout, q, k, v, lse, delta, q_pos, k_pos, causal=causal, backend=backend))


# (B, H, Hkv, Sq, Sk, D): GQA 4:2 at odd sizes (D=24 padded to 32, partial tiles); GQA 4:1 with
# D=8 (padded to 16); more keys than queries, D=64, one tile of rows.
SHAPES = [(1, 4, 2, 13, 21, 24), (2, 4, 1, 16, 16, 8), (1, 2, 2, 5, 40, 64)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_vs_sdpa(backend, causal, shape):
    b, h, h_kv, sq, sk, d = shape
    q, k, v, dout = _inputs(b, h, h_kv, sq, sk, d)
    q_pos, k_pos = torch.arange(sk - sq, sk), torch.arange(sk)  # the queries are the last Sq tokens
    got = _run(q, k, v, dout, q_pos, k_pos, backend=backend, causal=causal)
    _assert_all_close(got, _reference(q, k, v, dout, q_pos, k_pos, causal=causal), **FP32)


def _layout(kind: str, n: int, ranks: int, seed: int = 0) -> list[torch.Tensor]:
    """Each rank's token positions: zigzag (rank r holds chunks r and 2R-1-r of 2R) or a random
    permutation of the sequence cut in R pieces (unsorted positions)."""
    if kind == "zigzag":
        chunks = torch.arange(n).chunk(2 * ranks)
        return [torch.cat([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)]
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).chunk(ranks))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["zigzag", "permutation"])
def test_context_parallel_blocks_merge_to_sdpa(backend, kind):
    """Rank 0's queries against every rank's key block (merged), vs SDPA over all keys: the zigzag
    block of rank 1 is invisible to rank 0's first chunk (those rows get lse -inf from it)."""
    ranks, n = 3, 36
    pos = _layout(kind, n, ranks)
    q_pos, k_pos = pos[0], torch.cat(pos)
    blocks = [torch.arange(r * (n // ranks), (r + 1) * (n // ranks)) for r in range(ranks)]
    q, k, v, dout = _inputs(1, 4, 2, len(q_pos), n, 24, seed=1)
    got = _blockwise(q, k, v, dout, q_pos, k_pos, blocks, backend=backend)
    _assert_all_close(got, _reference(q, k, v, dout, q_pos, k_pos), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_low_precision_inputs_vs_sdpa(dtype, causal):
    q, k, v, dout = _inputs(1, 4, 2, 13, 21, 24, dtype=dtype, seed=2)
    q_pos, k_pos = torch.arange(8, 21), torch.arange(21)
    want = _reference(q, k, v, dout, q_pos, k_pos, causal=causal)
    _assert_all_close(_run(q, k, v, dout, q_pos, k_pos, backend="torch", causal=causal), want, **FP32)
    _assert_all_close(_run(q, k, v, dout, q_pos, k_pos, backend="triton", causal=causal), want, **LOWP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_path_on_permuted_positions(dtype):
    """The two paths of the module on unsorted positions, GQA 4:1 (every key tile of the Triton
    path is partly visible, so the tile-range scan cannot skip anything it must not)."""
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(40, generator=gen)
    q_pos, k_pos = perm[:17], perm[17:40]
    q, k, v, dout = _inputs(2, 4, 1, 17, 23, 32, dtype=dtype, seed=3)
    got = _run(q, k, v, dout, q_pos, k_pos, backend="triton")
    want = _run(q, k, v, dout, q_pos, k_pos, backend="torch")
    _assert_all_close(got, want, **(FP32 if dtype == torch.float32 else LOWP[dtype]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key(backend):
    """Rows whose position precedes every key: out 0 and lse -inf exactly, and no gradient (their
    merged lse is -inf too); a block no row sees changes nothing."""
    q, k, v, dout = _inputs(1, 4, 2, 13, 21, 24, seed=4)
    q_pos, k_pos = torch.arange(13) - 5, torch.arange(21)  # rows 0-4 see nothing
    got = _run(q, k, v, dout, q_pos, k_pos, backend=backend)
    out, lse, dq = got[0], got[1], got[2]
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    assert torch.equal(lse[:, :, :5], torch.full_like(lse[:, :, :5], float("-inf")))
    assert torch.equal(dq[:, :, :5], torch.zeros_like(dq[:, :, :5]))
    assert torch.isfinite(lse[:, :, 5:]).all() and all(torch.isfinite(g).all() for g in got[2:])
    _assert_all_close(got, _reference(q, k, v, dout, q_pos, k_pos), **FP32)

    none = _run(q, k, v, dout, q_pos - 100, k_pos, backend=backend)  # nothing visible at all
    assert torch.equal(none[1], torch.full_like(none[1], float("-inf")))
    for t in (none[0], *none[2:]):
        assert torch.equal(t, torch.zeros_like(t))


def test_strided_inputs_match_contiguous():
    """q/k/v as [B, S, H, D] storage viewed [B, H, S, D] (row stride H*D), and a v whose feature
    dimension is not contiguous (copied by the launcher): the same numbers as contiguous inputs."""
    q, k, v, dout = _inputs(2, 4, 2, 13, 21, 24, seed=5)
    q_pos, k_pos = torch.arange(8, 21), torch.arange(21)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
    ks = k.transpose(1, 2).contiguous().transpose(1, 2)
    vs = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qs.stride(2) == 4 * 24 and vs.stride(-1) != 1
    got = _run(qs, ks, vs, dout.transpose(1, 2).contiguous().transpose(1, 2), q_pos, k_pos, backend="triton")
    want = _run(q, k, v, dout, q_pos, k_pos, backend="triton")
    _assert_all_close(got, want, rtol=0, atol=0)


def test_launches_and_empty_inputs():
    q, k, v, dout = _inputs(1, 2, 1, 5, 7, 16)
    pos = torch.arange(7)
    with count_launches() as launches:
        out, lse = attention_block_forward(q, k, v, pos[2:], pos, backend="triton")
        attention_block_backward(dout, q, k, v, lse, (dout * out).sum(-1), pos[2:], pos, backend="triton")
    assert dict(launches) == {"_attn_fwd_kernel": 1, "_attn_bwd_dkdv_kernel": 1, "_attn_bwd_dq_kernel": 1}
    with count_launches() as launches:  # no keys: zeros and -inf, nothing launched
        out, lse = attention_block_forward(q, k[:, :, :0], v[:, :, :0], pos[2:], pos[:0], backend="triton")
        grads = attention_block_backward(
            dout, q, k[:, :, :0], v[:, :, :0], lse, torch.zeros_like(lse), pos[2:], pos[:0], backend="triton"
        )
        empty = attention_block_forward(q[:, :, :0], k, v, pos[:0], pos, backend="triton")
    assert not launches
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, float("-inf")))
    assert torch.equal(grads[0], torch.zeros_like(grads[0])) and grads[1].shape == (1, 1, 0, 16)
    assert empty[0].shape == (1, 2, 0, 16) and empty[1].shape == (1, 2, 0)


def test_head_dim_limit():
    q, k, v, _ = _inputs(1, 1, 1, 2, 2, 136)
    pos = torch.arange(2)
    with pytest.raises(ValueError, match="head_dim <= 128"):
        attention_block_forward(q, k, v, pos, pos, backend="triton")
    attention_block_forward(q, k, v, pos, pos, backend="torch")  # the torch path takes any D


def test_aot_configs_cover_every_kernel():
    names = {c["name"] for c in AOT_CONFIGS()}
    for kind in ("fwd", "dkdv", "dq"):
        assert {f"attention_{kind}_bf16_d64", f"attention_{kind}_bf16_d128", f"attention_{kind}_fp16_d128"} <= names


def test_hopper_only_configs_compile_without_spills_at_sm90():
    """Launch configs that differ on sm_90 (dk/dv at D=128 on 4 warps) are not in AOT_CONFIGS,
    whose every entry the AOT tests also compile for sm_80 (where these would spill and never
    run): their sm_90 compile must have no spills."""
    from shardkit.kernels.aot import compile_config, kernel_resources

    checked = 0
    for base in AOT_CONFIGS():
        kind, suffix, d = base["name"].split("_")[1:]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[suffix]
        tiles = _cuda_tiles(kind, 90, int(d[1:]), dtype)
        if tiles == _cuda_tiles(kind, 80, int(d[1:]), dtype) or suffix != "bf16":  # fp16: the same registers
            continue
        blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SCAN=tiles.scan)
        cfg = {
            **base,
            "name": base["name"] + "_sm90",
            "num_warps": tiles.num_warps,
            "constexprs": {**base["constexprs"], **blocks},
        }
        res = kernel_resources(compile_config(cfg, 90), cfg)
        assert (res["spill_stores_bytes"], res["spill_loads_bytes"], res["local_bytes"]) == (0, 0, 0), res
        checked += 1
    assert checked == 1  # dkdv bf16 d128


# ---- compiled kernels on CUDA (skipped without a GPU) -------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_reference(q, k, v, dout, *, causal, dtype):
    """SDPA forward + backward with the key/value heads repeated, on ``dtype`` copies of the
    inputs: fp32 is the reference, bf16 the peer whose error bounds ours."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1), is_causal=causal)
    out.backward(dout.to(dtype))
    return [t.float() for t in (out.detach(), qd.grad, kd.grad, vd.grad)]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "shape, causal",
    [((2, 8, 2, 1024, 128), True), ((1, 32, 8, 4096, 128), True), ((2, 8, 8, 1024, 64), False)],
    ids=["b2h8kv2-s1024-d128-causal", "b1h32kv8-s4096-d128-causal", "b2h8kv8-s1024-d64"],
)
def test_cuda_compiled_vs_sdpa(shape, causal):
    """Compiled bf16 kernels vs SDPA: our error against the fp32 reference is at most twice
    (plus 1e-4) that of SDPA run in bf16 itself, flash attention's own test criterion."""
    b, h, h_kv, s, d = shape
    q, k, v, dout = _inputs(b, h, h_kv, s, s, d, dtype=torch.bfloat16, device="cuda")
    dout = dout.to(torch.bfloat16)
    pos = torch.arange(s, device="cuda")
    out, lse = attention_block_forward(q, k, v, pos, pos, causal=causal, backend="triton")
    grads = attention_block_backward(dout, q, k, v, lse, (dout.float() * out).sum(-1), pos, pos, causal=causal, backend="triton")
    ref = _cuda_reference(q, k, v, dout, causal=causal, dtype=torch.float32)
    peer = _cuda_reference(q, k, v, dout, causal=causal, dtype=torch.bfloat16)
    for name, ours, want, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, peer):
        assert _max_err(ours, want) <= 2 * _max_err(theirs, want) + 1e-4, (name, _max_err(ours, want), _max_err(theirs, want))
    lse_ref = attention_block_forward(q.float(), k.float(), v.float(), pos, pos, causal=causal, backend="torch")[1]
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["zigzag", "permutation"])
def test_cuda_blocks_match_torch_path(kind, dtype):
    """Compiled kernels on context-parallel layouts (unsorted positions, invisible tiles and
    rows) vs the torch path on the same GPU, block by block."""
    ranks, n = 4, 2048
    pos = [p.cuda() for p in _layout(kind, n, ranks)]
    q, k, v, dout = _inputs(1, 8, 2, n // ranks, n // ranks, 128, dtype=dtype, device="cuda")
    out, lse = attention_block_forward(q, k, v, pos[0], pos[0], backend="torch")
    for r in range(1, ranks):
        merge_attention_blocks(out, lse, *attention_block_forward(q, k, v, pos[0], pos[r], backend="torch"))
    delta = (dout * out).sum(-1)
    # fp32: sums of up to 2048 terms in another order; bf16: as LOWP, sums ~100x longer
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for r in range(ranks):
        got = attention_block_forward(q, k, v, pos[0], pos[r], backend="triton")
        want = attention_block_forward(q, k, v, pos[0], pos[r], backend="torch")
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **tol)
        got = attention_block_backward(dout, q, k, v, lse, delta, pos[0], pos[r], backend="triton")
        want = attention_block_backward(dout, q, k, v, lse, delta, pos[0], pos[r], backend="torch")
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **tol)


# ---- the CPU torch path's two routes ----------------------------------------------------------
def _zigzag(n, ranks, r):
    c = n // (2 * ranks)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * ranks - 1 - r) * c, (2 * ranks - r) * c)])


def test_run_pairs_cover_the_chunked_layouts():
    """Zigzag and contiguous blocks split into fully visible pairs and same-run causal pairs; a
    block whose visibility is cut inside a run is left to the chunked path."""
    from shardkit.kernels.attention import _run_pairs

    q_pos, k_pos = _zigzag(16, 2, 0), _zigzag(16, 2, 1)  # rank 0 (0-3, 12-15) over rank 1's keys (4-11: one run)
    assert _run_pairs(q_pos, k_pos, True) == [(slice(4, 8), slice(0, 8), False)]
    # a block over itself with increasing positions: causal by index is causal by position, one call
    assert _run_pairs(q_pos, q_pos, True) == [(slice(0, 8), slice(0, 8), True)]
    three = torch.tensor([0, 1, 5, 6, 2])  # not increasing: run by run, visible neighbours joined
    assert _run_pairs(three, three, True) == [
        (slice(0, 2), slice(0, 2), True),
        (slice(2, 5), slice(0, 2), False),  # 5-6 and 2 see 0-1
        (slice(2, 4), slice(2, 4), True),
        (slice(2, 5), slice(4, 5), False),  # 5-6 and 2 see 2
    ]
    assert _run_pairs(torch.arange(8, 21), torch.arange(21), True) is None  # a run cut at 8
    assert _run_pairs(torch.tensor([3, 1, 2]), torch.tensor([0, 5]), False) == [(slice(0, 3), slice(0, 2), False)]
    # cp 4 (chunks of 2): fully visible pairs side by side are joined into one call
    r0, r1 = _zigzag(16, 4, 0), _zigzag(16, 4, 1)  # rank 0: 0-1, 14-15; rank 1: 2-3, 12-13
    assert _run_pairs(r0, r1, True) == [(slice(2, 4), slice(0, 4), False)]  # 14-15 sees both key runs
    assert _run_pairs(r1, r0, True) == [(slice(0, 4), slice(0, 2), False)]  # both query runs see 0-1


def test_cpu_flash_route_sets_every_column_when_pairs_cover_it_in_parts(monkeypatch):
    """Positions 0, 7, 1, 6 over themselves (a hybrid group's block with one-token chunks): the
    joined pairs cover key 0 alone first, then keys 0-3 together. Buffers the CPU path starts
    uninitialized are filled with NaN here, so a column added into before it was set shows."""
    from shardkit.kernels import attention as attn

    pos = torch.tensor([0, 7, 1, 6])
    pairs = attn._run_pairs(pos, pos, True)
    assert (slice(0, 1), slice(0, 1), False) in pairs and (slice(1, 2), slice(0, 4), False) in pairs
    real_empty = torch.empty
    monkeypatch.setattr(attn.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    q, k, v, dout = _inputs(1, 2, 2, 4, 4, 8, dtype=torch.float32, seed=7)
    out, lse = attention_block_forward(q, k, v, pos, pos)
    delta = (dout * out).sum(-1)
    got = attention_block_backward(dout, q, k, v, lse, delta, pos, pos, out=out)
    monkeypatch.setattr(attn.torch, "empty", real_empty)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8**0.5  # written out in fp64, mask by position
    scores = scores.masked_fill(pos[:, None] < pos[None, :], float("-inf"))
    want_lse = scores.logsumexp(-1)
    want_out = (scores - want_lse[..., None]).exp() @ v.double()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    want = attention_block_backward(dout, q, k, v, lse, delta, pos, pos)  # no out: the chunked route
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h_kv", [4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_route_equals_the_chunked_route(causal, h_kv, dtype):
    """Ring attention's blocks under zigzag (cp 3): the fused CPU flash-attention route (taken when
    the merged ``out`` is given) and the chunked fp32 math route give the same out/lse/dq/dk/dv,
    and both equal the fp64 reference."""
    n, ranks = 24, 3
    q_pos = _zigzag(n, ranks, 1)
    blocks = [_zigzag(n, ranks, r) for r in range(ranks)]
    q, k, v, dout = _inputs(1, 4, h_kv, len(q_pos), n, 16, dtype=dtype, seed=4)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for idx in blocks:  # forward takes the flash route (the positions are runs)
        merge_attention_blocks(out, lse, *attention_block_forward(q, k[:, :, idx], v[:, :, idx], q_pos, idx, causal=causal))
    delta = (dout * out).sum(-1)
    routes = []
    for given in (out, None):
        dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
        for idx in blocks:
            g = attention_block_backward(dout, q, k[:, :, idx], v[:, :, idx], lse, delta, q_pos, idx, causal=causal, out=given)
            dq += g[0]
            dk[:, :, idx] += g[1]
            dv[:, :, idx] += g[2]
        routes.append((out, lse, dq, dk, dv))
    _assert_all_close(routes[0], routes[1], **FP32)
    _assert_all_close(routes[0], _reference(q, k, v, dout, q_pos, torch.arange(n), causal=causal), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_out", [False, True], ids=["chunked", "cpu-flash"])
def test_backward_adds_dq_into_a_given_accumulator_and_reads_a_strided_dout(backend, with_out):
    """Ring attention's use: ``dq_into`` receives this block's query gradient added to what it
    held (the other blocks'), and a ``dout`` that is the transposed gradient of a [B, S, H, D]
    output gives the same gradients as its contiguous copy."""
    if with_out and backend == "triton":
        pytest.skip("out= selects the torch path's CPU flash route only")
    q, k, v, dout = _inputs(1, 2, 1, 16, 16, 16)
    pos = torch.arange(16)
    out, lse = attention_block_forward(q, k, v, pos, pos, backend=backend)
    delta = (dout * out).sum(-1)
    extra = dict(out=out) if with_out else {}
    want = attention_block_backward(dout, q, k, v, lse, delta, pos, pos, backend=backend, **extra)
    strided = dout.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D] memory
    assert not strided.is_contiguous()
    held = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    acc = held.clone()
    got = attention_block_backward(strided, q, k, v, lse, delta, pos, pos, backend=backend, dq_into=acc, **extra)
    assert got[0] is acc
    torch.testing.assert_close(acc, held + want[0], rtol=1e-6, atol=1e-6)
    for a, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dq_into"):
        attention_block_backward(dout, q, k, v, lse, delta, pos, pos, backend=backend, dq_into=acc.double())
