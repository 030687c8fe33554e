"""``FusedAdam`` / ``FusedAdamW``: drop-in replacements for ``torch.optim.Adam`` / ``AdamW``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from .adam import adam_step
from .optim_base import LaunchGroup, FusedOptimizer, check_betas, check_nonneg

__all__ = ["FusedAdam", "FusedAdamW"]


class FusedAdam(FusedOptimizer):
    """Adam with one multi-tensor Triton launch per launch group (see ``torch.optim.Adam``).

    Same constructor arguments and semantics as ``torch.optim.Adam`` (``weight_decay`` is L2
    added to the gradient unless ``decoupled_weight_decay=True``), plus:

    Args:
        master_weights: keep fp32 master params and moments for fp16/bf16 params.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :class:`FusedOptimizer`).

    ``foreach`` and ``fused`` are accepted for drop-in compatibility and ignored (this optimizer
    is always fused); ``capturable`` and ``differentiable`` must be False. ``state_dict()`` saves
    ``fused=True`` so a ``torch.optim.Adam(fused=True)`` that loads it stays fused, and
    ``load_state_dict`` keeps these flags as constructed (see [Note: implementation flags] in
    :mod:`shardkit.kernels.optim_base`). ``torch.compile(opt.step)`` runs the update eagerly
    behind a graph break.

    State per param: ``step`` (float32 CPU scalar), ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with ``amsgrad`` — the keys of ``torch.optim.Adam`` — plus
    ``master_param`` (fp32) with ``master_weights``.

    Example:
        >>> model = torch.nn.Linear(16, 4).cuda()
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 16, device="cuda")).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    _fp32_state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        master_weights: bool = False,
        backend: str = "auto",
    ) -> None:
        if capturable:
            raise ValueError("capturable=True is not supported by shardkit's fused optimizers")
        if differentiable:
            raise ValueError("differentiable=True is not supported by shardkit's fused optimizers")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, master_weights=master_weights, backend=backend)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_nonneg("lr", group["lr"])
        check_nonneg("eps", group["eps"])
        check_nonneg("weight_decay", group["weight_decay"])
        check_betas(group["betas"])

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = self._step_tensor()
        state["exp_avg"] = self._zeros_state(p)
        state["exp_avg_sq"] = self._zeros_state(p)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._zeros_state(p)

    def _launch_group_key(self, state: dict[str, Any], group: dict[str, Any]) -> Hashable:
        return float(state["step"])

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> None:
        amsgrad = bool(group["amsgrad"])
        cache = params.cache if isinstance(params, LaunchGroup) else {}
        lists = cache.get(("lists", amsgrad))
        if lists is None:  # gathered once per plan (see LaunchGroup)
            states = [self.state[p] for p in params]
            if amsgrad:
                for p, s in zip(params, states):
                    s.setdefault("max_exp_avg_sq", self._zeros_state(p))
            lists = (
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                self._masters(params),
            )
            cache[("lists", amsgrad)] = lists
        self._advance_steps(params)
        beta1, beta2 = (float(b) for b in group["betas"])
        adam_step(
            params,
            [p.grad for p in params],
            *lists,  # adam_step makes grads contiguous if needed
            step=self.state[params[0]]["step"],
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", self._decoupled_default)),
            amsgrad=amsgrad,
            maximize=bool(group["maximize"]),
            grad_scale=grad_scale,
            backend=self.backend,
        )


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) with fused multi-tensor Triton kernels.

    Same constructor arguments and semantics as ``torch.optim.AdamW`` (default
    ``weight_decay=1e-2``); see :class:`FusedAdam` for the extras (``master_weights``,
    ``backend``) and the state layout.

    Example:
        >>> opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        >>> loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    """

    _decoupled_default = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            master_weights=master_weights,
            backend=backend,
        )
