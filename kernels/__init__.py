"""Triton kernels, their launchers, and the torch-facing classes that wrap them.

Imports ``torch`` and ``triton`` only (never ``torch.distributed``). Nothing runs at import.

Example:
    >>> from shardkit.kernels import FusedAdamW
    >>> opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
"""

from .fused_adam import FusedAdam, FusedAdamW
from .fused_lamb import FusedLAMB
from .fused_lion import FusedLion
from .fused_sgd import FusedSGD
from .runtime import count_launches

__all__ = ["FusedAdam", "FusedAdamW", "FusedLAMB", "FusedLion", "FusedSGD", "count_launches"]
