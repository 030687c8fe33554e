"""``deepspeed.utils``: the helpers DeepSpeed example scripts import from it.

``RepeatingLoader`` here; ``deepspeed.utils.zero_to_fp32`` (a checkpoint → one fp32 state dict)
is :mod:`shardkit.deepspeed.utils.zero_to_fp32`.

Example:
    >>> from shardkit.deepspeed.utils import RepeatingLoader     # was: from deepspeed.utils import ...
    >>> batches = iter(RepeatingLoader(loader))                 # never ends: restarts the loader
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader", "logger", "zero_to_fp32"]

#: ``deepspeed.utils.logger``: scripts log through it (``logger.info(...)``); shardkit's logger
#: for the facade, configured like any ``logging`` logger
logger = logging.getLogger("shardkit.deepspeed")


class RepeatingLoader:
    """Iterate ``loader`` forever, starting it again each time it is exhausted (DeepSpeed's
    ``RepeatingLoader``, used with pipeline engines' ``train_batch(data_iter=...)``). A
    ``DistributedSampler``'s epoch is not advanced: call ``set_epoch`` yourself to reshuffle.

    Args:
        loader: any re-iterable (a DataLoader, a list of batches).

    Example:
        >>> it = iter(RepeatingLoader([1, 2]))
        >>> [next(it) for _ in range(5)]
        [1, 2, 1, 2, 1]
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration here: nothing to repeat


def __getattr__(name: str) -> Any:
    # ``deepspeed.utils.zero_to_fp32`` is reachable as an attribute after ``import deepspeed``
    if name == "zero_to_fp32":
        import importlib

        return importlib.import_module(f"{__name__}.zero_to_fp32")
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}: not offered under shardkit; docs/engine.md "
        '("DeepSpeed\'s module-level API") lists what is supported, adapted or not offered, and why'
    )
