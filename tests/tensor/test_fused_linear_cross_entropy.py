"""``fused_linear_cross_entropy`` against ``F.cross_entropy(F.linear(hidden, W, b).float())`` on the
gathered weight: one process and tp = 2 / 4, sequence parallelism on and off, every reduction,
ignore_index spread unevenly, label smoothing, z-loss, soft-capping, fp32/bf16/fp16, a bias, a
weight tied to an embedding; the gradients of hidden, weight and bias; the chunking bound."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext
from shardkit.parallel.tensor import fused_linear_cross_entropy, vocab_shard_range
from shardkit.parallel.tensor import fused_linear_loss
from tolerances import FP32

#: Low-precision gradients. The reference forms ``dhidden = dlogits @ W`` in one matmul over the
#: whole vocabulary; here each tp rank's partial product over its shard is rounded to the dtype
#: before the all-reduce (or reduce-scatter) adds them, and ``dW`` is the sum of per-chunk products
#: each rounded once. Each rounding costs half an ulp of a partial sum, and partial sums can be
#: larger than the total they cancel to: a few ulp of the gradient's scale (2^-7 bf16, 2^-10
#: fp16), so the bound is relative to the largest entry. A wrong term (a missed chunk, a wrong
#: scale, a pad class that wins) is off by far more than that.
LOWP_GRAD_ULPS = 4
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _assert_grad_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, **FP32)
        return
    scale = ref.float().abs().max().item()
    bound = LOWP_GRAD_ULPS * ULP[got.dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=bound, atol=bound * scale)


def _reference(h, weight, bias, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
    x = F.linear(h, weight, bias).float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    x, t = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    per = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    keep = t != ignore_index
    per = per + torch.where(keep, z_loss * torch.logsumexp(x, 1) ** 2, 0.0)
    if reduction == "none":
        return per.view(target.shape)
    return per.sum() / keep.sum() if reduction == "mean" else per.sum()


def _data(b, s, d, vocab, dtype, *, seed, ignore_index=-100, bias=False):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(b, s, d, generator=gen).to(dtype)
    w = (torch.randn(vocab, d, generator=gen) / d**0.5 * 3).to(dtype)
    bb = torch.randn(vocab, generator=gen).to(dtype) if bias else None
    t = torch.randint(0, vocab, (b, s), generator=gen)
    t[0, : s // 2] = ignore_index  # ignored tokens bunched in one place: uneven over chunks and ranks
    t[1:, ::3] = ignore_index
    return h, w, bb, t


# ---- one process (ctx=None) ---------------------------------------------------------------------
OPTIONS = [
    dict(reduction="mean"),
    dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
    dict(reduction="none", softcap=2.5, ignore_index=3),
    dict(reduction="mean", softcap=4.0, label_smoothing=0.05, z_loss=1e-4),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_tokens", [1, 5, None])  # every token alone; uneven chunks; one chunk
def test_one_process_equals_linear_then_cross_entropy(options, dtype, chunk_tokens):
    ignore_index = options.get("ignore_index", -100)
    h, w, b, t = _data(3, 7, 16, 37, dtype, seed=1, ignore_index=ignore_index, bias=True)
    h, w, b = (x.clone().requires_grad_() for x in (h, w, b))
    loss = fused_linear_cross_entropy(h, w, t, bias=b, chunk_tokens=chunk_tokens, **options)
    grad_out = torch.rand_like(loss) + 0.5
    loss.backward(grad_out)
    got = (h.grad, w.grad, b.grad)
    h.grad = w.grad = b.grad = None
    ref = _reference(h, w, b, t, **options)
    torch.testing.assert_close(loss, ref, **FP32)
    assert loss.dtype == torch.float32
    ref.backward(grad_out)
    for g, r in zip(got, (h.grad, w.grad, b.grad)):
        assert g.dtype == dtype
        _assert_grad_close(g, r)


def test_frozen_weight_and_no_grad_compute_only_what_is_needed():
    h, w, _, t = _data(2, 5, 8, 11, torch.float32, seed=2)
    hh = h.clone().requires_grad_()
    fused_linear_cross_entropy(hh, w, t).backward()  # a frozen head: only dhidden
    ref_h = h.clone().requires_grad_()
    _reference(ref_h, w, None, t).backward()
    torch.testing.assert_close(hh.grad, ref_h.grad, **FP32)
    with torch.no_grad(), mock.patch.object(fused_linear_loss, "_dlogits", side_effect=AssertionError("gradient formed")):
        loss = fused_linear_cross_entropy(hh, w, t)
    torch.testing.assert_close(loss, _reference(h, w, None, t), **FP32)


def test_logits_are_formed_one_chunk_at_a_time():
    h, w, _, t = _data(4, 9, 8, 50, torch.float32, seed=3)
    shapes = []
    real = F.linear

    def spy(x, weight, bias=None):
        shapes.append(tuple(x.shape))
        return real(x, weight, bias)

    with mock.patch.object(fused_linear_loss.F, "linear", spy):
        h = h.requires_grad_()
        fused_linear_cross_entropy(h, w, t, chunk_tokens=10, reduction="none").sum().backward()
    assert shapes and all(len(s) == 2 and s[0] <= 10 for s in shapes)
    assert sum(s[0] for s in shapes) == 2 * 36  # forward, then the backward's recomputation
    assert fused_linear_loss.default_chunk_tokens(32768, 2) * 32768 * 2 == fused_linear_loss.DEFAULT_CHUNK_BYTES
    assert fused_linear_loss.default_chunk_tokens(1 << 20, 2) == fused_linear_loss.MIN_CHUNK_TOKENS


def test_second_backward_through_a_scalar_loss_raises():
    h, w, _, t = _data(2, 4, 8, 9, torch.float32, seed=4)
    loss = fused_linear_cross_entropy(h.requires_grad_(), w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_out_of_range_target_and_bad_arguments():
    h, w, b, t = _data(2, 4, 8, 9, torch.float32, seed=5, bias=True)
    bad_t = t.clone()
    bad_t[1, 1] = 9
    with pytest.raises(IndexError, match=r"fused_linear_cross_entropy: targets outside \[0, 9\)"):
        fused_linear_cross_entropy(h, w, bad_t)
    cases = [
        (dict(hidden=h[..., :7]), ValueError, "hidden must be"),
        (dict(weight=w.double()), TypeError, "weight must be"),
        (dict(hidden=h.bfloat16()), TypeError, "same dtype"),
        (dict(target=t[:, :3]), ValueError, "leading shape"),
        (dict(target=t.int()), TypeError, "int64"),
        (dict(bias=b[:4]), ValueError, "bias"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(z_loss=-1.0), ValueError, "z_loss"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(chunk_tokens=0), ValueError, "chunk_tokens"),
        (dict(vocab_size=10), ValueError, "vocab_size"),
        (dict(sequence_parallel=True), ValueError, "needs ctx"),
    ]
    for change, exc, match in cases:
        kwargs = dict(hidden=h, weight=w, target=t) | change
        with pytest.raises(exc, match=match):
            fused_linear_cross_entropy(**kwargs)


# ---- over tp ranks -----------------------------------------------------------------------------
TP_CASES = [  # (vocab, dtype, sequence_parallel, options)
    (64, torch.float32, False, dict(reduction="mean")),
    (61, torch.float32, True, dict(reduction="sum", label_smoothing=0.1)),  # V not divisible by tp
    (64, torch.float32, True, dict(reduction="none", z_loss=1e-3, softcap=3.0, ignore_index=5)),
    (50, torch.bfloat16, False, dict(reduction="mean", label_smoothing=0.05, z_loss=1e-4)),
    (50, torch.float16, True, dict(reduction="mean", softcap=5.0)),
    (5, torch.float32, False, dict(reduction="mean", label_smoothing=0.1)),  # tp 4: shards of 2, 2, 1, 0 classes
]


def _tp_body(bias: bool) -> float:
    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        r = ctx.rank("tp")
        for vocab, dtype, sp, options in TP_CASES:
            ignore_index = options.get("ignore_index", -100)
            b, s, d = 2, 8, 16
            h, w, bb, t = _data(b, s, d, vocab, dtype, seed=vocab, ignore_index=ignore_index, bias=bias)
            width = -(-vocab // tp)
            start, n_valid = vocab_shard_range(vocab, width, r)
            pad = tp * width - vocab  # pad rows must never win nor receive a gradient
            w_pad = torch.cat([w, torch.full((pad, d), 3.0, dtype=dtype)])
            b_pad = None if bb is None else torch.cat([bb, torch.full((pad,), 50.0, dtype=dtype)])
            w_r = w_pad[r * width : (r + 1) * width].clone().requires_grad_()
            b_r = None if b_pad is None else b_pad[r * width : (r + 1) * width].clone().requires_grad_()
            h_r = (h[:, r * s // tp : (r + 1) * s // tp] if sp else h).clone().requires_grad_()
            stats = CommStats()
            loss = fused_linear_cross_entropy(
                h_r, w_r, t, ctx=ctx, bias=b_r, vocab_size=vocab, sequence_parallel=sp, chunk_tokens=6, stats=stats, **options
            )
            grad_out = torch.rand(loss.shape, generator=torch.Generator().manual_seed(7)) + 0.5
            loss.backward(grad_out)
            ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
            ref_b = None if bb is None else bb.clone().requires_grad_()
            ref = _reference(ref_h, ref_w, ref_b, t, **options)
            torch.testing.assert_close(loss, ref, **FP32)
            ref.backward(grad_out)
            expect_h = ref_h.grad[:, r * s // tp : (r + 1) * s // tp] if sp else ref_h.grad
            _assert_grad_close(h_r.grad, expect_h)
            _assert_grad_close(w_r.grad[:n_valid], ref_w.grad[start : start + n_valid])
            assert torch.all(w_r.grad[n_valid:] == 0)
            if b_r is not None:
                _assert_grad_close(b_r.grad[:n_valid], ref_b.grad[start : start + n_valid])
                assert torch.all(b_r.grad[n_valid:] == 0)
            if sp:  # chunks gathered and reduce-scattered, never the whole sequence
                assert stats.calls("all_gather") >= 2 and stats.calls("reduce_scatter") >= 2
            else:
                assert stats.calls("all_gather") == 0
        return float(loss.detach().float().sum())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_vocab_parallel_equals_cross_entropy_on_the_gathered_weight(dist_pool, world_size, bias):
    results = dist_pool.run(_tp_body, bias, world_size=world_size, timeout=180)
    assert len(set(results)) == 1  # every rank computed the same loss


def _tied_body() -> None:
    """The head shares the vocab-parallel embedding's weight: both gradients land on one param."""
    from shardkit.parallel.tensor import VocabParallelEmbedding

    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        torch.manual_seed(0)
        vocab, d = 29, 12
        full = torch.nn.Embedding(vocab, d)
        emb = VocabParallelEmbedding(vocab, d, ctx=ctx)
        width = emb.weight.shape[0]
        r = ctx.rank("tp")
        with torch.no_grad():
            emb.weight.zero_()
            rows = full.weight[r * width : (r + 1) * width]
            emb.weight[: rows.shape[0]] = rows
        ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
        mix = torch.nn.Linear(d, d)  # something between the embedding and the head
        torch.nn.init.normal_(mix.weight, generator=torch.Generator().manual_seed(2))
        hidden = mix(emb(ids[:, :-1]))
        loss = fused_linear_cross_entropy(hidden, emb.weight, ids[:, 1:], ctx=ctx, vocab_size=vocab, chunk_tokens=4)
        loss.backward()
        ref = _reference(mix(full(ids[:, :-1])), full.weight, None, ids[:, 1:])
        ref_grad = torch.autograd.grad(ref, full.weight)[0]
        torch.testing.assert_close(loss, ref, **FP32)
        n = rows.shape[0]
        torch.testing.assert_close(emb.weight.grad[:n], ref_grad[r * width : r * width + n], **FP32)


