"""Compiled kernels on CUDA vs torch: the paths production models take (all skipped without CUDA).

Every launcher runs on CUDA tensors with ``backend="triton"`` (compiled Triton) and is compared
with ``backend="torch"`` (torch's fused/foreach CUDA ops) or a written-out fp32 reference: the
aligned full-chunk path with odd-sized tails, fp16 and bf16 with fp32 masters, a GradScaler
``grad_scale``, ``maximize``, LAMB (and its bitwise reproducibility), the bucket copies and the
gradient epilogue, the cross-entropy shard kernels on GPT-2's vocabulary, and launch groups on
two GPUs.
"""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from shardkit.kernels.adam import adam_step
from shardkit.kernels.cross_entropy import ce_grad, ce_shard_stats
from shardkit.kernels.flatten import ALIGN_ELEMENTS, bucket_layout, flatten_into, unflatten_from
from shardkit.kernels.grad_epilogue import clip_grads_, unscale_and_norm_
from shardkit.kernels.lamb import lamb_step
from shardkit.kernels.lion import lion_step
from shardkit.kernels.sgd import sgd_step
from tolerances import FP32, LAMB_LOWP_UPDATE_RTOL, LOWP_NO_MASTER, assert_lowp_step_close, assert_rounded_from

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# full chunks of BLOCK=1024 (aligned, vectorized) next to tails: a 1000-element bias, GPT-2's
# vocabulary, a scalar, and sizes around the block boundary
SIZES = (1 << 20, 1000, 50257, 1, 1023, 1024, 1025, 3 * 768)


