"""``FusedLion``: the Lion optimizer (Chen et al. 2023) with fused multi-tensor kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .lion import lion_step
from .optim_base import FusedOptimizer, check_betas, check_nonneg

__all__ = ["FusedLion"]


class FusedLion(FusedOptimizer):
    """Lion (EvoLved Sign Momentum) with one multi-tensor Triton launch per launch group.

    Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2::

        c = b1 * m + (1 - b1) * g
        w = w * (1 - lr * weight_decay) - lr * sign(c)
        m = b2 * m + (1 - b2) * g

    Every coordinate moves by exactly ``lr`` (plus decay), so Lion wants an ``lr`` about 3-10x
    smaller and a ``weight_decay`` 3-10x larger than AdamW's (the paper's advice).

    Args:
        params: iterable of tensors or of param-group dicts.
        lr: learning rate (float or 0-d tensor, >= 0).
        betas: ``(b1, b2)`` in [0, 1): interpolation for the update, decay of the momentum.
        weight_decay: decoupled weight decay (>= 0).
        maximize: maximize the objective instead of minimizing it.
        master_weights: keep fp32 master params and momentum for fp16/bf16 params.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :class:`FusedOptimizer`).

    State per param: ``exp_avg`` (the momentum ``m``), plus ``master_param`` (fp32) with
    ``master_weights``.

    Example:
        >>> opt = FusedLion(model.parameters(), lr=1e-4, weight_decay=0.1)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    _fp32_state_keys = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        backend: str = "auto",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, master_weights=master_weights, backend=backend)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_nonneg("lr", group["lr"])
        check_nonneg("weight_decay", group["weight_decay"])
        check_betas(group["betas"])

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["exp_avg"] = self._zeros_state(p)

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        beta1, beta2 = (float(b) for b in group["betas"])
        lion_step(
            params,
            self._grads(params),
            [s["exp_avg"] for s in states],
            self._masters(params),
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
            grad_scale=grad_scale,
            backend=self.backend,
        )
