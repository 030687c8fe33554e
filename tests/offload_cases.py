"""The model, batches, param groups and training step shared by the ZeRO offload tests (test_zero_offload*.py)."""

from __future__ import annotations

import torch
from torch import nn
from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from tolerances import ADAM_EPS_ACROSS_ORDERS


GLOBAL_BATCH = 8

IN, HID, OUT = 16, 32, 16

OPTIMIZERS = {
    "fused_adamw": (FusedAdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "torch_adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS_ACROSS_ORDERS)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def offload_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT)).to(dtype)


def offload_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def offload_rows(ctx: ParallelContext) -> slice:
    per = GLOBAL_BATCH // ctx.size("dp")
    return slice(ctx.rank("dp") * per, (ctx.rank("dp") + 1) * per)


def offload_groups(module: nn.Module) -> list[dict]:
    """No decay and half the lr for biases, given with the ORIGINAL params."""
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    biases = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": biases, "weight_decay": 0.0, "lr": 0.005}]


def offload_train_step(sdp, opt, ctx, step, dtype) -> None:
    x, y = offload_batch(step)
    opt.zero_grad()
    nn.functional.mse_loss(sdp(x[offload_rows(ctx)].to(dtype)).float(), y[offload_rows(ctx)]).backward()
    opt.step()