def _tensors(device: str = "cuda", seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [scale * torch.randn(n, device=device, generator=gen) for n in SIZES]


def _adam(backend: str, params, grads, masters=(), *, grad_scale=None, maximize=False, step=3):
    ms = [torch.zeros_like(m if masters else p) for p, m in zip(params, masters or params)]
    vs = [torch.zeros_like(m) for m in ms]
    for s in range(1, step + 1):
        adam_step(
            params,
            [g.clone() for g in grads],  # fresh grads each step: the torch backend unscales them in place
            ms,
            vs,
            [],
            list(masters),
            step=s,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            decoupled=True,
            amsgrad=False,
            maximize=maximize,
            grad_scale=grad_scale,
            backend=backend,
        )
    return ms, vs


@pytest.mark.parametrize("maximize", [False, True])
def test_adam_aligned_fp32_matches_torch(maximize: bool) -> None:
    params, grads = _tensors(), _tensors(seed=1)
    out = {}
    for backend in ("triton", "torch"):
        ps = [p.clone() for p in params]
        out[backend] = (ps, *_adam(backend, ps, grads, maximize=maximize))
    for a, b in zip(out["triton"], out["torch"]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **FP32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adam_lowp_with_master_matches_fp32_reference(dtype: torch.dtype) -> None:
    """fp16/bf16 params + fp32 masters: the master follows fp32 Adam; the param is its rounding."""
    reference = _tensors()
    grads32 = _tensors(seed=1)
    grads = [g.to(dtype) for g in grads32]
    masters = [r.clone() for r in reference]
    params = [m.to(dtype) for m in masters]
    _adam("triton", params, grads, masters)
    _adam("torch", reference, [g.float() for g in grads])  # fed the same (rounded) gradients
    for p, m, r in zip(params, masters, reference):
        torch.testing.assert_close(m, r, **FP32)
        assert_rounded_from(p, m)  # compiled: round to nearest even, exactly torch's


def test_adam_grad_scale_matches_torch() -> None:
    """A GradScaler-style fp32 [1] scale divides the grads in the kernel."""
    params, grads = _tensors(), _tensors(seed=1, scale=1024.0)
    scale = torch.full((1,), 1024.0, device="cuda")
    out = {}
    for backend in ("triton", "torch"):
        ps = [p.clone() for p in params]
        _adam(backend, ps, [g.clone() for g in grads], grad_scale=scale)
        out[backend] = ps
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(maximize: bool, nesterov: bool) -> None:
    params, grads = _tensors(), _tensors(seed=1)
    out = {}
    for backend in ("triton", "torch"):
        ps, bufs = [p.clone() for p in params], [torch.empty_like(p) for p in params]
        for first in (True, False):
            sgd_step(
                ps,
                grads,
                bufs,
                [],
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                weight_decay=1e-4,
                nesterov=nesterov,
                maximize=maximize,
                first_step=first,
                backend=backend,
            )
        out[backend] = ps + bufs
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("maximize", [False, True])
def test_lion_bf16_master_matches_torch(maximize: bool) -> None:
    params32, grads = _tensors(), [g.to(torch.bfloat16) for g in _tensors(seed=1)]
    out = {}
    for backend in ("triton", "torch"):
        masters = [p.clone() for p in params32]
        ps, ms = [m.to(torch.bfloat16) for m in masters], [torch.zeros_like(m) for m in masters]
        lion_step(ps, grads, ms, masters, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, maximize=maximize, backend=backend)
        out[backend] = (ps, masters, ms)
        for p, m in zip(ps, masters):
            assert_rounded_from(p, m)
    for a, b in zip(out["triton"][1:], out["torch"][1:]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **FP32)


def _lamb(backend: str, params, grads, masters=(), grad_scale=None):
    ms, vs = [torch.zeros_like(p) for p in (masters or params)], [torch.zeros_like(p) for p in (masters or params)]
    for s in (1, 2):
        lamb_step(
            params,
            grads,
            ms,
            vs,
            list(masters),
            step=s,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            weight_norm_clip=(0.0, 10.0),
            grad_scale=grad_scale,
            backend=backend,
        )
    return ms, vs


def test_lamb_matches_torch_and_is_bitwise_reproducible() -> None:
    """Fixed-order norms: repeated compiled launches give identical bits (fp32 atomics did not)."""
    params, grads = _tensors(), _tensors(seed=1)
    scale = torch.full((1,), 2.0, device="cuda")
    runs = []
    for _ in range(3):
        ps = [p.clone() for p in params]
        _lamb("triton", ps, [2.0 * g for g in grads], grad_scale=scale)
        torch.cuda.synchronize()
        runs.append(ps)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "LAMB differs between identical launches"
    ref = [p.clone() for p in params]
    _lamb("torch", ref, grads)
    for a, b in zip(runs[0], ref):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lamb_lowp_without_master_matches_torch(dtype: torch.dtype) -> None:
    params, grads = [p.to(dtype) for p in _tensors()], [g.to(dtype) for g in _tensors(seed=1)]
    out = {}
    for backend in ("triton", "torch"):
        ps = [p.clone() for p in params]
        lamb_step(
            ps,
            grads,
            [torch.zeros_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps],
            [],
            step=1,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            backend=backend,
        )
        out[backend] = ps
    for a, b, before in zip(out["triton"], out["torch"], params):
        assert_lowp_step_close(a, b, before, update_rtol=LAMB_LOWP_UPDATE_RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flatten_and_epilogue_match_torch(dtype: torch.dtype) -> None:
    grads = [g.to(dtype) for g in _tensors(seed=2)]
    offsets, total = bucket_layout([g.numel() for g in grads], align=ALIGN_ELEMENTS, pad_to_multiple_of=128)
    flats, outs, stats, clipped = {}, {}, {}, {}
    for backend in ("triton", "torch"):
        flat = torch.zeros(total, device="cuda")
        flatten_into(grads, flat, offsets, backend=backend)  # exact widening
        outs[backend] = [torch.empty_like(g) for g in grads]
        unflatten_from(flat, outs[backend], offsets, scale=0.5, backend=backend)  # rounded once
        flats[backend] = flat
        gs = [g.to(torch.float32, copy=True) for g in grads]  # the epilogue works in place: one copy per backend
        stats[backend] = unscale_and_norm_(gs, inv_scale=torch.full((1,), 0.25, device="cuda"), backend=backend)
        clip_grads_(gs, stats[backend].sumsq, max_norm=1.0, backend=backend)
        clipped[backend] = gs
    assert torch.equal(flats["triton"], flats["torch"])
    for a, b, g in zip(outs["triton"], outs["torch"], grads):
        assert torch.equal(a, b)
        assert_rounded_from(a, 0.5 * g.float())
    torch.testing.assert_close(stats["triton"].sumsq, stats["torch"].sumsq, rtol=1e-5, atol=0)
    assert torch.equal(stats["triton"].found_inf, stats["torch"].found_inf)
    for a, b in zip(clipped["triton"], clipped["torch"]):
        torch.testing.assert_close(a, b, **FP32)


def _check_cross_entropy_shards(dtype: torch.dtype, device: str, tokens: int, vocab: int, tp: int) -> None:
    smoothing = 0.1
    gen = torch.Generator(device=device).manual_seed(3)
    full = (4 * torch.randn(tokens, vocab, device=device, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    target[::7] = -100
    ref = full.float().requires_grad_()
    per_token_ref = F.cross_entropy(ref, target, label_smoothing=smoothing, reduction="none")
    per_token_ref.sum().backward()  # coef 1 per token: gradients of order 1, not 1/T
    width = -(-vocab // tp)
    shards, stats = [], []
    for r in range(tp):
        n_valid = min(width, vocab - r * width)
        shard = torch.randn(tokens, width, device=device, generator=gen).to(dtype)  # pad columns: garbage
        shard[:, :n_valid] = full[:, r * width : r * width + n_valid]
        shards.append((shard, n_valid))
        stats.append(ce_shard_stats(shard, target, vocab_start=r * width, n_valid=n_valid, backend="triton"))
    s = torch.stack(stats)  # [tp, 4, T]: combined as the tp all-reduces would
    m = s[:, 0].amax(0)
    lse = m + torch.log((s[:, 1] * torch.exp(s[:, 0] - m)).sum(0))
    keep = target != -100
    per_token = lse - (1 - smoothing) * s[:, 2].sum(0) - smoothing / vocab * s[:, 3].sum(0)
    torch.testing.assert_close(torch.where(keep, per_token, 0.0), per_token_ref.detach(), rtol=1e-5, atol=1e-4)
    coef = torch.ones(tokens, device=device)
    tol = FP32 if dtype == torch.float32 else LOWP_NO_MASTER[torch.bfloat16]
    for r, (shard, n_valid) in enumerate(shards):
        grad = ce_grad(
            shard,
            target,
            lse,
            coef,
            vocab_size=vocab,
            vocab_start=r * width,
            n_valid=n_valid,
            label_smoothing=smoothing,
            backend="triton",
        )
        torch.testing.assert_close(grad[:, :n_valid].float(), ref.grad[:, r * width : r * width + n_valid], **tol)
        assert torch.all(grad[:, n_valid:] == 0) and torch.all(grad[~keep] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_shards_match_autograd_on_gpt2_vocab(dtype: torch.dtype) -> None:
    """GPT-2's vocabulary (50257) over tp=4 shards of 12565 columns (the last one padded): the
    per-shard statistics combined into each token's loss, and each shard's gradient, against
    autograd of ``F.cross_entropy`` in fp32 on the gathered logits (ignored tokens included)."""
    _check_cross_entropy_shards(dtype, "cuda", tokens=257, vocab=50257, tp=4)


@two_gpus
def test_launch_groups_on_two_devices() -> None:
    """One optimizer step over params on cuda:0 and cuda:1 (one launch group each), launched while
    the current device is cuda:0: each group must run on its own device."""
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    out = {}
    for backend in ("triton", "torch"):
        results = []
        for device in devices:
            params, grads = _tensors(str(device)), _tensors(str(device), seed=1)
            lamb_params = [p.clone() for p in params]
            with torch.cuda.device(0):
                _adam(backend, params, grads)
                _lamb(backend, lamb_params, grads)
            results.append(params + lamb_params)
        out[backend] = results
    for device_a, device_b in zip(out["triton"], out["torch"]):
        for a, b in zip(device_a, device_b):
            torch.testing.assert_close(a, b, **FP32)
