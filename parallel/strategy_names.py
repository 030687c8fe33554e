"""The data-parallel strategy names: the one list every entry point takes its choices from.

``parallelize(dp=...)``, ``make_strategy``, ``shardkit train --strategy`` (and its
:class:`~shardkit.train.TrainConfig` field), and the DeepSpeed-config engine's ZeRO stage all
read their names here. The module imports nothing but the standard library, so the CLI can list
the choices without loading torch.

Example:
    >>> from shardkit.parallel.strategy_names import DP_STRATEGIES, dp_strategy_of_zero_stage
    >>> DP_STRATEGIES
    ('none', 'ddp', 'zero1', 'zero2', 'zero3')
    >>> dp_strategy_of_zero_stage(0), dp_strategy_of_zero_stage(2)
    ('ddp', 'zero2')
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["DP_STRATEGIES", "DpStrategy", "STRATEGY_MODULES", "dp_strategy_of_zero_stage"]

#: a data-parallel strategy name (a type for signatures; the values are :data:`DP_STRATEGIES`)
DpStrategy = Literal["none", "ddp", "zero1", "zero2", "zero3"]

#: the built-in strategy names, in order of increasing sharding
DP_STRATEGIES: tuple[str, ...] = typing.get_args(DpStrategy)

#: the module that defines and registers each built-in strategy's class (imported on first use)
STRATEGY_MODULES: dict[str, str] = {
    name: "shardkit.parallel.strategy" if name in ("none", "ddp") else "shardkit.parallel.zero.zero_strategies"
    for name in DP_STRATEGIES
}


def dp_strategy_of_zero_stage(stage: int) -> str:
    """The strategy name of a DeepSpeed ZeRO stage: 0 is plain data parallelism (``"ddp"``).

    Args:
        stage: 0, 1, 2 or 3.

    Raises:
        ValueError: any other stage.

    Example:
        >>> dp_strategy_of_zero_stage(3)
        'zero3'
    """
    name = "ddp" if stage == 0 else f"zero{stage}"
    if isinstance(stage, bool) or name not in DP_STRATEGIES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return name
