"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's signatures and defaults.

Both are :class:`shardkit.kernels.FusedAdam` (one update rule, Triton kernels on the GPU) with
DeepSpeed's argument names. What the names mean is DeepSpeed's, not torch's: ``adam_w_mode=True``
(``adamw_mode`` for the CPU one) is the default, so a bare ``FusedAdam(params)`` decays weights
decoupled, as ``torch.optim.AdamW`` does, and ``adam_w_mode=False`` is Adam with L2 decay added to
the gradient, as ``torch.optim.Adam`` (tests/engine/test_deepspeed_optimizers.py checks both
against torch). Passed to ``initialize`` at ZeRO >= 1 they are rebuilt on the shards, mode
included ([Note: a built optimizer, rebuilt] in shardkit/engine/entry.py).

Example:
    >>> from shardkit.deepspeed.ops.adam import FusedAdam      # was: from deepspeed.ops.adam import FusedAdam
    >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)   # decoupled, as DeepSpeed
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardkit.kernels import FusedAdam as _FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(_FusedAdam):
    """DeepSpeed's ``FusedAdam``: Adam whose ``adam_w_mode=True`` default decouples the weight decay.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.Adam``.
        bias_correction: must be True (False raises ``NotImplementedError``).
        adam_w_mode: True (default): decoupled decay (AdamW); False: L2 decay (Adam).
        set_grad_none: accepted; ``zero_grad()`` sets grads to None by default, as torch does.

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if not bias_correction:
            raise NotImplementedError(
                f"{type(self).__name__}(bias_correction=False) is not offered: shardkit's Adam always corrects the "
                "moments' bias (torch.optim.Adam's rule)"
            )
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, decoupled_weight_decay=adam_w_mode
        )


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode=True`` by default): the same update on the CPU.

    DeepSpeed's version is a compiled CPU kernel for ZeRO-Offload; here it is :class:`FusedAdam`
    under DeepSpeed's other argument order (on CPU tensors it runs torch's or the interpreted
    kernel path), and ZeRO's offload is a config key (``offload_optimizer``), not an optimizer class.

    Args:
        model_params: parameters or param groups.
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.Adam``.
        bias_correction: must be True.
        adamw_mode: True (default): decoupled decay; False: L2 decay.
        fp32_optimizer_states: must be True (the moments are fp32, as the masters).

    Example:
        >>> opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-3)
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not offered: moments are fp32")
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