def test_weight_tied_to_a_vocab_parallel_embedding(dist_pool):
    dist_pool.run(_tied_body, world_size=2, timeout=120)


def _errors_body() -> None:
    with ParallelContext.from_world(tp=dist.get_world_size()) as ctx:
        h, w, _, t = _data(2, 4, 8, 9, torch.float32, seed=ctx.rank("tp"))
        w = w[:5]
        bad_t = t.clone()
        bad_t[0, 0] = 10
        with mock.patch.object(dist, "all_reduce", side_effect=AssertionError("communicated")):
            for kwargs, exc, match in [
                (dict(target=t[:, :3], sequence_parallel=True), ValueError, "whole sequence"),
                (dict(target=bad_t), IndexError, "targets outside"),
                (dict(vocab_size=11), ValueError, "vocab_size"),
            ]:
                with pytest.raises(exc, match=match):
                    fused_linear_cross_entropy(**(dict(hidden=h, weight=w, target=t, ctx=ctx) | kwargs))


def test_bad_input_raises_before_any_collective(dist_pool):
    dist_pool.run(_errors_body, world_size=2, timeout=60)


def test_triton_kernels_through_the_interpreter():
    """The statistics and gradient passes as Triton kernels (the CUDA path), interpreted."""
    h, w, b, t = _data(2, 6, 8, 40, torch.float32, seed=6, bias=True)
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = fused_linear_cross_entropy(h, w, t, bias=b, chunk_tokens=5, label_smoothing=0.1, backend="triton")
    loss.backward()
    rh, rw = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference(rh, rw, b, t, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(h.grad, rh.grad, **FP32)
    torch.testing.assert_close(w.grad, rw.grad, **FP32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_kernels_equal_the_reference(dtype):
    """On CUDA: cuBLAS chunks and the compiled statistics/gradient kernels, a vocabulary wider than
    one kernel piece (4096 columns), softcap and smoothing on."""
    torch.manual_seed(0)
    h, w, b, t = (x.cuda() if x is not None else None for x in _data(4, 300, 64, 5000, dtype, seed=8, bias=True))
    h, w, b = (x.requires_grad_() for x in (h, w, b))
    options = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    loss = fused_linear_cross_entropy(h, w, t, bias=b, chunk_tokens=256, **options)
    loss.backward()
    got = (h.grad, w.grad, b.grad)
    h.grad = w.grad = b.grad = None
    ref = _reference(h, w, b, t, **options)
    ref.backward()
    torch.testing.assert_close(loss, ref, **FP32)
    for g, r in zip(got, (h.grad, w.grad, b.grad)):
        _assert_grad_close(g, r)


@pytest.mark.parametrize(
    "dtype, tokens, d, softcap, chunks",
    [
        (torch.bfloat16, 32, 16, None, [32]),  # all logits (2 T V bytes) fit the accumulator (4 V d): one chunk
        (torch.bfloat16, 33, 16, None, [17, 16]),  # else chunks up to the accumulator's size (2 d), made equal
        (torch.float16, 70, 16, None, [24, 24, 22]),
        (torch.bfloat16, 9, 1, None, [3, 3, 3]),  # never below the byte budget's chunk (4 here), equal
        (torch.float32, 8, 16, None, [4, 4]),  # fp32 sums in the weight's dtype: the byte budget alone
        (torch.bfloat16, 32, 56, None, [32]),
        (torch.bfloat16, 32, 56, 30.0, [16, 16]),  # softcap: 12 bytes per bf16 logit, so 4 d / 12 = 18 tokens...
        (torch.bfloat16, 37, 56, 30.0, [13, 13, 11]),  # ... and equal chunks of at most that
        (torch.float32, 8, 56, 30.0, [4, 4]),  # fp32: the byte budget (8 bytes per logit with softcap)
    ],
)
def test_default_chunks_are_as_large_as_the_weight_gradient_accumulator(dtype, tokens, d, softcap, chunks):
    """bf16/fp16 with several chunks need an fp32 weight-gradient accumulator (4 V d bytes), so
    the default lets a chunk's logits (2 bytes each, 12 with softcap's fp32 copies) take that
    much: 2 d tokens per chunk (softcap: 4 d / 12), one chunk when all the tokens fit, else equal
    chunks. Here the byte budget gives 4-token chunks."""
    h = torch.randn(tokens, d).to(dtype).requires_grad_()
    w = torch.randn(13, d).to(dtype).requires_grad_()
    t = torch.randint(13, (tokens,))
    rows = []
    real = F.linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    with (
        mock.patch.object(fused_linear_loss, "MIN_CHUNK_TOKENS", 4),
        mock.patch.object(fused_linear_loss, "DEFAULT_CHUNK_BYTES", 1),
        mock.patch.object(fused_linear_loss.F, "linear", spy),
    ):
        fused_linear_cross_entropy(h, w, t, softcap=softcap).backward()
    assert rows == chunks


def test_fp16_gradients_survive_a_loss_scale():
    """fp16 with many tokens: the mean's logits gradient (p - onehot) / n is below fp16's normal
    range, so the fused forward pass forms the sum's and backward divides in fp32. Against fp64,
    under a 2^16 loss scale, the error must stay at fp16's own level (here 2-3e-4, the unfused
    path's 2e-4; forming the mean's gradient in fp16 gave 2e-2 for dhidden and 5e-2 for dW)."""
    gen = torch.Generator().manual_seed(11)
    tokens, vocab, d = 8192, 1024, 16
    h = torch.randn(tokens, d, generator=gen).half().requires_grad_()
    w = (0.02 * torch.randn(vocab, d, generator=gen)).half().requires_grad_()
    t = torch.randint(vocab, (tokens,), generator=gen)
    (fused_linear_cross_entropy(h, w, t, chunk_tokens=512) * 2.0**16).backward()
    rh, rw = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.cross_entropy(F.linear(rh, rw), t).backward()
    for got, ref in ((h.grad, rh.grad), (w.grad, rw.grad)):
        err = ((got.double() / 2.0**16 - ref).norm() / ref.norm()).item()
        assert err < 1e-3, err
