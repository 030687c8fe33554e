"""The demo trainer's learning-rate schedule: linear warmup, then cosine decay."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr``, then cosine to ``lr * min_ratio``.

    Args:
        step: 0-based optimizer step.
        lr: peak learning rate.
        warmup: warmup steps (the first reaches ``lr / warmup``, step ``warmup - 1`` reaches ``lr``).
        total: total steps of the run (the last one lands on ``lr * min_ratio``).
        min_ratio: final lr / peak lr.

    Example:
        >>> [round(lr_at(s, lr=1.0, warmup=2, total=6, min_ratio=0.0), 3) for s in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.25, 0.0]
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = total - warmup - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
