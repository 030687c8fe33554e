"""``FusedSGD``: a drop-in replacement for ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from .optim_base import FusedOptimizer, check_nonneg
from .sgd import sgd_step

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, Nesterov) with one multi-tensor Triton launch per launch group.

    Same constructor arguments and semantics as ``torch.optim.SGD``::

        g   = grad (+ weight_decay * w)          (negated first if maximize)
        buf = g  on the first step,  else  momentum * buf + (1 - dampening) * g
        g   = g + momentum * buf  (nesterov)  |  buf
        w   = w - lr * g

    Args:
        params: iterable of tensors or of param-group dicts.
        lr: learning rate (float or 0-d tensor, >= 0).
        momentum: momentum factor ``mu`` (>= 0); 0 keeps no buffer.
        dampening: dampening of the gradient's contribution to the buffer.
        weight_decay: L2 penalty added to the gradient (>= 0).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        maximize: maximize the objective instead of minimizing it.
        foreach, fused: accepted for drop-in compatibility and ignored (always fused);
            ``state_dict()`` saves ``fused=True`` so a ``torch.optim.SGD(fused=True)`` loading
            it stays fused (see [Note: implementation flags] in :mod:`shardkit.kernels.optim_base`).
        differentiable: must be False.
        master_weights: keep fp32 master params and momentum buffers for fp16/bf16 params.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :class:`FusedOptimizer`).

    State per param: ``momentum_buffer`` (only once a step with ``momentum != 0`` has run, as in
    torch 2.13, which stores nothing for plain SGD), plus ``master_param`` (fp32) with
    ``master_weights``. State dicts load into ``torch.optim.SGD`` and back.

    Example:
        >>> model = torch.nn.Linear(16, 4).cuda()
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(8, 16, device="cuda")).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    _fp32_state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        backend: str = "auto",
    ) -> None:
        if differentiable:
            raise ValueError("differentiable=True is not supported by shardkit's fused optimizers")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=False,
            fused=fused,
        )
        super().__init__(params, defaults, master_weights=master_weights, backend=backend)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_nonneg("lr", group["lr"])
        check_nonneg("momentum", group["momentum"])
        check_nonneg("weight_decay", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "nesterov=True requires momentum > 0 and dampening == 0 "
                f"(got momentum={group['momentum']}, dampening={group['dampening']})"
            )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        pass  # the momentum buffer is created by the first step that uses it (see _update)

    def _launch_group_key(self, state: dict[str, Any], group: dict[str, Any]) -> Hashable:
        # params whose buffer does not exist yet take the kernel's FIRST_STEP variant
        return group["momentum"] != 0 and state.get("momentum_buffer") is None

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        momentum = float(group["momentum"])
        first_step = False
        if momentum != 0.0:
            first_step = states[0].get("momentum_buffer") is None
            if first_step:
                for p, s in zip(params, states):
                    # the param's layout (preserve_format): the kernel addresses param, grad and
                    # buffer as one flat memory order; FIRST_STEP writes every element
                    s["momentum_buffer"] = torch.empty_like(p, dtype=self._state_dtype(p))
        sgd_step(
            params,
            self._grads(params),
            [s["momentum_buffer"] for s in states] if momentum != 0.0 else [],
            self._masters(params),
            lr=float(group["lr"]),
            momentum=momentum,
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
            first_step=first_step,
            grad_scale=grad_scale,
            backend=self.backend,
        )
