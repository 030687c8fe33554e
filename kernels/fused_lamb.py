"""``FusedLAMB``: layer-wise adaptive large-batch optimizer (You et al. 2019), fused kernels."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from .lamb import lamb_step
from .optim_base import FusedOptimizer, check_betas, check_nonneg

__all__ = ["FusedLAMB"]


class FusedLAMB(FusedOptimizer):
    """LAMB with two multi-tensor Triton launches per launch group.

    You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
    Algorithm 2, per parameter tensor ``w`` (a "layer")::

        m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2
        r = m_hat / (sqrt(v_hat) + eps)          (m_hat = m / (1 - b1^t), v_hat likewise)
        u = r + weight_decay * w
        w = w - lr * trust * u,   trust = phi(||w||) / ||u||   (1 if either norm is 0)

    ``phi`` clamps ``||w||`` to ``weight_norm_clip = (gamma_l, gamma_u)``. The per-tensor norms
    are why LAMB takes **two launches** per launch group where the other fused optimizers take
    one (moments + norms, then apply); a group that is not adapted takes one. See
    [Note: LAMB launches] in :mod:`shardkit.kernels.lamb`.

    Args:
        params: iterable of tensors or of param-group dicts.
        lr: learning rate (float or 0-d tensor, >= 0).
        betas: ``(b1, b2)`` in [0, 1).
        eps: added to ``sqrt(v_hat)`` (>= 0).
        weight_decay: decoupled weight decay folded into the update ``u`` (>= 0).
        bias_correction: divide the moments by ``1 - beta^t`` (Apex's default; the cybertronai
            ``pytorch-lamb`` reference omits it).
        weight_norm_clip: ``(min, max)`` for ``phi(||w||)``, ``0 <= min <= max``; ``max`` may be
            ``float("inf")``. The default ``(0.0, 10.0)`` is ``pytorch-lamb``'s ``clamp_value``;
            ``(0.0, inf)`` is Apex's (no clamp).
        max_trust_ratio: upper bound on the trust ratio (``None``: unbounded; timm's
            ``trust_clip`` is ``1.0``).
        always_adapt: apply the trust ratio in groups with ``weight_decay == 0`` too. ``False``
            (Apex/NVLAMB's default) updates such groups — typically biases and norm weights —
            with ``trust = 1``, as BERT's recipe excludes them from layer adaptation; ``True``
            is the paper's algorithm on every tensor.
        maximize: maximize the objective instead of minimizing it.
        master_weights: keep fp32 master params and moments for fp16/bf16 params.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :class:`FusedOptimizer`).

    State per param: ``step`` (float32 CPU scalar), ``exp_avg``, ``exp_avg_sq``, plus
    ``master_param`` (fp32) with ``master_weights``.

    Example:
        >>> no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
        >>> decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
        >>> opt = FusedLAMB([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        ...                 lr=2e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    _fp32_state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        weight_norm_clip: tuple[float, float] = (0.0, 10.0),
        max_trust_ratio: float | None = None,
        always_adapt: bool = False,
        maximize: bool = False,
        master_weights: bool = False,
        backend: str = "auto",
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
        super().__init__(params, defaults, master_weights=master_weights, backend=backend)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_nonneg("lr", group["lr"])
        check_nonneg("eps", group["eps"])
        check_nonneg("weight_decay", group["weight_decay"])
        check_betas(group["betas"])
        clip = group["weight_norm_clip"]
        if not isinstance(clip, (tuple, list)) or len(clip) != 2:
            raise ValueError(f"weight_norm_clip must be a pair (min, max), got {clip!r}")
        lo, hi = float(clip[0]), float(clip[1])
        if not 0.0 <= lo <= hi:  # also rejects NaN
            raise ValueError(f"Invalid weight_norm_clip: {clip!r} (need 0 <= min <= max)")
        ratio = group["max_trust_ratio"]
        if ratio is not None and not float(ratio) > 0.0:
            raise ValueError(f"Invalid max_trust_ratio: {ratio} (must be > 0, or None)")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = self._step_tensor()
        state["exp_avg"] = self._zeros_state(p)
        state["exp_avg_sq"] = self._zeros_state(p)

    def _launch_group_key(self, state: dict[str, Any], group: dict[str, Any]) -> Hashable:
        return float(state["step"])

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        step = self._advance_steps(params)
        beta1, beta2 = (float(b) for b in group["betas"])
        weight_decay = float(group["weight_decay"])
        ratio = group["max_trust_ratio"]
        lamb_step(
            params,
            self._grads(params),
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            self._masters(params),
            step=step,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=weight_decay,
            bias_correction=bool(group["bias_correction"]),
            weight_norm_clip=tuple(float(c) for c in group["weight_norm_clip"]),
            max_trust_ratio=float("inf") if ratio is None else float(ratio),
            adapt=bool(group["always_adapt"]) or weight_decay != 0.0,
            maximize=bool(group["maximize"]),
            grad_scale=grad_scale,
            backend=self.backend,
        )
