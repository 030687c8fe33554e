"""Vocab-parallel cross-entropy: the kernels (interpreted Triton and the torch path) against torch,
and ``vocab_parallel_cross_entropy`` at tp = 2 and 4 against ``F.cross_entropy`` on the gathered
logits."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import CommStats, ParallelContext
from shardkit.kernels.cross_entropy import AOT_CONFIGS, ce_grad_, ce_launch_config, ce_shard_stats
from shardkit.kernels.runtime import count_launches
from shardkit.parallel.tensor import vocab_parallel_cross_entropy, vocab_shard_range
from tolerances import FP32, LOWP_NO_MASTER

BACKENDS = ["triton", "torch"]  # "triton" on CPU tensors = Triton's interpreter
# Gradients stored in bf16: the kernel's fp32 value and torch's autograd fp32 value differ by a
# few fp32 ulp (another evaluation order), which can round to the neighbouring bf16: one ulp.
BF16_GRAD = LOWP_NO_MASTER[torch.bfloat16]


def _reference_loss(full: torch.Tensor, target: torch.Tensor, *, ignore_index=-100, smoothing=0.0, z_loss=0.0, reduction="mean"):
    """F.cross_entropy on fp32 logits plus the written-out z-loss ``z * logsumexp(x)²``."""
    x = full.float()
    per_token = F.cross_entropy(x, target, ignore_index=ignore_index, label_smoothing=smoothing, reduction="none")
    keep = target != ignore_index
    per_token = per_token + torch.where(keep, z_loss * torch.logsumexp(x, dim=1) ** 2, 0.0)
    if reduction == "none":
        return per_token
    return per_token.sum() / keep.sum() if reduction == "mean" else per_token.sum()


def _data(tokens: int, vocab: int, *, seed: int = 0, ignore_index: int = -100, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=gen) * 4).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[::5] = ignore_index  # every fifth token ignored
    return logits, target


# ---- kernels, one process -----------------------------------------------------------------------
# (tokens, shard width, valid columns): one element; odd (tail piece only, unaligned rows); wider
# than the interpreter's BLOCK (1024): a full piece + a tail; exactly one full piece, no tail; padded
# shard; a shard with no valid column; empty.
STATS_SHAPES = [(1, 1, 1), (5, 17, 17), (9, 1500, 1500), (3, 1024, 1024), (6, 40, 33), (4, 8, 0), (0, 8, 8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", STATS_SHAPES)
def test_shard_stats_vs_torch(backend, dtype, shape):
    tokens, width, n_valid = shape
    start = 3 * width  # this shard holds classes [3 Vs, 4 Vs)
    x, _ = _data(tokens, width, dtype=dtype)
    target = torch.randint(0, 6 * width, (tokens,), generator=torch.Generator().manual_seed(1))
    if tokens:
        target[0] = start + max(n_valid - 1, 0)  # at least one target inside the shard (when valid)
        target[-1] = -100 if tokens > 1 else target[-1]
    stats = ce_shard_stats(x, target, vocab_start=start, n_valid=n_valid, backend=backend)
    valid = x[:, :n_valid].float()
    local = target - start
    hit = (target != -100) & (local >= 0) & (local < n_valid)
    if n_valid:
        m = valid.amax(1)
        torch.testing.assert_close(stats[0], m, rtol=0, atol=0)
        torch.testing.assert_close(stats[1], torch.exp(valid - m[:, None]).sum(1), **FP32)
        torch.testing.assert_close(stats[3], valid.sum(1), rtol=1e-5, atol=1e-4)  # ~1500 terms of |x| ~ 4
    else:
        assert torch.all(stats[0] == float("-inf")) and torch.all(stats[1] == 0) and torch.all(stats[3] == 0)
    expect_xt = torch.where(hit, valid.gather(1, torch.where(hit, local, 0)[:, None]).squeeze(1) if n_valid else 0.0, 0.0)
    torch.testing.assert_close(stats[2], expect_xt, rtol=0, atol=0)
    if tokens and n_valid:
        assert hit[0] and stats[2, 0] != 0


def _autograd_grad(full, target, coef, **options):
    x = full.float().clone().requires_grad_()
    (_reference_loss(x, target, reduction="none", **options) * coef).sum().backward()
    return x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options", [{}, dict(smoothing=0.1), dict(z_loss=1e-2), dict(smoothing=0.2, z_loss=1e-3, ignore_index=3)]
)
@pytest.mark.parametrize("tp,vocab", [(1, 37), (3, 1200), (4, 30)])
def test_sharded_grad_vs_autograd(backend, dtype, options, tp, vocab):
    """Each shard's in-place gradient, given the global lse, is its columns of autograd's gradient
    of F.cross_entropy (+ z-loss), incl. padded and empty shards (vocab 30 at tp 4: 8+8+8+6)."""
    ignore_index = options.get("ignore_index", -100)
    full, target = _data(11, vocab, ignore_index=ignore_index, dtype=dtype)
    coef = torch.rand(11, generator=torch.Generator().manual_seed(2)) + 0.5
    expect = _autograd_grad(full, target, coef, **options)
    lse = torch.logsumexp(full.float(), dim=1)
    width = -(-vocab // tp)
    for r in range(tp):
        start, n_valid = vocab_shard_range(vocab, width, r)
        shard = torch.randn(11, width).to(dtype)  # pad columns hold garbage: they must come out 0
        shard[:, :n_valid] = full[:, start : start + n_valid]
        smoothing, z_loss = options.get("smoothing", 0.0), options.get("z_loss", 0.0)
        where = dict(vocab_start=start, n_valid=n_valid, ignore_index=ignore_index)
        out = ce_grad_(
            shard, target, lse, coef, vocab_size=vocab, label_smoothing=smoothing, z_loss=z_loss, backend=backend, **where
        )
        assert out is shard
        tol = FP32 if dtype == torch.float32 else BF16_GRAD
        torch.testing.assert_close(shard[:, :n_valid].float(), expect[:, start : start + n_valid], **tol)
        assert torch.all(shard[:, n_valid:] == 0)
        assert torch.all(shard[target == ignore_index] == 0)


def test_torch_path_chunks_bound_memory_and_match():
    """Many tokens through the torch path in chunks of a few rows equal one big chunk and torch."""
    full, target = _data(600, 50)
    stats_small = ce_shard_stats(full, target, backend="torch", chunk_elements=7 * 50)
    stats_big = ce_shard_stats(full, target, backend="torch")
    torch.testing.assert_close(stats_small, stats_big, rtol=0, atol=0)
    lse = stats_big[0] + stats_big[1].log()
    torch.testing.assert_close(lse, torch.logsumexp(full, 1), **FP32)
    coef = torch.full((600,), 1 / 600)
    g_small = ce_grad_(full.clone(), target, lse, coef, vocab_size=50, backend="torch", chunk_elements=7 * 50)
    g_big = ce_grad_(full.clone(), target, lse, coef, vocab_size=50, backend="torch")
    torch.testing.assert_close(g_small, g_big, rtol=0, atol=0)
    torch.testing.assert_close(g_small, _autograd_grad(full, target, coef), **FP32)


def test_triton_path_many_tokens_one_launch_each():
    full, target = _data(257, 40)
    with count_launches() as launches:
        stats = ce_shard_stats(full, target, backend="triton")
        lse = (stats[0] + stats[1].log()).contiguous()
        ce_grad_(full, target, lse, torch.ones(257), vocab_size=40, backend="triton")
    assert launches == {"_ce_stats_kernel": 1, "_ce_grad_kernel": 1}
    assert ce_launch_config(torch.device("cuda"), 128256) == (4096, 8)
    assert ce_launch_config(torch.device("cpu"), 1500) == (1024, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_stride_views(backend):
    """A column slice of wider logits (row stride != width, rows not 16-byte aligned) is read and
    written through its stride; the columns outside the view are untouched."""
    wide, target = _data(6, 1031)
    view = wide[:, 3:1030]  # 1027 columns, row stride 1031
    target = target.clamp(max=1026)
    stats = ce_shard_stats(view, target, backend=backend)
    lse = torch.logsumexp(view, 1)
    torch.testing.assert_close(stats[0] + stats[1].log(), lse, **FP32)
    before = wide.clone()
    ce_grad_(view, target, lse, torch.ones(6), vocab_size=1027, backend=backend)
    torch.testing.assert_close(view, _autograd_grad(before[:, 3:1030], target, torch.ones(6)), **FP32)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 1030:], before[:, 1030:])


@pytest.mark.parametrize("cc", [80, 90])
def test_full_pieces_use_128bit_accesses(cc):
    """[Note: full pieces]: at the default CUDA config every logits byte moves through 128-bit
    loads/stores (compiled ahead of time, no GPU needed), with no spills."""
    from shardkit.kernels.aot import compile_config, kernel_resources

    for cfg in AOT_CONFIGS():
        res = kernel_resources(compile_config(cfg, cc), cfg)
        assert res["vec128_bytes_per_element"] == cfg["bytes_per_element"], res
        assert res["spill_stores_bytes"] == res["spill_loads_bytes"] == 0, res


def test_kernel_argument_errors():
    x, t = _data(4, 8)
    with pytest.raises(ValueError, match="target must have shape"):
        ce_shard_stats(x, t[:3])
    with pytest.raises(TypeError, match="int64"):
        ce_shard_stats(x, t.int())
    with pytest.raises(ValueError, match="n_valid"):
        ce_shard_stats(x, t, n_valid=9)
    with pytest.raises(ValueError, match="unit column stride"):
        ce_shard_stats(x.t(), torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="lse must be"):
        ce_grad_(x, t, torch.zeros(3), torch.zeros(4), vocab_size=8)


def test_aot_configs_cover_both_kernels():
    names = {c["name"] for c in AOT_CONFIGS()}
    assert names == {"ce_stats_fp32", "ce_stats_bf16", "ce_grad_fp32", "ce_grad_bf16"}


# ---- vocab_parallel_cross_entropy over tp ranks -------------------------------------------------
CASES = [  # (vocab, dtype, options)
    (64, torch.float32, dict(reduction="mean")),
    (61, torch.float32, dict(reduction="sum", label_smoothing=0.1)),  # not divisible by tp
    (64, torch.float32, dict(reduction="none", z_loss=1e-3, ignore_index=5)),
    (50, torch.bfloat16, dict(reduction="mean", label_smoothing=0.05, z_loss=1e-4)),
    (5, torch.float32, dict(reduction="mean", label_smoothing=0.1)),  # tp 4: shards of 2, 2, 1, 0 classes
]


def _vocab_parallel_body(backend: str) -> float:
    tp = dist.get_world_size()
    with ParallelContext.from_world(tp=tp) as ctx:
        r = ctx.rank("tp")
        for i, (vocab, dtype, options) in enumerate(CASES):
            inplace = i % 2 == 0  # both places the gradient can go: over the logits, a new buffer
            ignore_index = options.get("ignore_index", -100)
            full, target = _data(2 * 3 * 4, vocab, seed=vocab, ignore_index=ignore_index, dtype=dtype)
            full, target = full.view(2, 12, vocab), target.view(2, 12)  # [batch, seq, V]
            width = -(-vocab // tp)
            padded = torch.cat([full, torch.full((2, 12, tp * width - vocab), 1e4).to(dtype)], -1)  # pads must never win
            leaf = padded[..., r * width : (r + 1) * width].clone().requires_grad_()
            logits = leaf * 1  # a non-leaf: its storage may receive the gradient
            stats = CommStats()
            loss = vocab_parallel_cross_entropy(
                logits, target, ctx=ctx, vocab_size=vocab, backend=backend, stats=stats, inplace_backward=inplace, **options
            )
            ref_x = full.float().view(-1, vocab).requires_grad_()
            smoothing, z = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)
            ref = _reference_loss(
                ref_x, target.view(-1), ignore_index=ignore_index, smoothing=smoothing, z_loss=z, reduction=options["reduction"]
            )
            torch.testing.assert_close(loss, ref.view(loss.shape), **FP32)
            assert loss.dtype == torch.float32
            # max: 4T, sums: 12T, the target check: 4
            assert stats.calls("all_reduce") == 2 and stats.bytes("all_reduce") == 4 * 24 * 4 + 4
            grad_out = torch.rand_like(loss) + 0.5
            loss.backward(grad_out)
            ref.backward(grad_out.view(ref.shape))
            start, n_valid = vocab_shard_range(vocab, width, r)
            got = leaf.grad.view(-1, width).float()
            tol = FP32 if dtype == torch.float32 else BF16_GRAD
            torch.testing.assert_close(got[:, :n_valid], ref_x.grad[:, start : start + n_valid], **tol)
            assert torch.all(got[:, n_valid:] == 0)
            before = padded[..., r * width : (r + 1) * width]
            # the gradient was written over the logits, or they are untouched
            assert torch.equal(logits.detach(), leaf.grad if inplace else before)
        return float(loss.detach().float().sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_ce_equals_cross_entropy_on_gathered_logits(dist_pool, world_size, backend):
    results = dist_pool.run(_vocab_parallel_body, backend, world_size=world_size, timeout=120)
    assert len(set(results)) == 1  # every rank computed the same loss


def _leaf_and_errors_body() -> None:
    with ParallelContext.from_world(tp=dist.get_world_size()) as ctx:
        x, t = _data(6, 8, seed=ctx.rank("tp"))
        leaf = x.clone().requires_grad_()
        vocab_parallel_cross_entropy(leaf, t, ctx=ctx, backend="torch").backward()
        assert torch.equal(leaf.detach(), x)  # a user's leaf is never overwritten with its gradient
        with mock.patch.object(dist, "all_reduce", side_effect=AssertionError("communicated")):
            bad = [
                (dict(logits_shard=x, target=t[:5]), ValueError, "leading shape"),
                (dict(logits_shard=x, target=t.int()), TypeError, "int64"),
                (dict(logits_shard=x, target=t, reduction="avg"), ValueError, "reduction"),
                (dict(logits_shard=x, target=t, label_smoothing=1.5), ValueError, "label_smoothing"),
                (dict(logits_shard=x, target=t, vocab_size=8 * ctx.size("tp") + 1), ValueError, "vocab_size"),
            ]
            for kwargs, exc, match in bad:
                with pytest.raises(exc, match=match):
                    vocab_parallel_cross_entropy(ctx=ctx, **kwargs)


def test_leaf_kept_and_bad_input_raises_before_any_collective(dist_pool):
    dist_pool.run(_leaf_and_errors_body, world_size=2, timeout=60)
