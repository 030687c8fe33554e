"""The fused optimizers paired with their references, a small model and its training loop, shared by the optimizer tests."""

from __future__ import annotations

from typing import Any
import torch
from torch import nn
from shardkit.kernels.fused_adam import FusedAdam, FusedAdamW
from shardkit.kernels.fused_lamb import FusedLAMB
from shardkit.kernels.fused_lion import FusedLion
from shardkit.kernels.fused_sgd import FusedSGD


# ---- written-out references (the test oracles for optimizers torch does not ship) ----------
class ReferenceLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2), one tensor at a time, in the param's dtype (fp32)."""

    def __init__(
        self, params: Any, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, maximize: bool = False
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, (b1, b2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = b1 * m + (1 - b1) * g
                p.mul_(1 - lr * wd).sub_(lr * torch.sign(c))
                m.mul_(b2).add_((1 - b2) * g)


class ReferenceLAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2019, Algorithm 2), one tensor at a time, in the param's dtype (fp32)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        weight_norm_clip=(0.0, 10.0),
        max_trust_ratio: float | None = None,
        always_adapt: bool = False,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            weight_norm_clip=weight_norm_clip,
            max_trust_ratio=max_trust_ratio,
            always_adapt=always_adapt,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            lo, hi = group["weight_norm_clip"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if "step" not in state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                m_hat, v_hat = (m / (1 - b1**t), v / (1 - b2**t)) if group["bias_correction"] else (m, v)
                u = m_hat / (v_hat.sqrt() + eps) + wd * p
                trust = torch.tensor(1.0)
                w_norm, u_norm = p.norm(), u.norm()
                if (group["always_adapt"] or wd != 0) and w_norm > 0 and u_norm > 0:
                    trust = w_norm.clamp(lo, hi) / u_norm
                    if group["max_trust_ratio"] is not None:
                        trust = trust.clamp(max=group["max_trust_ratio"])
                p.sub_(lr * trust * u)


#: name -> (fused class, reference class)
PAIRS: dict[str, tuple[type, type]] = {
    "adam": (FusedAdam, torch.optim.Adam),
    "adamw": (FusedAdamW, torch.optim.AdamW),
    "sgd": (FusedSGD, torch.optim.SGD),
    "lion": (FusedLion, ReferenceLion),
    "lamb": (FusedLAMB, ReferenceLAMB),
}

#: one representative configuration each, with learning rates that move params visibly
DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": dict(lr=1e-2, weight_decay=0.01, amsgrad=True),
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "sgd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "lion": dict(lr=1e-3, weight_decay=0.1),
    "lamb": dict(lr=1e-2),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 9), nn.Tanh(), nn.Linear(9, 5))


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(6, 13, generator=gen), torch.randn(6, 5, generator=gen)
    return ((model(x) - y) ** 2).mean()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, start: int = 0, sched: Any = None) -> None:
    for i in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, i).backward()
        opt.step()
        if sched is not None:
            sched.step()
