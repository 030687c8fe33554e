"""parallelize() on one GPU over NCCL vs the same model trained by plain torch on that GPU.

The gloo tests (tests/compose/test_parallelize.py and the usage matrix) check the step path on the
CPU, where the Triton kernels run interpreted. This one runs what a one-GPU user runs: a
one-process NCCL world, CUDA tensors, the compiled Triton kernels (bucket flatten and copy-back,
the fused unscale/norm epilogue, the fused optimizers on ZeRO's flat shards), through every dp
strategy's whole step: forward, backward, clip, step. Skipped cleanly without CUDA
(``make test-gpu`` and perf/cuda/gpu_checks.sh run it).

The reference is the unwrapped model on the same GPU with torch's clip and optimizer, same seed.
"""

from __future__ import annotations

import pytest
import torch

from tolerances import ADAM_EPS_ACROSS_ORDERS, FP32

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB, B, T, STEPS, CLIP = 59, 8, 16, 5, 0.3


def _model(device: torch.device) -> torch.nn.Module:
    from shardkit.models import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(VOCAB, d_model=32, n_layers=2, n_heads=4, seq_len=T, tie_embeddings=True).to(device)


def _batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randint(VOCAB, (B, T), generator=gen).to(device), torch.randint(VOCAB, (B, T), generator=gen).to(device))
        for _ in range(STEPS)
    ]


def _make_optimizer(kind: str):  # noqa: ANN202 - (factory, kwargs)
    from shardkit.kernels import FusedAdamW

    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.3, "momentum": 0.9}
    if kind == "torch_adamw":
        return torch.optim.AdamW, {"lr": 1e-2, "eps": ADAM_EPS_ACROSS_ORDERS, "weight_decay": 0.1}
    return FusedAdamW, {"lr": 1e-2, "eps": ADAM_EPS_ACROSS_ORDERS, "weight_decay": 0.1}


def _reference(device: torch.device, optimizer: str) -> tuple[torch.nn.Module, list[float], list[float]]:
    from shardkit.models import lm_loss

    model = _model(device)
    factory, kwargs = _make_optimizer("torch_adamw" if optimizer == "fused_adamw" else optimizer)
    opt = factory(model.parameters(), **kwargs)
    losses, norms = [], []
    for x, y in _batches(device):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses, norms


@pytest.mark.parametrize(
    ("dp", "optimizer", "fp16_scaler", "checkpointing"),
    [
        ("none", "sgd", False, False),
        ("ddp", "sgd", False, False),
        ("ddp", "sgd", True, True),
        ("zero1", "fused_adamw", False, False),
        ("zero2", "sgd", True, False),
        ("zero2", "fused_adamw", False, True),
        ("zero3", "sgd", False, False),
        ("zero3", "fused_adamw", True, False),
    ],
)
def test_parallelize_on_one_gpu_trains_like_torch(dp: str, optimizer: str, fp16_scaler: bool, checkpointing: bool) -> None:
    train_and_compare(dp, optimizer, fp16_scaler, checkpointing, torch.device("cuda", 0), "nccl")


def train_and_compare(
    dp: str, optimizer: str, fp16_scaler: bool, checkpointing: bool, device: torch.device, backend: str
) -> None:
    """One process: ``parallelize(dp=dp)`` on ``device`` over ``backend`` vs :func:`_reference`."""
    from shardkit.comm import ParallelContext
    from shardkit.models import gpt_blocks
    from shardkit.parallel import DynamicLossScaler, parallelize

    ref_model, ref_losses, ref_norms = _reference(device, optimizer)
    with ParallelContext.from_env(backend=backend) as ctx:
        # a power-of-two scale that never overflows here: scaling and unscaling are exact, so the
        # scaled run must match the fp32 reference as closely as the unscaled one
        scaler = DynamicLossScaler(initial_scale_power=10, hysteresis=2) if fp16_scaler else None
        kwargs = {"blocks": gpt_blocks, "checkpointing": True} if checkpointing else {}
        par = parallelize(_model(device), ctx, dp=dp, loss_scaler=scaler, **kwargs)
        factory, opt_kwargs = _make_optimizer(optimizer)
        opt = par.make_optimizer(factory, par.parameters(), **opt_kwargs)
        losses, norms = [], []
        for x, y in _batches(device):
            opt.zero_grad(set_to_none=True)
            loss = par.forward_backward(x, y)
            norms.append(float(par.clip(CLIP)))
            par.step(opt)
            losses.append(float(loss))
        assert par.skipped_steps == 0
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=0.0)
        module = getattr(par.module, "module", par.module)
        state = par.module.full_state_dict() if dp.startswith("zero") else module.state_dict()
        for key, want in ref_model.state_dict().items():
            got = state[key]
            assert got.device.type in ("cuda", "cpu"), key
            torch.testing.assert_close(got.to(device), want, **FP32, msg=lambda m, key=key: f"{key}: {m}")
